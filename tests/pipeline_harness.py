"""A plan run by its nodes as threads of the test process: one `PlanRunner` a node, each with a real gRPC
`PeerServer`, all meeting at one `TCPStore` (their gloo groups); the reports every node sent, per node how its
run ended, and the runners themselves.

    result = run_pinned_plan(tiny_job(steps=4), [PipelinePlan(..., stages=[stage((0, 3), ["a"]), ...])], tmp)
    result.losses  # step -> loss
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from atoll.job import JobSpec
from atoll.node.peer import PeerServer
from atoll.node.runner import PlanRunner, RunContext
from atoll.plan import PipelinePlan, Plan, StagePlan
from atoll.types import StepMetrics

REPO = Path(__file__).resolve().parent.parent
TOKEN = "t"


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
