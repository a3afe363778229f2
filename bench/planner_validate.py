"""Planner validation: the cost model's predicted step times against measured and published ones.

    python -m bench.planner_validate [--steps 12] [--repeats 9] [--only NAME] [--skip-live]

Live shapes, on this machine: each plan shape (stages, data-parallel width, unequal widths, several
pipelines) runs for real, nodes as threads of this process with real gRPC peers and gloo groups (the
runtime's `PlanRunner`, as the thread-level tests run it), on a small GPT job of this script's own. Before
each run every node profiles itself (`atoll.node.profiler.profile_node`: the job's layers forward and backward
at the replica micro-batch sizes, in the thread's CPU time), all at the same moment as nodes that share a
machine and join together do (`profile_together`; the island's slowest node counts, as in the coordinator),
and the loopback link is probed through the pipeline transport itself
(`atoll.node.transport_probe.probe_transport`: real tensors at the boundary's activation size and 4x and 16x
it, round trips through two `GrpcTransport`s, latency + size / bandwidth fitted to them), so the per-message
cost the runtime pays (serialising, the Transfer call, the receiver's checks) is in the link's latency rather
than only an empty call's round trip. The prediction is the planner's for exactly that shape: the cost model on
the live cluster those measurements make (`Cluster.from_nodes`, `ProfileSet.from_node_profiles`), every stage
through the island parallelizer (ZeRO, recomputation and tensor parallelism held to what the run uses:
none), the links' transfers, the all-reduces and the optimizer, simulated under 1F1B (several pipelines with
the planner's cross-pipeline all-reduce). The measured step is the median interval between consecutive steps'
completions (the last node to report a step ends it), after warm-up steps. Every shape runs `--repeats`
times, interleaved (each round runs every shape once, odd rounds in reverse order), and its row gives the
median of each reading over its runs, each run's gap taken against the prediction from that run's own
measurements, with the range of those gaps beside it.

A node here is a thread on a shared CPU, not a device of its own: on this 2-core machine, loaded by other
work, a thread gets only a share of a core, and the profile (CPU time) does not see that. A node's device is
taken as that share of a core (its profiled times divided by it), and so is its loopback link (serialising,
sending and all-reducing a tensor between threads is work of the same cores: the probed bandwidth divided by
the same factor, the latency multiplied by it), read three ways:
- `core before`: measured just before the run (as many threads as the shape has nodes, each running
  single-threaded matmuls for a second: CPU time over wall time); a prediction made before anything runs,
  and as good as the machine's load is steady;
- `core run` (the targets' reading): what the run's own compute got, its forward and backward ops' CPU
  time over their wall time (mean over the nodes); the machine's load is taken out of the comparison and what
  the planner models of a step is left: fill, drain and imbalance of the pipeline, transfers, all-reduces,
  optimizer, the profile's layer times. The runtime's own CPU work per forward or backward action beyond
  the compute (`ms/action`: scheduling, the loss, serialising tensors for gRPC, the gloo calls on the stage's
  thread; a step's thread CPU time less its compute ops' and optimizer's, over its actions, the median over
  the run's steps and nodes) is added to every action at that share: on a CPU node with this small model it
  is a sizeable part of an action, which the layer profile alone does not see;
- `ops x`: how many times slower than the profile the run's compute ops were (wall time over the profile's
  time, mean over the nodes), so `replayed` keeps only the schedule, transfers, all-reduces and optimizer;
- `calibrated` (from a shape's second run on, with its own targets): the prediction made before the run from
  the speed the shape's previous run measured (its `ops x` and work per action), as the coordinator plans
  again with each node's measured compute over its predicted compute (`atoll.coordinator.calibration`).
On an idle machine with a core per node they all agree with the profile.

Published: step times from papers for named configurations, predicted by the cost model on catalog devices
(no profile) for the configuration as published (its pipeline depth, data-parallel width, micro-batch, and
full activation recomputation where the paper used it). A step time derived from a published throughput
uses the paper's own FLOPs count (Megatron-LM's eq. 3, which counts recomputation).

Targets: every live shape within 15% of its measured step time; every published configuration within 25%.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.baselines import Stage, _cross_sync, evaluate  # noqa: E402

from atoll.coordinator.planner import (Cluster, PlannerOptions, ProfileSet, TrainSpec,  # noqa: E402
                                       parse_cluster)
from atoll.coordinator.planner.costmodel import CostModel  # noqa: E402
from atoll.coordinator.planner.multipipe import slowest_link  # noqa: E402
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, SliceQuery  # noqa: E402
from atoll.coordinator.planner.simulator import PipelineTimes, StageTimes, simulate  # noqa: E402
from atoll.modelspec import ModelConfig, ModelSpec  # noqa: E402
from atoll.plan import PipelinePlan, Plan, StagePlan  # noqa: E402
from atoll.types import LinkMeasurement, NodeProfile  # noqa: E402

LIVE_TOLERANCE = 0.15
PUBLISHED_TOLERANCE = 0.25

JOB_TOML = """
[job]
name = "validate"

