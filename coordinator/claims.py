"""What a node's step reports may claim, checked against the plan: pure functions of (plan, reports).

A legitimate member can lie (or be broken), so a claim that ends or steers the job needs the plan's backing and
the other nodes' agreement:

- **The loss** of a step is taken only from the nodes the plan makes responsible for it: the last stage of the
  pipeline the report names (`loss_refusal`).
- **The step** must be consistent with what the reporter's peers report (the other nodes of its replica group;
  in a synchronous plan, every other node): at most `STEP_WINDOW` steps past the newest step any of them reported
  under the same plan epoch, or past the plan's resume step (`step_refusal`). The nodes of one group step together (a pipeline's stages once
  a step, its replicas and pipelines through their gradient average), so an honest node is never that far ahead;
  a report that is (a peer's reports held back by an outage) is answered "retry later", and the node keeps it.
- **The job's end** needs more than one node (`end_corroborated`): more than half of the group's nodes, at least
  two where it has two or more, each reported a step at or past the group's last under the plan's epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from atoll.plan import Plan

STEP_WINDOW = 128
"""How far (steps) a report may run ahead of the newest step any other node of its group reported. Honest nodes
of one group are a step or two apart (the reporter thread sends each step as it ends); 128 leaves room for a
reporter that fell behind and catches up, and is nothing against a job's length (a forged end claims its last
step)."""


def loss_holders(plan: Plan, pipeline: int) -> frozenset[str]:
    """The nodes whose loss counts for `pipeline`'s steps: its last stage (every replica and tp rank)."""
    if not 0 <= pipeline < len(plan.pipelines) or not plan.pipelines[pipeline].stages:
        return frozenset()
    return frozenset(plan.pipelines[pipeline].stages[-1].nodes)


def loss_refusal(plan: Plan, node_id: str, pipeline: int) -> str:
    """Why `node_id` may not report a loss for `pipeline` under `plan` ("": it may)."""
    holders = loss_holders(plan, pipeline)
    if node_id in holders:
        return ""
    if not holders:
        return f"plan epoch {plan.epoch} has no pipeline {pipeline} (it has {len(plan.pipelines)})"
    return (f"plan epoch {plan.epoch} makes the last stage of pipeline {pipeline} ({', '.join(sorted(holders))}) "
            f"responsible for its loss, not node {node_id}")


def groups_of(plan: Plan) -> dict[str, int]:
    """node -> the replica group it steps with (outer mode: its group's index; a synchronous plan is one group)."""
    if plan.mode == "outer" and plan.groups:
        return {n: g for g in range(len(plan.groups)) for n in plan.group_nodes(g)}
    return {n: 0 for p in plan.pipelines for st in p.stages for n in st.nodes}


def step_refusal(plan: Plan, node_id: str, step: int, peers_newest: int | None, has_peers: bool,
                 window: int = STEP_WINDOW) -> str:
    """Why a report of `step` by `node_id` under `plan` is out of line with its peers' ("": it is not).
    `peers_newest`: the newest step another node of its group reported under the plan's epoch (None: none yet);
    `has_peers`: its group has other nodes (a node alone cannot be corroborated, nor contradicted)."""
    if not has_peers:
        return ""
    base = max(plan.resume_step, peers_newest if peers_newest is not None else plan.resume_step)
    if step <= base + window:
        return ""
    said = f"the newest step its peers reported is {peers_newest}" if peers_newest is not None else \
        f"its peers have reported no step yet (plan epoch {plan.epoch} resumes at step {plan.resume_step})"
    return (f"step {step} is more than {window} steps past what the rest of its group reports ({said}); a report "
            f"that far ahead is taken once they catch up")


