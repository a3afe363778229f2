"""A plan run by its nodes as threads of the test process: one `PlanRunner` a node, each with a real gRPC
`PeerServer`, all meeting at one `TCPStore` (their gloo groups); the reports every node sent, per node how its
run ended, and the runners themselves.

    result = run_pinned_plan(tiny_job(steps=4), [PipelinePlan(..., stages=[stage((0, 3), ["a"]), ...])], tmp)
    result.losses  # step -> loss

`run_outer_plan` runs replica groups in outer mode the same way, their rounds decided by the coordinator's own
`OuterRounds` (`outer_arbiter`); `in_threads` runs a function on a few threads (ranks of a gloo group, say).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from atoll.coordinator.outer import GroupInfo, OuterRounds
from atoll.coordinator.outer import Participant as OuterParticipant
from atoll.job import JobSpec
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup, StagePlan
from atoll.types import StepMetrics
from atoll.v1 import atoll_pb2 as pb

REPO = Path(__file__).resolve().parent.parent
TOKEN = "t"
T = TypeVar("T")


def tiny_job(steps: int, *, interval: int = 0, mode: str = "identity", nodes: int | None = None,
             **train) -> JobSpec:
    """examples/tiny.toml for `steps` steps (warm-up 2, or `train`'s), a checkpoint every `interval` steps (0:
    none), activations sent with codec `mode`; `train` overrides further [train] fields. With `nodes`, a job of
    one synchronous step that waits for exactly that many nodes (what a pinned plan of an end-to-end test runs)."""
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=steps, **{"warmup": 2, **train}),
                  checkpoint=replace(job.checkpoint, interval=interval),
                  compression=replace(job.compression, mode=mode))
    if nodes is None:
        return job
    return replace(job, cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=nodes),
                   outer=replace(job.outer, mode="sync"))


def stage(layers: tuple[int, int], nodes, **fields) -> StagePlan:
    """A stage of island "i" over `nodes`, one replica each."""
    return StagePlan(island="i", layers=layers, dp=len(nodes), nodes=list(nodes), **fields)


def assert_losses_match(got: Mapping[int, float], want: Sequence[float] | Mapping[int, float], rtol: float,
                        steps: Iterable[int]) -> None:
    """The loss of each of `steps` in `got` within `rtol` of `want`'s, relative to `want`'s."""
    for s in steps:
        assert abs(got[s] - want[s]) <= rtol * abs(want[s]), (s, got[s], want[s])


@dataclass
class PlanRun:
    """What a run of a plan left: the plan as run (with the nodes' addresses and rendezvous filled in), every
    step report in arrival order, and per node its runner and how its run ended."""

    plan: Plan
    reports: list[StepMetrics] = field(default_factory=list)
    runners: dict[str, PlanRunner] = field(default_factory=dict)
    ended: dict[str, tuple[BaseException | None, float]] = field(default_factory=dict)
    """node -> (the exception its run raised, None when it returned; `time.monotonic()` when it ended)."""

    @property
    def losses(self) -> dict[int, float]:
        """step -> loss (the latest report of a step wins)."""
        return {m.step: m.loss for m in self.reports if m.loss is not None}

    def peaks(self) -> dict[str, int]:
        """node -> its highest reported peak memory."""
        out: dict[str, int] = {}
        for m in self.reports:
            out[m.node_id] = max(out.get(m.node_id, 0), m.peak_memory_bytes)
        return out


def run_pinned_plan(job: JobSpec, plan: Plan | list[PipelinePlan], checkpoint_dir: Path, *, resume_step: int = 0,
                    until_step: int | None = None, timeout: timedelta = timedelta(seconds=30),
                    join: float = 90.0, stops: Mapping[str, threading.Event] | None = None,
                    on_report: Callable[[StepMetrics], None] | None = None,
                    node_context: Callable[[str], dict] | None = None, check: bool = True, holders: bool = False,
                    **context) -> PlanRun:
    """Run `plan` of `job`, every node of it a thread; given pipelines, the plan of epoch 1 that holds them and
    starts at `resume_step`.

    `timeout` bounds each node's waits; `join` how long to wait for each thread. `stops` ends a node's run when
    set; `on_report` sees every report as it comes (on the reporting node's thread); `context` and
    `node_context(node)` are further `RunContext` fields (all nodes' and one node's). With `check`, every run must
    have returned; without, `ended` says how each ended. With `holders`, each node's peer server keeps the live
    state its run leaves (as a node's does).
    """
    if not isinstance(plan, Plan):
        plan = Plan(model=job.model.name, global_batch=job.train.global_batch, seq_len=job.train.seq_len,
                    pipelines=plan, epoch=1, job_id="job", resume_step=resume_step)
    nodes = list(dict.fromkeys(n for p in plan.pipelines for s in p.stages for n in s.nodes))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token=TOKEN) for n in nodes}
    if holders:
        from atoll.node.state_transfer import StateHolder

        for n, server in servers.items():
            server.state = StateHolder(node_id=n, checkpoint_dir=checkpoint_dir)
    result = PlanRun(replace(plan, node_addresses={n: s.address for n, s in servers.items()},
                             rendezvous=f"127.0.0.1:{store.port}"))
    lock = threading.Lock()

    def report(m: StepMetrics) -> bool:
        with lock:
            result.reports.append(m)
        if on_report is not None:
            on_report(m)
        return False

    def node(n: str) -> None:
        error: BaseException | None = None
        try:
            ctx = RunContext(node_id=n, job=job, peer_server=servers[n], checkpoint_dir=checkpoint_dir,
                             report_step=report, report_checkpoint=lambda c: None, token=TOKEN, timeout=timeout,
                             **{**context, **(node_context(n) if node_context else {})})
            runner = PlanRunner(ctx, result.plan)
            with lock:
                result.runners[n] = runner
            runner.run(stops[n] if stops else threading.Event(), until_step=until_step)
        except BaseException as e:  # handed to the caller in `ended`
            error = e
        with lock:
            result.ended[n] = (error, time.monotonic())

    threads = [threading.Thread(target=node, args=(n,), name=f"node-{n}", daemon=True) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(join)
    finally:
        for s in servers.values():
            s.stop()
    if check:
        errors = {n: e for n, (e, _) in result.ended.items() if e is not None}
        assert not errors, errors
        assert set(result.ended) == set(nodes), f"the runs of {sorted(set(nodes) - set(result.ended))} did not end"
    return result


def outer_arbiter(plan: Plan, paced: bool = False, arrived: dict | None = None):
    """The coordinator's side of OuterSync over `plan`'s groups: (the call a node makes, the rounds it decides).
    `paced`: rounds by wall-clock time (each node's step times heard, each group's inner steps decided;
    `atoll.coordinator.pace`); `arrived`: (node, round) -> the time it first arrived, filled in."""
    rounds = OuterRounds()
    groups = [GroupInfo(index=i, name=g.name, since_epoch=g.since_epoch or plan.epoch,
                        nodes=frozenset(n for p in g.pipelines for s in plan.pipelines[p].stages for n in s.nodes),
                        inner_steps=g.inner_steps)
              for i, g in enumerate(plan.groups)]
    lock = threading.Lock()

    def part(p) -> pb.OuterParticipant:
        return pb.OuterParticipant(group=p.group, tokens=p.tokens, since_epoch=p.since_epoch, node_ids=list(p.nodes))

    def call(req: pb.OuterSyncRequest) -> pb.OuterSyncReply:
        with lock:
            if arrived is not None:
                arrived.setdefault((req.node_id, req.round), time.monotonic())
            paced_kw = dict(h=plan.outer.inner_steps, step_seconds=req.step_seconds, round_steps=req.round_steps,
                            stats={"bytes": req.sync_bytes, "seconds": req.sync_seconds, "late": req.late_seconds}
                            ) if paced else {}
            d = rounds.arrive(time.time(), round_=req.round, node=req.node_id if req.arrived else "",
                              group=req.group, tokens=req.tokens, inner_step=req.inner_step, groups=groups,
                              deadline_s=plan.outer.deadline_s, fetched_version=req.fetched_version,
                              version=req.version, fetch_bound_s=plan.outer.fetch_bound_s, unreachable=[
                                  OuterParticipant(group=x.group, tokens=x.tokens, since_epoch=x.since_epoch,
                                                   nodes=tuple(x.node_ids)) for x in req.unreachable], **paced_kw)
            rounds.report_hashes(req.node_id, plan.groups[req.group].name,
                                 [(h.round, h.layer, h.crc32) for h in req.anchor_hashes])
        reply = pb.OuterSyncReply(decided=d.decided, participants=[part(p) for p in d.participants],
                                  version=d.version, final=d.final, steps_round=d.steps_round,
                                  inner_steps=[pb.OuterGroupSteps(group=g.name, since_epoch=g.since_epoch,
                                                                  inner_steps=g.steps) for g in d.inner_steps])
        if d.checkpointer is not None:
            reply.checkpointer.CopyFrom(part(d.checkpointer))
        return reply
    return call, rounds


@dataclass
class OuterRun:
    """What a run of replica groups in outer mode left."""

    plan: Plan
    losses: dict[tuple[int, int], float]
    """(group, step) -> loss."""
    params: dict[str, dict[str, torch.Tensor]]
    """node -> its outer parameters at the end."""
    rounds: OuterRounds
    """The coordinator's rounds."""
    runners: dict[str, PlanRunner]
    """node -> its runner (its outer state: the anchor)."""


def run_outer_plan(job: JobSpec, groups: list[list[PipelinePlan]], outer: OuterPlan, tmp_path: Path, *,
                   paced: bool = False, arrived: dict | None = None) -> OuterRun:
    """Each list of `groups` a replica group (region-0, region-1, ...) of an outer-mode plan of epoch 1, run as
    threads (`run_pinned_plan`) against the coordinator's rounds (`paced`, `arrived`: see `outer_arbiter`)."""
    pipelines = [p for g in groups for p in g]
    rgroups, k = [], 0
    for gi, g in enumerate(groups):
        rgroups.append(ReplicaGroup(name=f"region-{gi}", pipelines=list(range(k, k + len(g))),
                                    inner_steps=outer.inner_steps, since_epoch=1))
        k += len(g)
    plan = Plan(model="tiny", global_batch=job.train.global_batch, seq_len=job.train.seq_len, pipelines=pipelines,
                epoch=1, job_id="job", mode="outer", groups=rgroups, outer=outer)
    plan.validate(job.model.n_layers + 2)
    call, rounds = outer_arbiter(plan, paced=paced, arrived=arrived)
    run = run_pinned_plan(job, plan, tmp_path / "ckpt", join=150, outer_sync=call)
    losses = {(plan.group_of(m.pipeline), m.step): m.loss for m in run.reports if m.loss is not None}
    assert all(r.outer is not None for r in run.runners.values())
    return OuterRun(run.plan, losses, {n: dict(r.outer.params) for n, r in run.runners.items()}, rounds, run.runners)


def in_threads(n: int, fn: Callable[[int], T], join: float = 60.0) -> list[T]:
    """fn(rank) for ranks 0..n-1, each on a thread of its own; the results in rank order (None where a thread had
    not returned within `join` seconds). An error any of them raised is raised here (the first)."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    if errors:
        raise errors[0]
    return out
