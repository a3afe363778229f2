"""What a node's step reports may claim, checked against the plan: pure functions of (plan, reports).

A legitimate member can lie (or be broken), so a claim that ends or steers the job needs the plan's backing and
the other nodes' agreement:

- **The loss** of a step is taken only from the nodes the plan makes responsible for it: the last stage of the
  pipeline the report names (`loss_refusal`), within `LOSS_STEP_WINDOW` steps of its peers' newest. Every replica
  of the last stage reports the step's (all-reduced, identical) loss, and what the history records is a vote
  (`LossVotes`, `decide`): of a step's voters (tp rank 0 of each last-stage replica whose loss is all-reduced
  together), each node's first report counts once; the step is decided when every voter reported it, or once two
  voters reported a step `LOSS_FLUSH_STEPS` past it. One voter: its word. Two or more: the median of the votes,
  if more than half of them agree with it (relative `LOSS_RTOL`), else nothing is recorded (two that disagree
  cannot tell who lies) and the coordinator says so; a voter away from the median is named, an offence like the
  door's (`atoll.coordinator.quarantine.take_loss_liars`), so one that keeps lying is quarantined.
- **The step** must be consistent with what the reporter's peers report (the other nodes of its replica group;
  in a synchronous plan, every other node): at most `STEP_WINDOW` steps past the newest step any of them reported
  under the same plan epoch, or past the plan's resume step (`step_refusal`). The nodes of one group step together (a pipeline's stages once
  a step, its replicas and pipelines through their gradient average), so an honest node is never that far ahead;
  a report that is (a peer's reports held back by an outage) is answered "retry later", and the node keeps it.
- **The job's end** needs more than one node (`end_corroborated`): more than half of the group's nodes, at least
  two where it has two or more, each reported a step at or past the group's last under the plan's epoch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

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
    # (where the plan's nodes start: its live-state step where the job had reached past its checkpoint; a stage whose
    # every node reports a loss, none ahead of the others, would otherwise be held back from a resume far past it)
    start = max(plan.resume_step, plan.reached_step)
    base = max(start, peers_newest if peers_newest is not None else start)
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


# --- the recorded loss: a vote of the loss holders -----------------------------------------------------------------

LOSS_STEP_WINDOW = 16
"""How far (steps) a report carrying a loss may run ahead of its group's newest step (`STEP_WINDOW` for the rest):
the last stage is the last of its pipeline to end a step, so an honest loss is never ahead of its peers' steps."""
LOSS_FLUSH_STEPS = 8
"""A step not every loss voter reported is decided once two voters (one where there is one) reported a step this
many steps past it: a voter's late report (its outbox retrying) has had that long."""
LOSS_KEEP_STEPS = 256
"""Steps of a group kept decided (a report of an older or decided step is not counted again)."""
LOSS_RTOL = 1e-4
"""Relative difference under which two losses of one step agree (the replicas all-reduce it: they report the same
number)."""


def loss_voters(plan: Plan, pipeline: int) -> frozenset[str]:
    """The nodes whose reports decide the loss of `pipeline`'s steps: tp rank 0 of each replica of the last stage of
    every pipeline whose loss is all-reduced with it (a synchronous plan: every pipeline; outer mode: its group's)."""
    if not 0 <= pipeline < len(plan.pipelines):
        return frozenset()
    if plan.mode == "outer" and plan.groups:
        pipes = plan.groups[plan.group_of(pipeline)].pipelines
    else:
        pipes = range(len(plan.pipelines))
    return frozenset(n for p in pipes if plan.pipelines[p].stages
                     for n in plan.pipelines[p].stages[-1].nodes[::max(1, plan.pipelines[p].stages[-1].tp)])


def agree(a: float, b: float, rtol: float = LOSS_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-6)