class StepProgress:
    """Each node's newest step under each recent plan epoch, and the two newest of each replica group, so a report
    is checked against its peers in O(1) (10,000 nodes report every step). Not thread-safe: the caller locks."""

    def __init__(self, keep_epochs: int = 8):
        self.keep_epochs = keep_epochs
        self._reached: dict[int, dict[str, int]] = {}
        """epoch -> node -> newest step"""
        self._top: dict[tuple[int, int], list[tuple[int, str]]] = {}
        """(epoch, group) -> the (step, node) of its two nodes with the newest steps, newest first"""
        self._groups: dict[int, dict[str, int]] = {}
        self._sizes: dict[int, dict[int, int]] = {}

    def _group_map(self, plan: Plan) -> dict[str, int]:
        groups = self._groups.get(plan.epoch)
        if groups is None:
            groups = self._groups[plan.epoch] = groups_of(plan)
            sizes: dict[int, int] = {}
            for g in groups.values():
                sizes[g] = sizes.get(g, 0) + 1
            self._sizes[plan.epoch] = sizes
        return groups

    def note(self, plan: Plan | None, epoch: int, node_id: str, step: int) -> None:
        """A report of `step` by `node_id` under `epoch` (whose plan is `plan`, None: not known) was taken."""
        by_node = self._reached.setdefault(epoch, {})
        step = by_node[node_id] = max(step, by_node.get(node_id, step))
        if plan is not None:
            g = self._group_map(plan).get(node_id)
            if g is not None:
                top = [x for x in self._top.get((epoch, g), []) if x[1] != node_id] + [(step, node_id)]
                self._top[(epoch, g)] = sorted(top, reverse=True)[:2]
        while len(self._reached) > self.keep_epochs:
            old = min(self._reached)
            del self._reached[old]
            self._groups.pop(old, None)
            self._sizes.pop(old, None)
            for k in [k for k in self._top if k[0] == old]:
                del self._top[k]

    def epochs(self) -> list[int]:
        """The plan epochs with reports kept, newest first."""
        return sorted(self._reached, reverse=True)

    def reached(self, epoch: int) -> dict[str, int]:
        """node -> its newest step under `epoch` (a copy)."""
        return dict(self._reached.get(epoch, {}))

    def refusal(self, plan: Plan, node_id: str, step: int, window: int = STEP_WINDOW) -> str:
        """`step_refusal` of a report by `node_id` under `plan`, against its group's newest steps."""
        groups = self._group_map(plan)
        g = groups.get(node_id)
        if g is None:  # not a node of the plan: every node of it is a peer
            tops = [x for (e, _), top in self._top.items() if e == plan.epoch for x in top]
            return step_refusal(plan, node_id, step, max((s for s, _ in tops), default=None), bool(groups), window)
        newest = next((s for s, n in self._top.get((plan.epoch, g), []) if n != node_id), None)
        return step_refusal(plan, node_id, step, newest, self._sizes[plan.epoch][g] > 1, window)


def end_corroborated(nodes: Collection[str], reached: Mapping[str, int], last: int) -> bool:
    """Whether the end at step `last` of a group of `nodes` is corroborated: more than half of them, and at least
    two where there are two or more, reported a step at or past `last` (`reached`: node -> its newest step under
    the plan's epoch)."""
    nodes = set(nodes)
    done = sum(1 for n in nodes if reached.get(n, -1) >= last)
    return done > len(nodes) / 2 and done >= min(2, len(nodes))


def job_ended(plan: Plan | None, reached: Mapping[str, int], target_steps: int,
              alive: Callable[[], Collection[str]]) -> bool:
    """Whether the job trained its last step, corroborated (`end_corroborated`): in a synchronous plan by the plan's
    nodes, in outer mode by the nodes of a replica group at its own last inner step. Without a plan, by the alive
    members (`alive()`), which reported under no epoch."""
    last = target_steps - 1
    if plan is None:
        return end_corroborated(alive(), reached, last)
    if plan.mode == "outer" and plan.outer is not None and plan.groups:
        last_outer = plan.outer.end_step(target_steps) - 1  # every group's last round ends there
        return any(end_corroborated(plan.group_nodes(g), reached, last_outer) for g in range(len(plan.groups)))
    return end_corroborated({n for p in plan.pipelines for st in p.stages for n in st.nodes}, reached, last)


def last_step_of(plan: Plan, target_steps: int) -> int:
    """The job's last step under `plan`: target - 1, or in outer mode the end of its last round."""
    if plan.mode == "outer" and plan.outer is not None and plan.groups:
        return plan.outer.end_step(target_steps) - 1
    return target_steps - 1


def finished_nodes(plan: Plan, reached: Mapping[str, int], target_steps: int) -> set[str]:
    """The nodes of `plan` that reported its last step (`reached`: node -> its newest step under the plan)."""
    last = last_step_of(plan, target_steps)
    return {n for p in plan.pipelines for st in p.stages for n in st.nodes if reached.get(n, -1) >= last}