[model]
preset = "tiny"
d_model = 128
n_heads = 4
n_layers = 4
ffn_hidden = 512
seq_len = 128

[data]
source = "builtin"
tokenizer = "bytes"

[train]
global_batch = 32
seq_len = 128
micro_batch = 4
steps = {steps}
lr = 1e-3
warmup = 0
dtype = "fp32"
schedule = "1f1b"

[checkpoint]
interval = 0

[compression]
mode = "identity"
"""
"""A GPT small enough for a CPU and large enough that compute, not Python, sets a step's pace (about 0.1 s
per 4-sequence micro-batch of the whole model on one core)."""


# --- pure helpers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveShape:
    name: str
    pipelines: tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]
    """Per pipeline: (micro-batch, micro-batches per step, stages as (first layer, end layer, replicas))."""
    zero_bubble: bool = False
    """Stage s defers its weight gradients s + 1 micro-batches (`StagePlan.defer_weights`), as the planner
    plans them."""
    lanes: tuple[int, ...] = ()
    """Lanes of the first pipeline's stages (`StagePlan.lanes`; empty: none): a stage's replicas in that many
    lanes, lane i % lanes taking micro-batch i."""

    @property
    def nodes(self) -> int:
        return sum(dp for _, _, stages in self.pipelines for _, _, dp in stages)

    def lane(self, pipeline: int, stage: int) -> int:
        return self.lanes[stage] if pipeline == 0 and self.lanes else 1


# embedding (0), four blocks (1-4), head (5); global batch 32, four sequences per replica and micro-batch
SHAPES = (
    LiveShape("1 stage", ((4, 8, ((0, 6, 1),)),)),
    LiveShape("2 stages", ((4, 8, ((0, 3, 1), (3, 6, 1))),)),
    LiveShape("dp 2", ((8, 4, ((0, 6, 2),)),)),
    LiveShape("3 stages", ((4, 8, ((0, 2, 1), (2, 4, 1), (4, 6, 1))),)),
    LiveShape("unequal widths 2+1", ((8, 4, ((0, 3, 2), (3, 6, 1))),)),
    LiveShape("2 pipelines, cut differently", ((4, 4, ((0, 6, 1),)), (4, 4, ((0, 3, 1), (3, 6, 1))))),
    LiveShape("2 stages x dp 2", ((8, 4, ((0, 3, 2), (3, 6, 2))),)),
    LiveShape("3 stages, zero-bubble", ((4, 8, ((0, 2, 1), (2, 4, 1), (4, 6, 1))),), zero_bubble=True),
    LiveShape("3 stages, middle in 2 lanes", ((4, 8, ((0, 2, 1), (2, 4, 2), (4, 6, 1))),), lanes=(1, 2, 1)),
)


def boundary_bytes(shape: LiveShape, job) -> int:
    """Bytes of the largest activation one replica sends across a stage boundary of the shape (at least one
    sequence's, for a shape without boundaries)."""
    rows = max([mb // (dp // shape.lane(p, s)) for p, (mb, _, stages) in enumerate(shape.pipelines)
                for s, (_, _, dp) in enumerate(stages[:-1])] or [1])
    return rows * job.train.seq_len * job.model_spec.config.d_model * 4  # fp32 activations


def node_slices(shape: LiveShape) -> dict[str, tuple[int, int, int]]:
    """Node id -> (first layer, end layer, sequences it runs per micro-batch), nodes n0, n1, ... in order."""
    out, k = {}, 0
    for p, (mb, _, stages) in enumerate(shape.pipelines):
        for s, (a, e, dp) in enumerate(stages):
            for _ in range(dp):
                out[f"n{k}"] = (a, e, mb // (dp // shape.lane(p, s)))
                k += 1
    return out


def shape_plan(shape: LiveShape, global_batch: int, seq_len: int) -> Plan:
    """The shape as a plan over nodes n0, n1, ... in order (no addresses yet)."""
    k = 0
    pipelines = []
    for p, (mb, m, stages) in enumerate(shape.pipelines):
        plans = []
        for n, (a, e, dp) in enumerate(stages):
            plans.append(StagePlan(island="cpu", layers=(a, e), dp=dp, nodes=[f"n{k + i}" for i in range(dp)],
                                   defer_weights=n + 1 if shape.zero_bubble else 0, lanes=shape.lane(p, n)))
            k += dp
        pipelines.append(PipelinePlan(micro_batch=mb, num_micro_batches=m, stages=plans))
    plan = Plan(model="validate", global_batch=global_batch, seq_len=seq_len, pipelines=pipelines)
    if sum(p.micro_batch * p.num_micro_batches for p in pipelines) != global_batch:
        raise ValueError(f"shape {shape.name!r}: its pipelines do not share the global batch {global_batch}")
    return plan


def measured_step(done: dict[int, float], warm: int) -> float:
    """Median interval between consecutive steps' completions (`done`: step -> when its last node reported),
    leaving out the first `warm` steps."""
    steps = sorted(s for s in done if s >= warm)
    gaps = [done[b] - done[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    if not gaps:
        raise ValueError(f"need two consecutive steps after the first {warm}, got {sorted(done)}")
    return statistics.median(gaps)


def gap(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction (+: predicted slower than measured)."""
    return predicted / measured - 1.0


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration of a GPT model with full activation recomputation, as Megatron-LM counts them
    (Narayanan et al., SC'21, eq. 3): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Megatron's pipeline cut: the blocks split evenly over the stages, the embedding with the first and the
    head with the last (layers counted as atoll does: 0 the embedding, the last the head)."""
    blocks = num_layers - 2
    if blocks % pp:
        raise ValueError(f"{blocks} blocks do not split evenly over {pp} stages")
    per = blocks // pp
    cuts = [0] + [1 + per * k for k in range(1, pp)] + [num_layers]
    return list(zip(cuts, cuts[1:]))


def full_recompute(times: StageTimes, cm: CostModel, island, start: int, end: int, rows: int, tp: int,
                   recomputed: Sequence[int]) -> StageTimes:
    """A stage's times with every block recomputed in backward (one more forward of the blocks the
    parallelizer did not already recompute)."""
    t = cm.table(island, rows, tp)
    first, last = max(start, 1), max(max(start, 1), min(end, cm.num_layers - 1))
    extra = sum(t.fwd[i] for i in range(first, last) if i not in set(recomputed))
    return replace(times, backward_s=times.backward_s + extra)


def interleaved(shapes: Sequence[LiveShape], repeats: int) -> list[tuple[int, LiveShape]]:
    """(round, shape) in the order the runs go: every round runs each shape once, odd rounds in reverse, so a
    shape's runs are spread over the whole measurement and a change of the machine's load falls on every
    shape alike rather than on the shapes that happened to run during it."""
    out = []
    for r in range(repeats):
        out.extend((r, s) for s in (shapes if r % 2 == 0 else list(reversed(shapes))))
    return out


def combine(runs: Sequence[dict]) -> dict:
    """One row of several runs of a shape: the median of each reading, and of each prediction's gap taken
    against its own run's measured step (a run is compared with the prediction made from its own core share;
    the median then drops a run the machine's load disturbed in a way no share reading caught)."""
    if not runs:
        raise ValueError("no runs to combine")
    out = {k: statistics.median(r[k] for r in runs)
           for k in ("before", "during", "replayed", "measured", "share", "seen", "factor", "overhead")}
    for k in ("before", "during", "replayed"):
        out[f"gap_{k}"] = statistics.median(gap(r[k], r["measured"]) for r in runs)
    kinds = sorted({k for r in runs for k in r.get("per_op", {})})
    out["per_op"] = {k: statistics.median(r["per_op"][k] for r in runs if k in r.get("per_op", {})) for k in kinds}
    later = [gap(r["calibrated"], r["measured"]) for r in runs if r.get("calibrated") is not None]
    out["gap_calibrated"] = statistics.median(later) if later else None
    out["spread_calibrated"] = f"{min(later):+.0%}..{max(later):+.0%}" if len(later) > 1 else "-"
    gaps = [gap(r["during"], r["measured"]) for r in runs]
    out["spread"] = f"{min(gaps):+.0%}..{max(gaps):+.0%}" if len(runs) > 1 else "-"
    return out


# --- live shapes -------------------------------------------------------------------------------------


def core_share(threads: int, seconds: float = 1.0) -> float:
    """CPU time over wall time of `threads` threads each running single-threaded matmuls for `seconds`: the
    share of a core a node thread gets on this machine right now (1.0 on an idle machine with a core each)."""
    import torch

    shares: list[float] = []
    lock = threading.Lock()
    a = torch.randn(256, 256)

    def spin() -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):
                a @ a
        share = (time.thread_time() - c0) / (time.perf_counter() - t0)
        with lock:
            shares.append(share)

    ts = [threading.Thread(target=spin) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return min(1.0, statistics.mean(shares))


def run_share(ops: dict[str, list[tuple[str, float, float]]]) -> float:
    """The share of a core the run's compute got: per node, CPU seconds over wall seconds of its forward and
    backward ops (`ops`: node -> (op, cpu, wall) per op), the mean over nodes."""
    shares = [sum(c for _, c, _ in v) / sum(w for _, _, w in v) for v in ops.values() if sum(w for _, _, w in v) > 0]
    if not shares:
        raise ValueError("no compute ops were recorded")
    return min(1.0, statistics.mean(shares))


def op_factor(ops: dict[str, list[tuple[str, float, float]]], expected: dict[str, dict[str, float]]) -> float:
    """How many times slower the run's compute ops were than the profile says (`expected`: node -> seconds of
    its forward and backward op), wall time over expected time per node, the mean over nodes."""
    factors = [sum(w for _, _, w in v) / sum(expected[n][op] for op, _, _ in v) for n, v in ops.items() if v]
    if not factors:
        raise ValueError("no compute ops were recorded")
    return statistics.mean(factors)


def op_cpu_factors(ops: dict[str, list[tuple[str, float, float]]], expected: dict[str, dict[str, float]]
                   ) -> dict[str, float]:
    """Per kind of compute action (forward, backward, weight), the CPU seconds the run's ops took over what the
    profile says they take, summed over every node: above 1, the op did more work in the run than alone in the
    profile (a larger working set than one layer's, the deferred products gone cold in cache), which no share of
    a core explains."""
    cpu: dict[str, float] = {}
    want: dict[str, float] = {}
    for n, v in ops.items():
        for op, c, _ in v:
            cpu[op] = cpu.get(op, 0.0) + c
            want[op] = want.get(op, 0.0) + expected[n][op]
    return {op: cpu[op] / want[op] for op in cpu if want[op] > 0}


def action_overhead(steps: dict[str, list[tuple[float, float, float, int]]]) -> float:
    """CPU seconds the runtime spends per schedule action (a micro-batch's forward or backward) beyond the
    compute itself: per node and step (`steps`: node -> (the step's CPU seconds on the stage's thread, its
    compute ops' CPU seconds, its optimizer step's CPU seconds, its actions)), what is left of the step's
    CPU time over its actions (scheduling, the loss, serialising and handing tensors to gRPC, the gloo
    calls' share on the stage's thread), the median over every node's steps."""
    per = [max(0.0, cpu - compute - opt) / actions for v in steps.values() for cpu, compute, opt, actions in v
           if actions > 0]
    if not per:
        raise ValueError("no steps were recorded")
    return statistics.median(per)


def profile_together(job, nodes: Sequence[str]) -> dict[str, NodeProfile]:
    """Every node's profile (`atoll.node.profiler.profile_node`), all taken at the same moment, a thread each,
    as nodes that share a machine and join together profile: each node's layers are timed while the others
    compute beside it, as in the run, and each node has a profile of its own (the island takes its slowest)
    instead of one profile taken alone standing for all of them."""
    from atoll.node.profiler import ProfileOptions, profile_node

    start = threading.Barrier(len(nodes))
    out: dict[str, NodeProfile] = {}
    errors: list[BaseException] = []

    def one(n: str) -> None:
        try:
            start.wait(60)
            out[n] = profile_node(job, "cpu", ProfileOptions(micro_batches=(2, 4, 8), budget=timedelta(seconds=2)))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(n,), name=f"profile-{n}", daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors or len(out) < len(nodes):
        raise RuntimeError(f"profiling the nodes failed: {errors[0]!r}" if errors else "profiling the nodes hung")
    return out


def run_live(shape: LiveShape, steps: int, warm: int, prior: dict | None = None) -> dict:
    """Profile, probe, predict and run one shape; returns the predictions, the measurement and the shares.
    `prior`: the same shape's previous run, whose measured speed (`ops x`, the runtime's work per action) the
    `calibrated` prediction starts from, as the coordinator's next plan does (`atoll.coordinator.calibration`)."""
    import torch
    import torch.distributed as dist

    from atoll.job import JobSpec
    from atoll.node import runner
    from atoll.node.peer import PeerServer
    from atoll.node.transport_probe import probe_transport
    from atoll.node.runner import PlanRunner, RunContext

    torch.set_num_threads(1)
    job = JobSpec.from_toml(JOB_TOML.format(steps=steps))
    plan = shape_plan(shape, job.train.global_batch, job.train.seq_len)
    nodes = [n for p in plan.pipelines for s in p.stages for n in s.nodes]
    servers = {n: PeerServer(node_id=n, listen="127.0.0.1:0", token="t") for n in [*nodes, "probe"]}
    try:
        # measure: the node's layers (thread CPU time), the loopback link, a thread's share of a core
        profiles = profile_together(job, nodes)
        # the link as the runtime pays for it: real tensors through the pipeline transport at the boundary's
        # activation size and larger, one message's latency + size / bandwidth fitted to them
        act = boundary_bytes(shape, job)
        curve = probe_transport(servers[nodes[0]], servers["probe"], sizes=(act, 4 * act, 16 * act), repeats=9,
                                token="t")
        link = curve.measurement(src=nodes[0], dst="probe")
        share = core_share(len(nodes))
        before = predict_live(shape, *live_model(job, nodes, profiles, 1.0 / share, link))

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        plan = replace(plan, epoch=1, job_id="validate", rendezvous=f"127.0.0.1:{store.port}",
                       node_addresses={n: servers[n].address for n in nodes})
        done: dict[int, float] = {}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def report(m) -> bool:
            with lock:
                done[m.step] = max(done.get(m.step, 0.0), m.unix_time)
            return False

        ops: dict[str, list[tuple[str, float, float]]] = {}
        cpu_steps: dict[str, list[tuple[float, float, float, int]]] = {}

        class Recording(runner.PipelineStage):  # type: ignore[name-defined,misc]
            """The runtime's stage, keeping each measured step's compute ops (CPU and wall seconds)."""

            def train_step(self, step, batch=None):
                c0 = time.thread_time()
                result = super().train_step(step, batch)
                cpu = time.thread_time() - c0
                if step >= warm:
                    compute = [(t.op, t.cpu, t.compute) for t in result.timeline if t.compute > 0]
                    wall = sum(w for _, _, w in compute)
                    busy = sum(c for _, c, _ in compute) / wall if wall > 0 else 1.0
                    with lock:
                        name = threading.current_thread().name
                        ops.setdefault(name, []).extend(compute)
                        # the optimizer step's CPU: its wall time at the share of a core the compute got
                        cpu_steps.setdefault(name, []).append(
                            (cpu, sum(c for _, c, _ in compute), result.optimizer_seconds * min(1.0, busy),
                             len(result.timeline)))
                return result

        with tempfile.TemporaryDirectory() as tmp:
            def node(n: str) -> None:
                ctx = RunContext(node_id=n, job=job, peer_server=servers[n], checkpoint_dir=Path(tmp) / "ckpt",
                                 report_step=report, report_checkpoint=lambda c: None, token="t",
                                 timeout=timedelta(seconds=120))
                try:
                    PlanRunner(ctx, plan).run(threading.Event())
                except BaseException as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=node, args=(n,), name=n, daemon=True) for n in nodes]
            original = runner.PipelineStage
            runner.PipelineStage = Recording
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(600)
            finally:
                runner.PipelineStage = original
        if errors:
            raise RuntimeError(f"shape {shape.name!r} failed to run: {errors[0]!r}")
        seen = run_share(ops)
        overhead = action_overhead(cpu_steps)
        during = predict_live(shape, *live_model(job, nodes, profiles, 1.0 / seen, link), overhead / seen)
        cm, cluster = live_model(job, nodes, profiles, 1.0, link)
        expected = {}
        for n, (a, e, rows) in node_slices(shape).items():
            t = cm.table(cluster.islands[0], rows)
            # zero-bubble: a weight action of its own, the backward split in two passes
            w, x = (t.weight(a, e), t.split(a, e)) if shape.zero_bubble else (0.0, 0.0)
            expected[n] = {"forward": t.forward(a, e), "backward": t.backward(a, e) + x - w, "weight": w}
        factor = op_factor(ops, expected)
        per_op = op_cpu_factors(ops, expected)
        replayed = predict_live(shape, *live_model(job, nodes, profiles, factor, link), overhead / seen)
        calibrated = None
        if prior is not None:
            calibrated = predict_live(shape, *live_model(job, nodes, profiles, prior["factor"], link),
                                      prior["overhead"] / prior["seen"])
        return {"before": before, "during": during, "replayed": replayed, "calibrated": calibrated,
                "measured": measured_step(done, warm), "share": share, "seen": seen, "factor": factor,
                "overhead": overhead, "per_op": per_op}
    finally:
        for s in servers.values():
            s.stop()


def live_model(job, nodes: list[str], measured: dict[str, NodeProfile], slower: float,
               link: LinkMeasurement) -> tuple[CostModel, Cluster]:
    """The cost model and cluster the planner would make of the nodes (one island, each node's layers timed
    by its own profile, the island by its slowest: `ProfileSet.from_node_profiles`), every node's device
    `slower` times slower than its profile measured, and the loopback link too (its transfers and all-reduces
    are work of the same shared cores)."""
    islands = {"cpu": nodes}
    profiles = {n: measured[n].scaled(slower) for n in nodes}
    link = replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / slower,
                   rtt_seconds=link.rtt_seconds * slower)
    cluster = Cluster.from_nodes(islands, profiles, [link])
    # the run uses no ZeRO, recomputation, tensor parallelism or compression: hold the cost model to that
    options = PlannerOptions(micro_batches=(1, 2, 4, 8), activation_codecs=("identity",), zero_stages=(0,),
                             allow_recompute=False, max_tp=1)
    train = TrainSpec(global_batch=job.train.global_batch, seq_len=job.train.seq_len, dtype=job.train.dtype)
    return CostModel(job.model_spec, train, ProfileSet.from_node_profiles(islands, profiles, job.model_spec.block_params),
                     options), cluster


def with_action_overhead(times: PipelineTimes, seconds: float) -> PipelineTimes:
    """The pipeline's times with `seconds` of the runtime's own work added to every forward, backward and
    (zero-bubble) weight action."""
    if seconds <= 0:
        return times
    stages = []
    for i, s in enumerate(times.stages):
        w = seconds if times.deferred(i) else 0.0  # a weight action of its own
        stages.append(replace(s, forward_s=s.forward_s + seconds, backward_s=s.backward_s + seconds + w,
                              weight_s=s.weight_s + w))
    return replace(times, stages=tuple(stages))


def with_deferred_weights(times: PipelineTimes, cm: CostModel, island, stages: Sequence[tuple[int, int, int]],
                          micro_batch: int) -> PipelineTimes:
    """The pipeline's times with stage s deferring its weight gradients s + 1 micro-batches, their share of each
    backward and what splitting it adds from the cost model (as the planner's composer sets them)."""
    tables = [cm.table(island, -(-micro_batch // dp)) for _, _, dp in stages]
    split = [t.split(a, e) for t, (a, e, _) in zip(tables, stages)]
    weights = [min(st.backward_s + x, t.weight(a, e)) for st, t, x, (a, e, _) in zip(times.stages, tables, split, stages)]
    return replace(times, stages=tuple(replace(st, weight_s=w, split_s=x)
                                       for st, w, x in zip(times.stages, weights, split)),
                   defer=tuple(range(1, len(stages) + 1)))


def predict_live(shape: LiveShape, cm: CostModel, cluster: Cluster, overhead_s: float = 0.0) -> float:
    """The planner's predicted step of the shape on a live cluster (`live_model`), every forward and backward
    action of a stage taking `overhead_s` more for the runtime's own work (`action_overhead`)."""
    island = cluster.islands[0]
    pipes = []
    for p, (mb, m, stages) in enumerate(shape.pipelines):
        st = [Stage(island, a, e, dp, lanes=shape.lane(p, s)) for s, (a, e, dp) in enumerate(stages)]
        times = evaluate(cm, cluster, st, mb, mb * m)
        if times is None:
            raise ValueError(f"shape {shape.name!r} does not fit the cost model's memory")
        if shape.zero_bubble:
            # a laned stage's replicas share a micro-batch within their lane
            times = with_deferred_weights(times, cm, island, [(a, e, dp // shape.lane(p, k))
                                                              for k, (a, e, dp) in enumerate(stages)], mb)
        pipes.append((with_action_overhead(times, overhead_s), st))
    if len(pipes) > 1:
        link = slowest_link(cluster, [[island.id]] * len(pipes))
        assert link is not None
        pipes = [(_cross_sync(cm, t, st, len(pipes), link), st) for t, st in pipes]
    return max(simulate(t).step_time_s for t, _ in pipes)


# --- published configurations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: ModelConfig
    cluster: str
    """A cluster file (TOML) of the run's GPUs."""
    global_batch: int
    pp: int
    devices_per_stage: int
    """Data-parallel x tensor-parallel GPUs of every stage."""
    micro_batch: int
    """Sequences of a pipeline micro-batch (what every data-parallel replica runs, times the replicas); 0 where
    the paper does not say: the cost model's best of 1, 2, 4, 8 and 16 per replica."""
    step_s: float
    """The published (or derived) time of one iteration."""
    recompute: bool
    """The run recomputed every block's activations in backward."""
    how: str
    """How the step time was read or derived."""


def _dgx(name: str, device: str, gpus: int, intra: float, inter: float) -> str:
    return (f'[[group]]\nname = "{name}"\ndevice = "{device}"\ncount = {gpus}\ngpus_per_node = {min(8, gpus)}\n'
            f'intra_node_gbps = {intra}\ninter_node_gbps = {inter}\n')


_MTNLG = ModelConfig(name="mt-nlg-530b", vocab_size=50272, d_model=20480, n_layers=105, n_heads=128, seq_len=2048)
# DGX A100: NVLink 3 at 300 GB/s a direction (2,400 Gbit/s) inside a node, 8 x 200 Gbit/s HDR InfiniBand per node
PUBLISHED = (
    Published("Megatron-LM GPT-2 1.2B, 1 V100 (DGX-2H)",
              "NVIDIA ADLR, 'MegatronLM's Supercharged V1.0' (2019), Table 1: 1,288 ms per iteration at batch 8",
              ModelConfig(name="gpt2-1.2b", vocab_size=51200, d_model=1536, n_layers=40, n_heads=16, seq_len=1024),
              _dgx("v100", "V100-32GB", 1, 2400, 800), 8, 1, 1, 8, 1.288, True,
              "read from the table (1.2B: 1536 hidden, 40 layers, 16 heads, seq 1024, Shoeybi et al. 2019, Table 2)"),
    Published("Megatron-LM GPT 1.7B, 32 A100-80GB (dp 32)",
              "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', "
              "SC'21, Table 1: 137 TFLOP/s per GPU at batch 512, t=1, p=1",
              ModelConfig(name="gpt-1.7b", vocab_size=51200, d_model=2304, n_layers=24, n_heads=24, seq_len=2048),
              _dgx("a100", "A100-80GB", 32, 2400, 1600), 512, 1, 32, 0,
              megatron_flops(512, 2048, 24, 2304, 51200) / (137e12 * 32), True,
              "derived: the paper's eq. 3 FLOPs / (137 TFLOP/s x 32 GPUs)"),
    Published("MT-NLG 530B, 2240 A100-40GB (t=8, p=35, d=8)",
              "Smith et al., 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B' (2022), sec. 2.4: "
              "60.1 s per iteration at batch 1920 on 280 DGX A100",
              _MTNLG, _dgx("a100", "A100-40GB", 2240, 2400, 1600), 1920, 35, 64, 8, 60.1, True,
              "read from the text (micro-batch 1 per replica)"),
    Published("MT-NLG 530B, 2800 A100-40GB (t=8, p=35, d=10)",
              "same paper and section: 50.2 s per iteration on 350 DGX A100",
              _MTNLG, _dgx("a100", "A100-40GB", 2800, 2400, 1600), 1920, 35, 80, 10, 50.2, True,
              "read from the text"),
    Published("MT-NLG 530B, 3360 A100-40GB (t=8, p=35, d=12)",
              "same paper and section: 44.4 s per iteration on 420 DGX A100",
              _MTNLG, _dgx("a100", "A100-40GB", 3360, 2400, 1600), 1920, 35, 96, 12, 44.4, True,
              "read from the text"),
)


def predict_published(p: Published) -> tuple[float, str]:
    """The cost model's step time for the configuration as published, and what the parallelizer chose."""
    if not p.micro_batch:
        tried = [predict_published(replace(p, micro_batch=k * p.devices_per_stage)) for k in (1, 2, 4, 8, 16)
                 if p.global_batch % (k * p.devices_per_stage) == 0]
        return min(tried, key=lambda x: x[0])
    model = ModelSpec.from_config(p.model)
    cluster = parse_cluster(p.cluster, source=p.name)
    island = cluster.islands[0]
    cm = CostModel(model, TrainSpec(global_batch=p.global_batch, seq_len=p.model.seq_len),
                   options=PlannerOptions(micro_batches=(1, 2, 4, 8, 16)))
    par = DefaultParallelizer(cm)
    cuts = megatron_layers(model.num_layers, p.pp)
    m = math.ceil(p.global_batch / p.micro_batch)
    stages: list[StageTimes] = []
    chosen: set[tuple[int, int, int]] = set()
    for i, (a, e) in enumerate(cuts):
        c = par.cost(SliceQuery(start=a, end=e, micro_batch=1, dp=p.devices_per_stage, in_flight=min(p.pp - i, m),
                                batch=p.micro_batch), island)
        if c is None:
            return math.inf, "does not fit"
        params = model.slice_params(a, e)
        st = StageTimes(forward_s=c.forward_s, backward_s=c.backward_s, sync_s=cm.grad_sync_seconds(params, island, c.dp, c.tp),
                        optimizer_s=cm.optimizer_seconds(island, params, c.zero, c.dp, c.tp))
        if p.recompute:
            st = full_recompute(st, cm, island, a, e, c.micro_batch, c.tp, c.recompute_layers)
        stages.append(st)
        chosen.add((c.dp, c.tp, c.zero))
    links = []
    if p.pp > 1:
        # the boundaries' transfers as the planner times them (evaluate: codec, stream bandwidth, latency)
        shape = [Stage(island, a, e, p.devices_per_stage) for a, e in cuts]
        times = evaluate(cm, cluster, shape, p.micro_batch)
        links = list(times.links) if times is not None else []
    times = PipelineTimes(stages=tuple(stages), links=tuple(links), num_micro_batches=m)
    splits = sorted({(dp, tp) for dp, tp, _ in chosen})
    zeros = "/".join(str(z) for z in sorted({z for _, _, z in chosen}))
    return simulate(times).step_time_s, (f"micro-batch {p.micro_batch}, " + ", ".join(f"dp {d} x tp {t}" for d, t in splits)
                                         + f", ZeRO-{zeros}" + (", full recomputation" if p.recompute else ""))


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="steps per live shape (the first --warm are left out)")
    ap.add_argument("--warm", type=int, default=2, help="warm-up steps left out of the measurement")
    ap.add_argument("--only", help="run only rows whose name contains this")
    ap.add_argument("--skip-live", action="store_true", help="only the published configurations")
    ap.add_argument("--repeats", type=int, default=9,
                    help="runs of every live shape, interleaved (round r runs every shape once); each row is the "
                         "median over them (a shape's runs on this 2-core machine spread over +-25%%: nine of "
                         "ten steps each give a steadier median than five of eight)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.steps < args.warm + 3:
        ap.error("--steps must leave at least three steps after --warm")
    targets: list[tuple[str, bool]] = []
    print(f"live shapes: GPT d_model 128, 4 blocks, seq 128, global batch 32, fp32; {os.cpu_count()} CPUs, nodes as "
          "threads (one torch thread each); predicted from measured profiles and a probed loopback link")
    print(f"{'shape':<32} {'nodes':>5} {'core before':>11} {'predicted s':>11} {'gap':>6} {'core run':>8} "
          f"{'predicted s':>11} {'measured s':>10} {'gap':>6} {'ops x':>6} {'replayed s':>10} {'gap':>6} "
          f"{'gap range':>12} {'ms/action':>9} {'calibrated':>10} {'its range':>12}")
    if not args.skip_live:
        shapes = [s for s in SHAPES if not args.only or args.only in s.name]
        runs: dict[str, list[dict]] = {s.name: [] for s in shapes}
        for rnd, shape in interleaved(shapes, args.repeats):
            r = run_live(shape, args.steps, args.warm, runs[shape.name][-1] if runs[shape.name] else None)
            runs[shape.name].append(r)
            if args.repeats > 1:
                print(f"  round {rnd + 1}/{args.repeats} {shape.name:<32} core run {r['seen']:.2f} predicted "
                      f"{r['during']:.3f} s measured {r['measured']:.3f} s gap {gap(r['during'], r['measured']):+.0%}",
                      flush=True)
        per_op: dict[str, dict[str, float]] = {}
        for shape in shapes:
            r = combine(runs[shape.name])
            per_op[shape.name] = r["per_op"]
            g0, g, g2 = r["gap_before"], r["gap_during"], r["gap_replayed"]
            print(f"{shape.name:<32} {shape.nodes:>5} {r['share']:>11.2f} {r['before']:>11.3f} {g0:>+6.0%} "
                  f"{r['seen']:>8.2f} {r['during']:>11.3f} {r['measured']:>10.3f} {g:>+6.0%} {r['factor']:>6.2f} "
                  f"{r['replayed']:>10.3f} {g2:>+6.0%} {r['spread']:>12} {r['overhead'] * 1e3:>9.2f} "
                  + (f"{r['gap_calibrated']:>+10.0%} {r['spread_calibrated']:>12}" if r["gap_calibrated"] is not None
                     else f"{'-':>10} {'-':>12}"), flush=True)
            targets.append((f"live {shape.name}: within {LIVE_TOLERANCE:.0%}", abs(g) <= LIVE_TOLERANCE))
            if r["gap_calibrated"] is not None:
                targets.append((f"live {shape.name}: calibrated on its previous run, within {LIVE_TOLERANCE:.0%}",
                                abs(r["gap_calibrated"]) <= LIVE_TOLERANCE))
        if per_op:
            print("compute ops' CPU seconds in the run over the profile's, per action (1.00: as profiled; above: work "
                  "the profile of one layer alone does not see, which no share of a core explains):")
            for name, f in per_op.items():
                print(f"  {name:<32} " + ", ".join(f"{k} {v:.2f}x" for k, v in f.items()))
    print()
    print(f"{'published configuration':<48} {'published s':>11} {'predicted s':>12} {'gap':>7}  as predicted / source")
    for p in PUBLISHED:
        if args.only and args.only not in p.name:
            continue
        pred, chosen = predict_published(p)
        g = gap(pred, p.step_s)
        print(f"{p.name:<48} {p.step_s:>11.3f} {pred:>12.3f} {g:>+6.0%}  {chosen}\n{'':>82}{p.source} ({p.how})",
              flush=True)
        targets.append((f"published {p.name}: within {PUBLISHED_TOLERANCE:.0%}", abs(g) <= PUBLISHED_TOLERANCE))
    missed = [n for n, ok in targets if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