@dataclass(frozen=True)
class LossDecision:
    """What the votes of one step decided: the losses to record (None: none) and the voters whose loss disagreed."""

    step: int
    epoch: int
    loss: float | None
    val_loss: float | None
    tokens_per_second: float | None
    liars: tuple[tuple[str, float], ...] = ()
    """(node, the loss it reported) of each voter away from the others' median."""
    note: str = ""
    """Why nothing was recorded (two voters that disagree, or one of several)."""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def decide(step: int, epoch: int, voters: int, votes: Mapping[str, tuple[float | None, float | None, float | None]],
           rtol: float = LOSS_RTOL) -> LossDecision:
    """The loss recorded for a step from its `votes` (node -> (loss, validation loss, tokens/s)), one per node, of a
    group of `voters` voters: one voter's word where there is one; else the median of at least two votes, when more
    than half of them agree with it; the nodes away from it are named where three or more voted (two that disagree
    cannot tell who lies: nothing is recorded)."""
    losses = {n: x[0] for n, x in votes.items() if x[0] is not None}
    vals = [x[1] for x in votes.values() if x[1] is not None]
    tps = [x[2] for x in votes.values() if x[2] is not None]
    if voters <= 1:
        return LossDecision(step, epoch, _median(list(losses.values())), _median(vals), _median(tps))
    if not losses:  # validation losses only (the loss was not finite): recorded as the others
        return LossDecision(step, epoch, None, _median(vals) if len(vals) >= 2 else None, None)
    if len(losses) < 2:
        return LossDecision(step, epoch, None, None, None, note=f"step {step}: only {', '.join(losses)} of {voters} "
                                                                 f"loss voters reported; no loss recorded")
    med = statistics.median(losses.values())
    away = [(n, x) for n, x in sorted(losses.items()) if not agree(x, med, rtol)]
    if len(away) * 2 >= len(losses):  # no majority agrees with the median (two that disagree)
        return LossDecision(step, epoch, None, None, None,
                            note=f"step {step}: the loss voters disagree ({', '.join(f'{n}: {x:.6g}' for n, x in sorted(losses.items()))}); "
                                 f"no loss recorded")
    good = [n for n in losses if (n, losses[n]) not in away]
    return LossDecision(step, epoch, statistics.median(losses[n] for n in good),
                        _median([votes[n][1] for n in good if votes[n][1] is not None]),
                        _median([votes[n][2] for n in good if votes[n][2] is not None]), liars=tuple(away))


class LossVotes:
    """Each step's loss reports per (plan epoch, replica group), one per voter, until the step is decided (`decide`):
    when every voter reported it, or `flush_steps` later (`LOSS_FLUSH_STEPS`). Not thread-safe: the caller locks."""

    def __init__(self, flush_steps: int = LOSS_FLUSH_STEPS, keep_steps: int = LOSS_KEEP_STEPS, keep_epochs: int = 8):
        self.flush_steps, self.keep_steps, self.keep_epochs = flush_steps, keep_steps, keep_epochs
        self._pending: dict[tuple[int, int], dict[int, dict[str, tuple]]] = {}
        """(epoch, group) -> step -> node -> (loss, val loss, tokens/s)"""
        self._newest: dict[tuple[int, int], dict[str, int]] = {}
        """(epoch, group) -> voter -> the newest step it voted"""
        self._decided: dict[tuple[int, int], set[int]] = {}
        self._voters: dict[tuple[int, int], frozenset[str]] = {}

    def add(self, plan: Plan, node_id: str, pipeline: int, step: int, loss: float | None, val_loss: float | None,
            tokens_per_second: float | None) -> list[LossDecision]:
        """A report's loss (and validation loss, tokens/s) for `step` by `node_id` under `plan`; the steps it decided.
        A node that is no voter of `pipeline`, a step already decided or too old, and a node's second report of a
        step are not counted."""
        voters = loss_voters(plan, pipeline)
        if node_id not in voters:
            return []
        key = (plan.epoch, plan.group_of(pipeline) if plan.mode == "outer" and plan.groups else 0)
        self._voters[key] = voters
        decided = self._decided.setdefault(key, set())
        newest = self._newest.setdefault(key, {})
        pending = self._pending.setdefault(key, {})
        out: list[LossDecision] = []
        top = max(newest.values(), default=step)
        if step not in decided and step > top - self.keep_steps:
            votes = pending.setdefault(step, {})
            votes.setdefault(node_id, (loss, val_loss, tokens_per_second))
            if len(votes) >= len(voters):
                out.append(self._decide(key, step))
        newest[node_id] = max(step, newest.get(node_id, step))
        ahead = sorted(newest.values(), reverse=True)
        bound = ahead[1] if len(ahead) > 1 else -1  # two voters' progress: one alone cannot hurry a step's decision
        for s in sorted(pending):
            if s <= bound - self.flush_steps:
                out.append(self._decide(key, s))
        top = max(newest.values())
        self._decided[key] = {s for s in decided if s > top - self.keep_steps}
        self._forget_old_epochs(plan.epoch)
        return out

    def _decide(self, key: tuple[int, int], step: int) -> LossDecision:
        votes = self._pending[key].pop(step)
        self._decided[key].add(step)
        return decide(step, key[0], len(self._voters[key]), votes)

    def _forget_old_epochs(self, epoch: int) -> None:
        """The votes under epochs `keep_epochs` older than `epoch` are dropped: the steps they left undecided were
        trained again under a newer plan (a step's row of a newer epoch replaces an older one's)."""
        for key in [k for k in self._voters if k[0] <= epoch - self.keep_epochs]:
            for d in (self._pending, self._newest, self._decided, self._voters):
                d.pop(key, None)
