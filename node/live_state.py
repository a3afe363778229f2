"""No rollback when a copy is live: where a new plan's run resumes, and from whom each node takes its layers.

When a plan changes (a join, a leave, a failure), every node that ran the old plan still holds the state its
run left: its layers' weights and AdamW state after the steps it completed (`StateHolder.live`). At the start
of plan epoch e:
1. one node asks every node of the plan, and every node that left gracefully (`Plan.handover`), which state it holds
   (`Peer.HeldState`, answered once that node's older runs ended);
2. computes the resume point, a pure function of those answers (`resume_point`): the newest step at which
   every layer of the model has a live copy; when none is newer than the last complete checkpoint, the
   checkpoint (`Plan.resume_step`). A node whose last step's norm exchange failed (a replica died in it) while
   others completed it holds that step's gradients: it counts at the next step, finished by whoever loads it
   with the total those others saw (`finishable`, `atoll.node.roll_forward`);
3. agrees with the others through the epoch's rendezvous store: the first node to publish its resume point
   under the epoch's key wins and every node adopts that one. Steps 1-2 run on one node of the plan
   (`resume_leader`), so a plan of n nodes makes n HeldState calls, and the others read what it published;
4. loads its layers: from its own live state where it holds them at that step, else fetched over gRPC
   from the nearest live holder (`sources`: same region first), else, on the checkpoint path, from its
   checkpoint folder or a node holding a copy (`atoll.node.replication.fetch_checkpoint`).

Each transfer is logged as `state transfer: N bytes from NODE in S s`, and the resume as
`resume: step R (...); the job was at step M: K steps rolled back`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from atoll.node.dataparallel import CANCEL_POLL_S, CollectiveCancelled, CollectiveError, cancel_event
from atoll.node.state_transfer import FetchStats, OuterPosition, held_state, outer_position
from atoll.plan import Plan
from atoll.rpc import RpcOptions
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

log = logging.getLogger("atoll.node.live_state")


@dataclass(frozen=True, kw_only=True)
class Holder:
    """A node holding the live state of `layers` after `step` steps."""

    node_id: str
    address: str
    step: int
    layers: tuple[int, int]
    region: str = ""
    epoch: int = 0
    """The plan epoch whose run left the state."""
    pending: bool = False
    """The state also holds the gradients of step `step`, whose norm exchange failed on this node."""
    norm_total: float | None = None
    """The norm exchange's total of step `step` - 1, when the run that left the state had one."""
    finish: float | None = None
    """Set in a resume point: the total with which a fetcher finishes the pending step `step`, so this holder
    gives the state after `step` + 1 steps (`atoll.node.roll_forward`)."""
    pending_loss: tuple[float, float] | None = None
    """A pending last stage's (loss share, row weight) of step `step` (`LiveState.pending_loss`)."""
    outer: OuterPosition | None = None
    """Outer mode: the replica group whose run left the state and its place in the group's rounds; None: a
    synchronous plan's state."""

    @property
    def reaches(self) -> int:
        """The step this holder's state stands at once fetched (and finished)."""
        return self.step + (1 if self.finish is not None else 0)


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    step: int
    live: bool
    """True: every layer has a live copy at `step` (no rollback); False: the last complete checkpoint."""
    reason: str
    holders: tuple[Holder, ...] = ()
    """Live holders at `step` (empty on the checkpoint path)."""
    furthest: int = 0
    """The furthest step any node held: the steps rolled back are `furthest - step` (0 when live)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ResumePoint:
        d = json.loads(text)
        holders = tuple(Holder(**{**h, "layers": tuple(h["layers"]),
                                  "pending_loss": tuple(h["pending_loss"]) if h.get("pending_loss") else None,
                                  "outer": OuterPosition(**h["outer"]) if h.get("outer") else None})
                        for h in d.pop("holders"))
        return cls(**d, holders=holders)

    @property
    def rolled_back(self) -> int:
        return max(0, self.furthest - self.step)


def _covered(ranges: Sequence[tuple[int, int]], total: int) -> list[int]:
    """Layers of [0, total) that no range covers."""
    have = set()
    for a, b in ranges:
        have.update(range(a, b))
    return [i for i in range(total) if i not in have]


def finishable(held: Sequence[Holder]) -> list[Holder]:
    """Each pending holder that a holder of the step after it can finish, with that exchange's total.

    A node whose norm exchange of step s failed kept that step's final gradients, while other nodes of the
    same run may have completed the exchange and stepped to s + 1: given the exchange's total (every member
    of the exchange saw the same), the pending state becomes the state after s + 1 steps. The total is taken
    from a holder of s + 1 left by the same run (same plan epoch); ties by node id."""
    out = []
    for h in held:
        if not h.pending:
            continue
        done = sorted((c for c in held if c.step == h.step + 1 and c.epoch == h.epoch and c.norm_total is not None
                       and not c.pending), key=lambda c: c.node_id)
        if done:
            out.append(replace(h, finish=done[0].norm_total))
    return out


def resume_point(held: Sequence[Holder], *, total_layers: int, checkpoint_step: int, reached: int = 0
                 ) -> ResumePoint:
    """The newest step at which every layer has a live copy, when it is not older than the checkpoint;
    otherwise the checkpoint step, with the reason (which layers have no live copy). A pending holder
    counts at its own step and, where a holder of the next step can finish it, at that one (`finishable`).
    `reached`: the steps the job had trained by its reports (`Plan.reached_step`), which the rollback counts from
    where no live holder reaches as far (every node restarted)."""
    held = [*held, *finishable(held)]
    furthest = max([reached, *(h.reaches for h in held)], default=checkpoint_step)
    steps = sorted({h.reaches for h in held}, reverse=True)
    why = "no node holds live state"
    for s in steps:
        if s < checkpoint_step:
            why = f"the live copies (step {s} and older) are older than the checkpoint of step {checkpoint_step}"
            break
        at = sorted((h for h in held if h.reaches == s), key=lambda h: (h.node_id, h.finish is not None))
        missing = _covered([h.layers for h in at], total_layers)
        if not missing:
            return ResumePoint(step=s, live=True, holders=tuple(at), furthest=max(furthest, s),
                               reason=f"every layer has a live copy at step {s}")
        if s == steps[0]:
            why = (f"no live copy of layer(s) {_ranges(missing)} at step {s} (their holders left or failed)")
    if checkpoint_step == 0 and not held and not reached:
        return ResumePoint(step=0, live=False, furthest=0, reason="a fresh start: no state held, no checkpoint")
    return ResumePoint(step=checkpoint_step, live=False, furthest=max(furthest, checkpoint_step),
                       reason=f"{why}; resuming from the checkpoint of step {checkpoint_step} (live state held: "
                              f"{_show_held(held)})")


def _show_held(held: Sequence[Holder]) -> str:
    return ", ".join(f"{h.node_id} layers [{h.layers[0]}, {h.layers[1]}) at step {h.step}"
                     f"{' with the gradients of its failed step' if h.pending and h.finish is None else ''}"
                     for h in sorted(held, key=lambda h: h.node_id) if h.finish is None) or "none"


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def sources(point: ResumePoint, layers: tuple[int, int], node_id: str, region: str
            ) -> list[tuple[Holder, tuple[int, int]]]:
    """Which holder gives which part of `layers`: this node where it holds them, else the nearest (same
    region, then any; ties by node id). Consecutive layers from one holder form one part."""
    out: list[tuple[Holder, tuple[int, int]]] = []
    for layer in range(*layers):
        have = [h for h in point.holders if h.layers[0] <= layer < h.layers[1]]
        if not have:
            raise ValueError(f"no live holder of layer {layer} at step {point.step}")
        best = min(have, key=lambda h: (h.node_id != node_id, h.region != region, h.node_id))
        if out and out[-1][0] == best and out[-1][1][1] == layer:
            out[-1] = (best, (out[-1][1][0], layer + 1))
        else:
            out.append((best, (layer, layer + 1)))
    return out


def gather_held(plan: Plan, node_id: str, own: pb.HeldStateReply, *, token: str | None, rpc: RpcOptions,
                timeout: timedelta) -> list[Holder]:
    """The live state every node of the plan (and every node handing over) holds, asked in parallel.

    A node of the plan answers once its run of the older plan ended; until `timeout` it is asked again
    after an UNAVAILABLE (its server is not up yet, or its old run is still winding down), so a live holder
    is never left out while it is alive; so is a node the plan leaves idle (`Plan.idle`), alive and handing
    over what its last run left. A node that does not answer in `timeout` is left out (it failed; the plan
    after it will not name it); a node only handing over (it left) is asked once.
    Nodes without a Peer address (behind NAT) are not asked and this node's own state counts only when it
    has one, so every node weighs the same holders."""
    candidates: dict[str, str] = {**plan.handover, **{n: a for n, a in plan.node_addresses.items() if a}}
    # every node must count the same holders: one that accepts no connections (no address) cannot serve the
    # others, so its own state does not count, here or anywhere
    replies: dict[str, pb.HeldStateReply] = {node_id: own} if candidates.pop(node_id, "") else {}
    lock = threading.Lock()
    deadline = time.monotonic() + timeout.total_seconds()
    cancelled = cancel_event() or threading.Event()  # the plan superseded: nobody waits for its answers
    idle = {n for i in plan.idle for n in i.nodes}  # alive, left out of this plan: its old run may still wind down

    def ask(node: str, address: str) -> None:
        import grpc

        again = node in plan.node_addresses or node in idle
        while True:
            left = deadline - time.monotonic()
            try:
                reply = held_state(address, job_id=plan.job_id, epoch=plan.epoch, sender=node_id, token=token,
                                   rpc=rpc, timeout=timedelta(seconds=max(1.0, left)), node=node)
            except grpc.RpcError as e:
                if (again and e.code() == grpc.StatusCode.UNAVAILABLE and deadline - time.monotonic() > 1.0
                        and not cancelled.is_set()):
                    log.info("node %s cannot say yet which state it holds (%s); asking again", node, e.details())
                    cancelled.wait(0.5)
                    continue
                log.info("node %s did not say which state it holds (%s: %s); leaving it out", node, e.code().name,
                         e.details())
                return
            with lock:
                replies[node] = reply
            return

    threads = [threading.Thread(target=ask, args=(n, a), daemon=True, name=f"atoll-held-{n}")
               for n, a in sorted(candidates.items())]
    for t in threads:
        t.start()
    end = deadline + 5.0
    while (alive := [t for t in threads if t.is_alive()]) and time.monotonic() < end and not cancelled.is_set():
        alive[0].join(min(CANCEL_POLL_S, max(0.0, end - time.monotonic())))
    if cancelled.is_set():  # what was gathered may lack a holder that stopped being asked
        raise CollectiveCancelled("the resume agreement was abandoned: the plan it belongs to was superseded")
    addresses = {**plan.handover, **plan.node_addresses}
    with lock:
        return [Holder(node_id=n, address=addresses.get(n, ""), step=r.step, layers=(r.layer_start, r.layer_end),
                       region=plan.region_of(n) if n in plan.node_addresses else "", epoch=r.plan_epoch,
                       pending=r.pending, norm_total=r.norm_total if r.has_norm_total else None,
                       pending_loss=(r.pending_loss, r.pending_weight) if r.has_pending_loss else None,
                       outer=outer_position(r))
                for n, r in sorted(replies.items()) if r.holds]


def finished_loss(point: ResumePoint, total_layers: int) -> float | None:
    """The loss of the step a resume point finishes (its step - 1): the shares of the pending last stages it
    finishes, when they cover the whole global batch (every replica's rows); None otherwise."""
    shares = {h.node_id: h.pending_loss for h in point.holders
              if h.finish is not None and h.layers[1] == total_layers and h.pending_loss is not None}
    weight = sum(w for _, w in shares.values())
    if not shares or abs(weight - 1.0) > 1e-6:
        return None
    return sum(x for x, _ in shares.values())


def resume_leader(plan: Plan) -> str:
    """The node that asks the others which state they hold and publishes the resume point: the first node id
    running a stage (every node of the plan computes the same one)."""
    return min(n for p in plan.pipelines for st in p.stages for n in st.nodes)


def await_point(store: dist.Store, key: str, timeout: timedelta) -> ResumePoint:
    """The resume point the leader published under `key`, waiting at most `timeout` (longer than the leader's
    questions may take; a leader that died meanwhile fails this run, and the next plan has another)."""
    cancelled = cancel_event()
    if cancelled is None:
        store.wait([key], timeout)
    else:  # a store wait cannot be interrupted: poll, so a superseded plan's run ends at once
        deadline = time.monotonic() + timeout.total_seconds()
        while not store.check([key]):
            if cancelled.is_set():
                raise CollectiveCancelled("the resume agreement was abandoned: the plan it belongs to was superseded")
            if time.monotonic() >= deadline:
                raise CollectiveError(f"no resume point was published within {timeout} (the resume leader failed)")
            cancelled.wait(CANCEL_POLL_S)
    value = store.get(key)
    return ResumePoint.from_json(value.decode("utf-8") if isinstance(value, bytes) else str(value))


def agree(store: dist.Store | None, key: str, point: ResumePoint) -> ResumePoint:
    """The resume point every node of the epoch adopts: the first published under `key` (this one when
    first, or when there is no store: a plan of one node)."""
    if store is None:
        return point
    agreed = store.compare_set(key, "", point.to_json())
    text = agreed.decode("utf-8") if isinstance(agreed, bytes) else str(agreed)
    return ResumePoint.from_json(text)


@dataclass(kw_only=True)
class RestoreReport:
    """What a run's restore did: the resume point and each transfer (for logs, status and the churn bench)."""

    point: ResumePoint
    transfers: list[FetchStats] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.transfers)

    def annotate(self, metrics: StepMetrics) -> None:
        """Put the restore's figures on the run's first step report."""
        metrics.restored_from = "live" if self.point.live else "checkpoint"
        metrics.restore_bytes = self.bytes
        metrics.restore_seconds = sum(t.seconds for t in self.transfers)
        metrics.steps_rolled_back = self.point.rolled_back

    def line(self) -> str:
        how = "live state" if self.point.live else "checkpoint"
        moved = f"{self.bytes} bytes of state fetched" if self.transfers else "no state fetched"
        return (f"resume: step {self.point.step} ({how}; {moved}); the job was at step {self.point.furthest}: "
                f"{self.point.rolled_back} steps rolled back")


def slice_part(state: Mapping[str, Any], layers: tuple[int, int]) -> dict[str, Any]:
    """A saved slice narrowed to `layers` (so slices from several holders never claim one layer twice)."""
    return {**state, "start": max(int(state["start"]), layers[0]), "end": min(int(state["end"]), layers[1])}
