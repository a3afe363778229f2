"""Regions benchmark: outer mode across regions against each region alone and an ideal synchronous run, in three
scenarios on the geo testbed (`bench/geo.py`), all in one run:
 (a) two equal regions of two hosts (0.3 of a core each), 20 Mbit/s and 50 ms one way between them;
 (b) three uneven regions: lab-a 2 hosts at 0.35 of a core, lab-b 2 at 0.2, lab-c 1 at 0.15; links of 20 (a-b),
     10 (a-c) and 5 (b-c) Mbit/s, 100 ms one way (200 ms round trips); the outer run once with int8
     pseudo-gradients and once with sparse2;
 (c) (b)'s int8 run with faults: the coordinator SIGKILLed and restarted `--outage` s later; the b-c link cut for
     `--cut` s (both veth ends down) and restored; lab-b's processes SIGKILLed and restarted `--down` s later.
     Each fault waits for the groups to step again after the one before.

Per scenario, each region trains the job alone (sync, its own coordinator; the regions side by side, so the
machine is as loaded as in the joint runs; the best region trains every step, the others until it is done);
then the regions train together in outer mode (a replica group per region, H inner steps a round). Each run's
tokens/s is the tokens of every step a group completed (the step's report from its last node, each step counted
once) over the wall time from its first to its last step report (the coordinator's store, read while the run goes
on: it keeps the newest 2,000 reports only). WAN bytes are the switches' WAN veth counters (all traffic: the
exchange, and the coordinator's to regions other than the first) from the first step report to the end.
Eval loss: every complete checkpoint is loaded here into the whole model and scored on a fixed batch of 64
windows drawn at a step index far beyond training; it is paired with the writer's report of that step and the
tokens every group had trained by then.

The ideal, computed in the same run: one process (this one) trains the job synchronously, with no communication,
at the global batch the regions fill together: the best region's batch x (sum of the regions' tokens/s alone /
the best region's), with the same schedule, data and evaluation. S_ideal: its steps to the best region's final
eval loss; S_1: the best region's own steps to it; T_ideal = S_ideal x the best region's step time alone; T_1
the best region's wall time to that loss; T_outer outer mode's. Also printed: each group's seconds waited on the
outer exchange and the outer sync's own bytes per token (the coordinator's counters, which its store keeps across
its restarts; sparse2's bytes target is judged on these, the veth figure beside them), anchor hash
mismatches (the coordinator's log over all its lifetimes, and its status), the checkpoints on disk, and in (c) what
each fault did (the longest a group went without a step after it). `runs/bench-regions/loss.png`: eval loss
against tokens and against wall time, a row of panels per scenario. It ends with `targets met: N/M`.

Usage (as root): python -m bench.regions [--only a,b,c] [--quick] [--steps 600] [--inner-steps 10]
A full run takes about 30-40 minutes on a 2-core machine; --quick (240 steps, shorter faults) took 16 minutes on a
busy one. The coordinator's restart in (c) includes its start-up: it is back when it listens again.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVAL_STEP = 10 ** 6
EVAL_ROWS = 64
LEASE_S = 10.0
"""The coordinator's lease (passed as --lease): a stall after a fault is judged against a lease plus one round."""
MIN_RATE_STEPS = 20
"""A region alone trains at least this many steps, so its tokens/s is measured over more than start-up."""
POLL_S = 1.0


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    regions: dict[str, int]
    quotas: dict[str, float]
    """CPU per host of each region, of a core: every host plus the coordinator must fit this machine's 2 cores."""
    rate: float
    """bits/s between regions, unless `rates` has the pair."""
    rates: dict[tuple[str, str], float] = field(default_factory=dict)
    latency_ms: float = 50.0
    """One way between regions (emulated by the nodes, see bench/geo.py)."""
    faults: bool = False

    def describe(self) -> str:
        hosts = ", ".join(f"{r} {n} host{'s' if n > 1 else ''} at {self.quotas[r]:g}" for r, n in self.regions.items())
        names = list(self.regions)
        links = ", ".join(f"{a[-1]}-{b[-1]} {self.rates.get((a, b), self.rate) / 1e6:g}"
                          for i, a in enumerate(names) for b in names[i + 1:])
        return f"{hosts} of a core; {links} Mbit/s; {2 * self.latency_ms:.0f} ms round trips"


SCENARIO_A = Scenario(key="a", title="(a) two equal regions", regions={"lab-a": 2, "lab-b": 2},
                      quotas={"lab-a": 0.3, "lab-b": 0.3}, rate=20e6, latency_ms=50.0)
SCENARIO_B = Scenario(key="b", title="(b) three uneven regions", regions={"lab-a": 2, "lab-b": 2, "lab-c": 1},
                      quotas={"lab-a": 0.35, "lab-b": 0.2, "lab-c": 0.15}, rate=20e6,
                      rates={("lab-a", "lab-b"): 20e6, ("lab-a", "lab-c"): 10e6, ("lab-b", "lab-c"): 5e6},
                      latency_ms=100.0)
SCENARIO_C = replace(SCENARIO_B, key="c", title="(c) (b) with faults", faults=True)
CUT = ("lab-b", "lab-c")
"""The link (c) cuts: one the coordinator (beside lab-a) does not use, so the cut parts the two regions only."""
KILLED = "lab-b"
"""The region (c) kills and restarts (not the checkpoint writer, the plan's first group)."""


# --- pure helpers (unit-tested) ------------------------------------------------------------------------

def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """y at `x` on the piecewise-linear curve through (xs, ys) (xs ascending); None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    k = bisect.bisect_left(xs, x)
    if xs[k] == x:
        return ys[k]
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def time_to_reach(times: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The first time the piecewise-linear loss curve comes down to `target`; None when it never does."""
    for k, (t, loss) in enumerate(zip(times, losses)):
        if loss <= target:
            if k == 0:
                return t
            t0, l0 = times[k - 1], losses[k - 1]
            return t0 + (t - t0) * (l0 - target) / (l0 - loss) if l0 != loss else t
    return None


def tokens_by(step_times: Mapping[str, Sequence[float]], t: float, tokens_per_step: int) -> int:
    """Tokens trained by time `t`: per group, the steps whose (sorted) completion times are <= t."""
    return sum(bisect.bisect_right(times, t) for times in step_times.values()) * tokens_per_step


def parse_only(text: str | None) -> list[str]:
    """`--only a,c` -> ["a", "c"] (in a, b, c order); None or "" -> all three. ValueError names a bad key."""
    if not text:
        return ["a", "b", "c"]
    keys = {k.strip().lower() for k in text.split(",") if k.strip()}
    bad = keys - {"a", "b", "c"}
    if bad:
        raise ValueError(f"--only takes scenarios a, b and c separated by commas, got {', '.join(sorted(bad))}")
    return [k for k in "abc" if k in keys]


def ideal_rows(best_rows: int, rates_alone: Mapping[str, float], best: str) -> int:
    """The global batch the regions fill together: the best region's batch x (the sum of the regions' tokens/s
    alone / the best region's tokens/s alone), to the nearest row."""
    return max(1, round(best_rows * sum(rates_alone.values()) / rates_alone[best]))


@dataclass(frozen=True)
class Ideal:
    rows: int
    target: float
    """The best region's final eval loss."""
    s_ideal: float | None
    s_1: float | None
    t_ideal: float | None
    t_1: float | None


def ideal_figures(*, rows: int, target: float, best_steps: Sequence[float], best_losses: Sequence[float],
                  best_times: Sequence[float], best_step_s: float, ideal_steps: Sequence[float],
                  ideal_losses: Sequence[float]) -> Ideal:
    """S_ideal, S_1, T_ideal and T_1 from the best region's curve (steps, eval losses, wall times) and the ideal run's
    (steps, eval losses); `best_step_s` is the best region's step time alone."""
    s_ideal = time_to_reach(ideal_steps, ideal_losses, target)
    return Ideal(rows=rows, target=target, s_ideal=s_ideal, s_1=time_to_reach(best_steps, best_losses, target),
                 t_ideal=s_ideal * best_step_s if s_ideal is not None else None,
                 t_1=time_to_reach(best_times, best_losses, target))


def loss_targets(label: str, t_outer: float | None, ideal: Ideal) -> list[tuple[str, bool]]:
    """T_outer at most 0.95 T_1, and T_1 - T_outer at least half of T_1 - T_ideal."""
    t_1, t_ideal = ideal.t_1, ideal.t_ideal
    if t_outer is None or t_1 is None:
        why = "never reached" if t_outer is None else "T_1 unknown"
        return [(f"{label} T_outer <= 0.95 T_1: {why}", False),
                (f"{label} T_1 - T_outer >= (T_1 - T_ideal) / 2: {why}", False)]
    first = (f"{label} T_outer <= 0.95 T_1: {t_outer:.1f}s vs {t_1:.1f}s = {t_outer / t_1:.2f}x", t_outer <= 0.95 * t_1)
    if t_ideal is None:
        return [first, (f"{label} T_1 - T_outer >= (T_1 - T_ideal) / 2: the ideal run never reached the loss", False)]
    gain, room = t_1 - t_outer, t_1 - t_ideal
    return [first, (f"{label} T_1 - T_outer >= (T_1 - T_ideal) / 2: {gain:.1f}s vs {room:.1f}s / 2",
                    gain >= room / 2)]


def longest_gap_after(times: Sequence[float], start: float, until: float | None = None) -> float:
    """The longest a sorted sequence of step times goes without a step from `start` on (the gap `start` falls in
    counted from `start`), up to `until` (None: its last step; a gap running past `until` counts up to it)."""
    k = bisect.bisect_right(times, start)
    prev, worst = start, 0.0
    for t in times[k:]:
        if until is not None and prev >= until:
            break
        worst = max(worst, (t if until is None else min(t, until)) - prev)
        prev = t
    return worst


def steps_went_back(steps_in_report_order: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) for each place a node's reported step is not above the one before: a rollback (or a repeat)."""
    return [(a, b) for a, b in zip(steps_in_report_order, steps_in_report_order[1:]) if b <= a]


def missing_checkpoints(on_disk: Iterable[int], interval: int, last: int) -> list[int]:
    """The steps of `interval`, `2 interval`, ... and `last` itself (the final one) with no complete checkpoint."""
    have = set(on_disk)
    wanted = set(range(interval, last + 1, interval)) | ({last} if last > 0 else set())
    return sorted(wanted - have)


def describe_steps(steps: Sequence[int]) -> str:
    """[10, 20, 30, 50] -> "step-10..30 every 10, 50"; runs of equal spacing shortened."""
    steps = sorted(steps)
    if not steps:
        return "none"
    parts, k = [], 0
    while k < len(steps):
        j = k
        if k + 2 < len(steps):
            d = steps[k + 1] - steps[k]
            while j + 1 < len(steps) and steps[j + 1] - steps[j] == d:
                j += 1
        if j - k >= 2:
            parts.append(f"{steps[k]}..{steps[j]} every {steps[k + 1] - steps[k]}")
            k = j + 1
        else:
            parts.append(str(steps[k]))
            k += 1
    return "step-" + ", ".join(parts)


_MISMATCH = re.compile(r"the anchors differ")


def count_mismatch_lines(log_text: str) -> int:
    """Anchor mismatches the coordinator logged (over every lifetime: its log is appended to on restarts)."""
    return len(_MISMATCH.findall(log_text))


# --- one run ---------------------------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str
    start: float
    """Seconds since the run's first step report."""
    end: float
    """When it was repaired (coordinator back, link restored, region restarted)."""
    stall_s: float = 0.0
    """The longest a group went without a step after it (see `judge_faults`)."""
    note: str = ""


@dataclass
class RunResult:
    name: str
    plan: str
    wall_s: float
    tokens: int
    tokens_per_step: int
    step_times: dict[str, list[float]]
    """Region -> completion times (since the first report) of its distinct steps, sorted."""
    wan_bytes: int | None
    exchange_bytes: int | None = None
    """Bytes of the outer exchanges alone, as the nodes counted them (sent and received, summed over the nodes; the
    coordinator's account, kept in its store across its restarts). None: not outer mode."""
    curve: list[tuple[int, float, int, float]] = field(default_factory=list)
    """Per checkpoint: (step, seconds since the first step report, tokens by then, eval loss)."""
    waited: dict[str, float] = field(default_factory=dict)
    """Region -> seconds its slowest node waited on the outer exchange (the coordinator's account)."""
    mismatches_logged: int = 0
    mismatches_status: int = 0
    rounds: dict[str, int] = field(default_factory=dict)
    """Region -> rounds it took part in (the coordinator's account, its newest lifetime)."""
    checkpoints: list[int] = field(default_factory=list)
    final_checkpoint: int = 0
    last_checkpoint: int = 0
    interval: int = 0
    went_back: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Node name -> where its steps went back."""
    faults: list[Fault] = field(default_factory=list)
    round_s: float = 0.0
    finished: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def final_loss(self) -> float | None:
        return self.curve[-1][3] if self.curve else None

    def step_s(self, region: str) -> float:
        """Mean seconds a step of `region` took: its training time over its steps."""
        times = self.step_times.get(region, [])
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0

    def median_step_s(self, region: str) -> float:
        """The median seconds between `region`'s steps (waits and outages left out)."""
        times = self.step_times.get(region, [])
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2] if gaps else 0.0

    def time_to(self, loss: float) -> float | None:
        return time_to_reach([c[1] for c in self.curve], [c[3] for c in self.curve], loss)


def _job(base: Path, out: Path, name: str, *, steps: int, mode: str, nodes: int, inner: int, codec: str,
         deadline: float, apply_after: int = 0, rows: int | None = None) -> Path:
    from atoll.job import JobSpec

    job = JobSpec.load(base)
    train = replace(job.train, steps=steps, warmup=min(job.train.warmup, steps // 10))
    if rows is not None:
        train = replace(train, global_batch=rows, micro_batch=rows)
    job = replace(job, name=f"regions-{name}", id="", train=train,
                  checkpoint=replace(job.checkpoint, interval=inner, keep=0),
                  cluster=replace(job.cluster, expected_nodes=nodes, min_nodes=1 if mode == "outer" else nodes),
                  outer=replace(job.outer, mode=mode, inner_steps=inner, codec=codec, overlap=True,
                                deadline_seconds=deadline, apply_after=apply_after))
    path = out / f"job-{name}.toml"
    path.write_text(job.to_toml())
    return path


def _groups_of(plan) -> list[set[str]]:
    if plan.mode == "outer" and plan.groups:
        return [{n for p in g.pipelines for st in plan.pipelines[p].stages for n in st.nodes} for g in plan.groups]
    return [{n for p in plan.pipelines for st in p.stages for n in st.nodes}]


def _describe(plan) -> str:
    if plan is None:
        return "no plan seen"
    parts = []
    for g, _ in enumerate(_groups_of(plan)):
        pipes = [p for p in range(len(plan.pipelines)) if plan.group_of(p) == g] if plan.mode == "outer" \
            else range(len(plan.pipelines))
        parts.append(" | ".join(" -> ".join(f"{s.island}[{s.layers[0]},{s.layers[1]})x{s.dp}"
                                             for s in plan.pipelines[p].stages) for p in pipes))
    how = (f"outer, {len(plan.groups)} groups, H={'/'.join(str(g.inner_steps) for g in plan.groups)}, "
           f"{plan.outer.codec}") if plan.mode == "outer" else "sync"
    return f"{how}: " + "; ".join(parts)


def evaluate(job, checkpoints: Path, steps: Sequence[int]) -> dict[int, float]:
    """Mean loss of the whole model at each checkpoint step on the fixed held-out batch."""
    import torch

    from atoll.node.checkpoint import load_layers
    from atoll.node.data import TokenDataset
    from atoll.node.model import build_slice, lm_loss

    data = TokenDataset.from_source(job.data.source, job.train.seq_len, seed=job.train.seed)
    batch = data.global_batch(EVAL_STEP, EVAL_ROWS)
    total = job.model.n_layers + 2
    out = {}
    for step in steps:
        module = build_slice(job.model, 0, total, seed=job.train.seed)
        optimizer = torch.optim.AdamW(module.parameters())
        load_layers(module, optimizer, checkpoints, step)
        module.eval()
        with torch.no_grad():
            out[step] = float(lm_loss(module(batch.inputs), batch.targets))
    return out


def ideal_curve(job_path: Path, every: int, *, target: float | None = None, min_tokens: int = 0
                ) -> list[tuple[int, float]]:
    """The ideal run: the job (its global batch already the regions' together) trained in this process, unsplit;
    (steps trained, eval loss) every `every` steps and at the end, or until the eval loss came down to `target`
    with at least `min_tokens` trained."""
    import torch
    from datetime import timedelta

    from atoll.job import JobSpec
    from atoll.node.data import TokenDataset
    from atoll.node.datasets import open_dataset
    from atoll.node.inprocess import InProcessLinks
    from atoll.node.model import build_slice, lm_loss
    from atoll.node.runner import learning_rate, stage_config
    from atoll.node.stage import PipelineStage

    job = JobSpec.load(job_path)
    t = job.train
    module = build_slice(job.model, 0, job.model.n_layers + 2, seed=t.seed)
    cfg = stage_config(job, t.global_batch // t.micro_batch, timedelta(seconds=60))
    stage = PipelineStage(module, stage=0, num_stages=1, transport=InProcessLinks(1).transport(0), config=cfg)
    data = open_dataset(job.data, seq_len=t.seq_len, seed=t.seed, vocab_size=job.model.vocab_size)
    held = TokenDataset.from_source(job.data.source, t.seq_len, seed=t.seed).global_batch(EVAL_STEP, EVAL_ROWS)
    out = []
    for step in range(t.steps):
        for group in stage.optimizer.param_groups:
            group["lr"] = learning_rate(job, step)
        stage.train_step(step, data.global_batch(step, t.global_batch))
        if (step + 1) % every == 0 or step + 1 == t.steps:
            module.eval()
            with torch.no_grad():
                out.append((step + 1, float(lm_loss(module(held.inputs), held.targets))))
            module.train()
            if target is not None and out[-1][1] <= target and (step + 1) * t.global_batch * t.seq_len >= min_tokens:
                break
    return out


class _Watch:
    """Polls a run's coordinator (status) and store (step reports) while it runs; `up` clear: it is down, leave it
    (a reader closing the store while the coordinator is down checkpoints its write-ahead log away)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.up = threading.Event()
        self.up.set()
        self.reports: dict[tuple[str, int, int], object] = {}
        self.status = None
        self.lives: list[object] = [None]
        """The newest status of each coordinator lifetime."""
        self.lock = threading.Lock()

    def poll(self) -> None:
        from atoll.coordinator.store import SqliteStore

        if not self.up.is_set():
            return
        try:
            status = self.cluster.status(timeout=3.0)
        except Exception:  # noqa: BLE001 - busy or starting: next time
            status = None
        if not self.up.is_set():
            return
        if status is not None:
            with self.lock:
                self.status = status
                self.lives[-1] = status
        if not self.cluster.state_db.is_file():
            return
        store = SqliteStore(self.cluster.state_db, read_only=True)
        try:
            limit = 256
            while True:  # back until a report read before (the store keeps the newest 2,000)
                batch = store.recent_steps(limit=limit)
                if len(batch) < limit or limit >= 2000 or self._key(batch[0]) in self.reports:
                    break
                limit *= 4
        finally:
            store.close()
        with self.lock:
            for r in batch:
                self.reports.setdefault(self._key(r), r)

    @staticmethod
    def _key(r) -> tuple[str, int, int]:
        return (r.node_id, r.plan_epoch, r.step)

    def new_life(self) -> None:
        with self.lock:
            self.lives.append(None)


def region_step_times(reports: Iterable, region_of: Mapping[str, str]) -> dict[str, dict[int, float]]:
    """Region -> step number -> when the region completed it (its report from the region's last node; a step trained
    again after a rollback at its newest completion). In outer mode a group that trains fewer steps than H a round
    completes only some step numbers: the last of each round, and those before it that it trains."""
    per: dict[tuple[str, int, int], list[float]] = {}
    for r in reports:
        region = region_of.get(r.node_id)
        if region is not None:
            per.setdefault((region, r.plan_epoch, r.step), []).append(r.unix_time)
    out: dict[str, dict[int, float]] = {}
    for (region, _, step), times in per.items():
        done = out.setdefault(region, {})
        done[step] = max(done.get(step, 0.0), max(times))
    return out


def _region_steps(reports: Iterable, region_of: Mapping[str, str], nodes_in: Mapping[str, int]) -> dict[str, list[float]]:
    """Region -> the completion time of each distinct step (`region_step_times`), sorted."""
    return {r: sorted(v.values()) for r, v in region_step_times(reports, region_of).items()}


class _Faults:
    """(c)'s faults, one after another as the writer group passes fractions of its steps; each waits for every
    group to step again after the one before."""

    def __init__(self, tb, cluster, watch: _Watch, hosts, *, outage: float, cut: float, down: float, say) -> None:
        self.tb, self.cluster, self.watch, self.hosts, self.say = tb, cluster, watch, hosts, say
        self.plan = [("coordinator", 0.15, outage), ("link", 0.35, cut), ("region", 0.6, down)]
        self.done: list[Fault] = []
        self.active: tuple[str, float, float] | None = None
        self.dead: set[str] = set()
        self.t0 = 0.0

    @property
    def finished(self) -> bool:
        return not self.plan and self.active is None

    def step(self, progress: float, recovered: bool, now: float) -> None:
        if self.active is not None:
            kind, started, length = self.active
            if now - started < length:
                return
            self._repair(kind)
            self.done.append(Fault(kind=kind, start=started - self.t0, end=time.time() - self.t0))
            self.active = None
            return
        if not self.plan or not recovered or progress < self.plan[0][1]:
            return
        kind, _, length = self.plan.pop(0)
        self._break(kind)
        self.active = (kind, time.time(), length)

    def _break(self, kind: str) -> None:
        if kind == "coordinator":
            self.watch.up.clear()
            self.cluster.kill_coordinator()
            self.say("coordinator SIGKILLed")
        elif kind == "link":
            self.tb.set_wan(*CUT, up=False)
            self.say(f"link {CUT[0]}-{CUT[1]} cut")
        else:
            self.dead = {name for name, h in self.hosts.items() if h.region == KILLED}
            for name in sorted(self.dead):
                proc = self.cluster.procs.get(name)
                if proc is not None and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            self.say(f"{KILLED}'s {len(self.dead)} processes SIGKILLed")

    def _repair(self, kind: str) -> None:
        if kind == "coordinator":
            self.cluster.start_coordinator(listen=self.cluster.address, host=self.tb.coordinator,
                                           extra=_coordinator_extra())
            self.watch.new_life()
            self.watch.up.set()
            self.say("coordinator restarted")
        elif kind == "link":
            self.tb.set_wan(*CUT, up=True)
            self.say(f"link {CUT[0]}-{CUT[1]} restored")
        else:
            for name in sorted(self.dead):
                self.cluster.start_node(name, host=self.hosts[name])
            self.dead = set()
            self.say(f"{KILLED} restarted")


def group_totals(state_db: Path) -> tuple[dict[str, float], dict[str, int], int | None]:
    """Per replica group, from the coordinator's store (its counters outlive its restarts): the seconds it waited
    on exchanges, the rounds it took part in; and the bytes of every exchange (None: no group, not outer mode)."""
    from atoll.coordinator.outer import GroupProgress
    from atoll.coordinator.store import SqliteStore

    if not state_db.is_file():
        return {}, {}, None
    store = SqliteStore(state_db, read_only=True)
    try:
        groups = [GroupProgress.from_json(text) for text in store.outer_groups().values()]
    finally:
        store.close()
    return ({g.name: g.wait_total_s for g in groups}, {g.name: g.rounds_in for g in groups},
            sum(g.sync_bytes_total for g in groups) if groups else None)


def _coordinator_extra() -> list[str]:
    # the regions define the islands (probes of a busy 2-core machine vary too much to part them)
    return ["--island-threshold", "0.001", "--lease", str(LEASE_S)]


def run(tb, name: str, job_path: Path, hosts: Sequence, out: Path, timeout: float, *, say: Callable[[str], None],
        stop: threading.Event | None = None, done: threading.Event | None = None, faults: dict | None = None,
        wan: bool = True) -> RunResult:
    """One job on `hosts` until it finishes (or, with `stop`, until that is set and each region trained
    MIN_RATE_STEPS steps); `done` is set when it finished. `faults`: (c)'s fault lengths (outage, cut, down)."""
    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster
    from atoll.node.checkpoint import complete_steps_on_disk
    from atoll.serde import plan_from_proto

    job = JobSpec.load(job_path)
    by_name = {h.name: h for h in hosts}
    tokens_per_step = job.train.global_batch * job.train.seq_len
    region_of: dict[str, str] = {}
    nodes_in = {r: sum(1 for h in hosts if h.region == r) for r in {h.region for h in hosts}}
    first_bytes = end_bytes = None
    plan = None
    fault_run = None
    finished = False
    with LocalCluster(job_path=job_path, out=out) as cluster:
        state_db = cluster.state_db
        cluster.start_coordinator(host=tb.coordinator, extra=_coordinator_extra())
        for h in hosts:
            cluster.start_node(h.name, host=h)
        watch = _Watch(cluster)
        if faults is not None:
            fault_run = _Faults(tb, cluster, watch, by_name, say=say, **faults)
        end = time.monotonic() + timeout
        last_say = time.monotonic()
        t0 = None
        try:
            while True:
                now = time.monotonic()
                if now > end:
                    raise TimeoutError(f"run {name} did not finish within {timeout:.0f}s; logs in {out}")
                dead = fault_run.dead if fault_run is not None else set()
                for n, p in cluster.procs.items():
                    if n not in dead and p.poll() is not None and p.returncode != 0:
                        raise RuntimeError(f"{n} exited with code {p.returncode}; see {out}/{n}.log")
                watch.poll()
                if len(region_of) < len(hosts):
                    for h in hosts:
                        f = out / h.name / "node_id"
                        if f.is_file() and f.read_text().strip():
                            region_of[f.read_text().strip()] = h.region
                with watch.lock:
                    reports = list(watch.reports.values())
                    status = watch.status
                if reports and first_bytes is None:
                    first_bytes = tb.wan_bytes() if wan else None
                    t0 = min(r.unix_time for r in reports)
                    if fault_run is not None:
                        fault_run.t0 = t0
                if status is not None and status.plan.epoch >= 1 and watch.up.is_set():
                    plan = plan_from_proto(status.plan)
                steps = _region_steps(reports, region_of, nodes_in)
                if status is not None and watch.up.is_set() and status.job_state == "finished":
                    finished = True
                    break
                if not any(p.poll() is None for n, p in cluster.procs.items() if n != "coordinator") \
                        and (fault_run is None or fault_run.active is None):
                    finished = True  # every node left (they leave once the job is done)
                    break
                if stop is not None and stop.is_set() and steps and \
                        all(len(steps.get(r, [])) >= MIN_RATE_STEPS for r in nodes_in):
                    break
                if fault_run is not None and plan is not None and t0 is not None:
                    progress = max(map(len, steps.values()), default=0) / job.train.steps
                    since = t0 + (fault_run.done[-1].end if fault_run.done else 0.0)
                    recovered = all(sum(t > since for t in steps.get(r, [])) >= 2 for r in nodes_in)
                    fault_run.step(progress, recovered, time.time())
                if time.monotonic() - last_say > 30:
                    last_say = time.monotonic()
                    say(", ".join(f"{r} {len(steps.get(r, []))} steps" for r in sorted(nodes_in)))
                time.sleep(POLL_S)
            end_bytes = tb.wan_bytes() if wan else None
            if finished and status is not None:  # the last checkpoint is written after the last step's report
                wait = time.monotonic() + 20
                while status.final_checkpoint_step and status.final_checkpoint_step not in \
                        complete_steps_on_disk(cluster.checkpoints, job.model.n_layers + 2) and time.monotonic() < wait:
                    time.sleep(0.5)
            watch.poll()
        finally:
            if fault_run is not None and fault_run.active is not None and fault_run.active[0] == "link":
                tb.set_wan(*CUT, up=True)
        if done is not None and finished:
            done.set()
        coordinator_log = (out / "coordinator.log").read_text(errors="replace")
        node_logs = {h.name: (out / f"{h.name}.log").read_text(errors="replace") for h in hosts
                     if (out / f"{h.name}.log").is_file()}
    reports = list(watch.reports.values())
    if not reports:
        raise RuntimeError(f"run {name} reported no step; logs in {out}")
    t0 = min(r.unix_time for r in reports)
    steps = {r: [t - t0 for t in v] for r, v in _region_steps(reports, region_of, nodes_in).items()}
    wall = max(v[-1] for v in steps.values())
    tokens = sum(len(v) for v in steps.values()) * tokens_per_step
    on_disk = [s for s in complete_steps_on_disk(cluster.checkpoints, job.model.n_layers + 2) if s > 0]
    losses = evaluate(job, cluster.checkpoints, on_disk)
    writer = plan.groups[0].name if plan is not None and plan.mode == "outer" and plan.groups else \
        next(iter(sorted(nodes_in)))
    curve = []
    completed = region_step_times(reports, region_of).get(writer, {})
    for s in on_disk:
        # when the writer completed the checkpoint's step, found by its number: a writer group that trains fewer steps
        # than H a round completes only some numbers, and its n-th completed step is not step n (pairing by count
        # kept only the checkpoints up to step ~len(steps), and reported one a tenth of the way in as the final one)
        if s - 1 not in completed:
            continue
        t = completed[s - 1] - t0
        curve.append((s, t, tokens_by(steps, t, tokens_per_step), losses[s]))
    waited, rounds, exchange = group_totals(state_db)
    name_of = {v: k for k, v in region_of.items()}
    node_name = {nid: next((h.name for h in hosts if (out / h.name / "node_id").is_file()
                            and (out / h.name / "node_id").read_text().strip() == nid), nid) for nid in name_of}
    went_back: dict[str, list[tuple[int, int]]] = {}
    by_node: dict[str, list] = {}
    for r in sorted(reports, key=lambda r: r.unix_time):
        by_node.setdefault(r.node_id, []).append(r.step)
    for nid, seq in by_node.items():
        back = steps_went_back(seq)
        if back:
            went_back[node_name.get(nid, nid)] = back
    for n, text in node_logs.items():
        loaded = re.findall(r"loaded layers \[\d+, \d+\) from the checkpoint", text)
        if loaded:
            went_back.setdefault(n, []).append((-1, len(loaded)))
    final = watch.status
    result = RunResult(name=name, plan=_describe(plan), wall_s=wall, tokens=tokens, tokens_per_step=tokens_per_step,
                       step_times=steps, curve=curve,
                       wan_bytes=(sum(end_bytes.values()) - sum(first_bytes.values())) if wan and first_bytes else None,
                       exchange_bytes=exchange,
                       waited=waited, rounds=rounds, mismatches_logged=count_mismatch_lines(coordinator_log),
                       mismatches_status=final.anchor_mismatches if final is not None else 0, checkpoints=on_disk,
                       final_checkpoint=final.final_checkpoint_step if final is not None else 0,
                       last_checkpoint=final.last_checkpoint_step if final is not None else 0,
                       interval=job.checkpoint.interval, went_back=went_back,
                       faults=fault_run.done if fault_run is not None else [], finished=finished)
    if plan is not None and plan.mode == "outer" and plan.groups:
        # a round's wall time: each group's inner steps a round (live, as the coordinator counted them; else the
        # plan's) x its median step time, the longest
        live = {g.name: g.steps_per_round for g in (final.group_usage if final is not None else [])}
        result.round_s = max((live.get(g.name) or g.inner_steps) * result.median_step_s(g.name) for g in plan.groups)
    return result


def judge_faults(result: RunResult, killed: str) -> None:
    """Each fault's stall: the longest any group went without a step after it, up to the next fault. Counted from the
    coordinator's return for its restart (nothing can be decided while it is down), from the cut for the link, and
    for the killed region from its restart (the others from the kill)."""
    for k, f in enumerate(result.faults):
        until = result.faults[k + 1].start if k + 1 < len(result.faults) else None
        worst = 0.0
        for region, times in result.step_times.items():
            start = f.end if f.kind == "coordinator" or (f.kind == "region" and region == killed) else f.start
            if times and times[-1] > start:
                worst = max(worst, longest_gap_after(times, start, until))
            elif f.kind == "region" and region == killed:  # never stepped again: stalled to the run's end
                worst = max(worst, result.wall_s - start)
                f.note = f"{killed} never stepped after its restart"
        f.stall_s = worst


# --- one scenario ------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    scenario: Scenario
    alone: dict[str, RunResult]
    best: str
    outer: dict[str, RunResult]
    """Codec (or "faults") -> the outer run."""
    ideal: Ideal | None = None
    ideal_curve: list[tuple[int, float]] = field(default_factory=list)
    ideal_tokens_per_step: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    """Outer runs that failed (the same keys) -> why."""


def _alone(tb, sc: Scenario, args, base_out: Path, say) -> tuple[dict[str, RunResult], str]:
    """Every region alone, side by side; the first done is the best, the others stop once it is done."""
    results: dict[str, RunResult] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def one(region: str) -> None:
        hosts = tb.in_region(region)
        folder = base_out / f"alone-{region}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        job = _job(args.job, folder, f"{sc.key}-{region}", steps=args.steps, mode="sync", nodes=len(hosts),
                   inner=args.inner_steps, codec="int8", deadline=args.deadline)
        try:
            results[region] = run(tb, f"{region} alone", job, hosts, folder / "run", args.timeout, stop=stop,
                                  done=stop, wan=False, say=lambda m: say(f"{region} alone: {m}"))
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            stop.set()
        finally:
            shutil.rmtree(folder / "run" / "checkpoints", ignore_errors=True)

    threads = [threading.Thread(target=one, args=(r,), name=f"alone-{r}", daemon=True) for r in sc.regions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    best = max(results, key=lambda r: results[r].tokens_per_s)
    for r, res in results.items():
        say(f"{r} alone: {res.plan}; {res.tokens_per_s:,.0f} tokens/s over {res.wall_s:.1f}s "
            f"({len(res.step_times.get(r, []))} steps)")
    return results, best


def _outer(tb, sc: Scenario, args, base_out: Path, say, *, codec: str, faults: dict | None = None) -> RunResult:
    key = f"outer-{codec}" + ("-faults" if faults else "")
    folder = base_out / key
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = _job(args.job, folder, f"{sc.key}-{key}", steps=args.steps, mode="outer", nodes=len(tb.hosts),
               inner=args.inner_steps, codec=codec, deadline=args.deadline, apply_after=args.apply_after)
    t = time.monotonic()
    label = f"outer, {codec}" + (", faults" if faults else "")
    r = run(tb, label, job, tb.hosts, folder / "run", args.timeout, faults=faults, say=lambda m: say(f"{label}: {m}"))
    shutil.rmtree(folder / "run" / "checkpoints", ignore_errors=True)
    say(f"{label}: {r.plan}; {r.wall_s:.1f}s of training ({time.monotonic() - t:.0f}s with start-up and evaluation)"
        + ("" if r.finished else "; DID NOT FINISH"))
    return r


def run_scenario(tb, sc: Scenario, args, *, codecs: Sequence[str], with_faults: bool, say) -> Outcome:
    base_out = args.out / sc.key
    alone, best = _alone(tb, sc, args, base_out, say)
    outcome = Outcome(scenario=sc, alone=alone, best=best, outer={})
    runs = [(codec, codec, None) for codec in codecs]
    if with_faults:
        runs.append(("faults", "int8", {"outage": args.outage, "cut": args.cut, "down": args.down}))
    for key, codec, faults in runs:
        try:  # a run that fails is reported as such, and the others still run
            outcome.outer[key] = _outer(tb, sc, args, base_out, say, codec=codec, faults=faults)
        except Exception as e:  # noqa: BLE001
            outcome.failed[key] = str(e)
            say(f"outer, {codec}{', faults' if faults else ''}: FAILED: {e}")
    if "faults" in outcome.outer:
        judge_faults(outcome.outer["faults"], KILLED)
    return outcome


def add_ideal(outcome: Outcome, args, base_out: Path, say) -> None:
    from atoll.job import JobSpec

    base = JobSpec.load(args.job)
    rates = {r: res.tokens_per_s for r, res in outcome.alone.items()}
    rows = ideal_rows(base.train.global_batch, rates, outcome.best)
    base_out.mkdir(parents=True, exist_ok=True)
    job = _job(args.job, base_out, f"{outcome.scenario.key}-ideal", steps=args.steps, mode="sync", nodes=1,
               inner=args.inner_steps, codec="int8", deadline=args.deadline, rows=rows)
    best = outcome.alone[outcome.best]
    t = time.monotonic()
    # one torch thread (a second one spins against a busy machine's other processes); in (a) it covers the outer
    # run's tokens, for the comparison at equal tokens
    curve = ideal_curve(job, every=max(1, args.inner_steps // 2), target=best.final_loss,
                        min_tokens=max((r.tokens for r in outcome.outer.values()), default=0)
                        if outcome.scenario.key == "a" else 0)
    say(f"ideal: {rows} rows a step, {curve[-1][0]} steps, {len(curve)} evaluations in {time.monotonic() - t:.0f}s")
    outcome.ideal_curve = curve
    outcome.ideal_tokens_per_step = rows * base.train.seq_len
    if best.final_loss is None:
        return
    outcome.ideal = ideal_figures(
        rows=rows, target=best.final_loss, best_steps=[c[0] for c in best.curve],
        best_losses=[c[3] for c in best.curve], best_times=[c[1] for c in best.curve],
        best_step_s=best.step_s(outcome.best), ideal_steps=[s for s, _ in curve], ideal_losses=[v for _, v in curve])


# --- report ------------------------------------------------------------------------------------------------

def _s(x: float | None, fmt: str = "{:.1f}s") -> str:
    return fmt.format(x) if x is not None else "never"


def report(outcome: Outcome, b_outer: RunResult | None) -> list[tuple[str, bool]]:
    """Print the scenario's table and figures; return its target lines."""
    sc, best, ideal = outcome.scenario, outcome.best, outcome.ideal
    alone = outcome.alone
    target = ideal.target if ideal is not None else None
    total_alone = sum(r.tokens_per_s for r in alone.values())
    print(f"\n== {sc.title}: {sc.describe()}")
    print(f"{'run':<26}{'tokens/s':>10}{'x best':>8}{'x sum':>7}{'WAN B/tok':>11}{'sync B/tok':>11}{'eval loss':>11}"
          f"{'to best loss':>14}{'wall s':>8}{'tokens':>10}")
    rows = [(f"{r} alone" + (" (best)" if r == best else ""), res) for r, res in alone.items()]
    rows += [(res.name, res) for res in outcome.outer.values()]
    for label, res in rows:
        t = res.time_to(target) if target is not None else None
        wan = f"{res.wan_bytes / res.tokens:,.1f}" if res.wan_bytes is not None and res.tokens else "-"
        sync = f"{res.exchange_bytes / res.tokens:,.1f}" if res.exchange_bytes is not None and res.tokens else "-"
        final = f"{res.final_loss:.4f}" if res.final_loss is not None else "-"
        print(f"{label:<26}{res.tokens_per_s:>10,.0f}{res.tokens_per_s / alone[best].tokens_per_s:>8.2f}"
              f"{res.tokens_per_s / total_alone:>7.2f}{wan:>11}{sync:>11}{final:>11}{_s(t):>14}{res.wall_s:>8.1f}"
              f"{res.tokens:>10,}")
    if ideal is not None:
        print(f"ideal: one process at {ideal.rows} rows a step (the regions' batch together), target {ideal.target:.4f} "
              f"(the best region's final eval loss): S_ideal {_s(ideal.s_ideal, '{:.0f}')} steps, S_1 "
              f"{_s(ideal.s_1, '{:.0f}')}, T_ideal {_s(ideal.t_ideal)} (S_ideal x {alone[best].step_s(best):.3f}s), "
              f"T_1 {_s(ideal.t_1)}")
    for key, res in outcome.outer.items():
        print(f"{res.name}:")
        waited = ", ".join(f"{g} {w:.1f}s ({w / res.wall_s:.0%} of the wall time, {res.rounds.get(g, 0)} rounds in)"
                           for g, w in sorted(res.waited.items())) or "no rounds reported"
        print(f"  waited on the exchange: {waited}")
        print(f"  anchor hashes: {res.mismatches_logged} mismatches logged by the coordinator over its lifetimes, "
              f"{res.mismatches_status} in its status"
              + (" (agreed at every round)" if res.mismatches_logged == 0 and res.mismatches_status == 0 else ""))
        missing = missing_checkpoints(res.checkpoints, res.interval, res.final_checkpoint) if res.final_checkpoint \
            else []
        print(f"  checkpoints: {describe_steps(res.checkpoints)}; final step-{res.final_checkpoint}, newest held "
              f"step-{res.last_checkpoint}" + (f"; missing {missing}" if missing else ""))
        if res.went_back:
            print("  steps went back: " + "; ".join(f"{n} {v[:3]}" for n, v in sorted(res.went_back.items())))
        for f in res.faults:
            print(f"  fault {f.kind}: {f.start:.1f}s to {f.end:.1f}s; longest without a step after it {f.stall_s:.1f}s "
                  f"(bound: lease {LEASE_S:.0f}s + a round {res.round_s:.1f}s)" + (f"; {f.note}" if f.note else ""))
    p = f"({sc.key})"
    lines: list[tuple[str, bool]] = [(f"{p} the outer run{' with ' + key if key != 'faults' else ''} ran: it failed: "
                                      f"{why}", False) for key, why in outcome.failed.items()]
    if ideal is None:
        return lines + [(f"{p} targets: the best region has no eval loss", False)]
    if sc.key == "a":
        res = outcome.outer.get("int8")
        if res is None:
            return lines
        speed = res.tokens_per_s / alone[best].tokens_per_s
        lines.append((f"{p} tokens/s >= 1.8x one region: {speed:.2f}x", speed >= 1.8))
        common = min(res.curve[-1][2], outcome.ideal_curve[-1][0] * outcome.ideal_tokens_per_step) if res.curve else 0
        l_out = interpolate([c[2] for c in res.curve], [c[3] for c in res.curve], common) if res.curve else None
        l_ideal = interpolate([s * outcome.ideal_tokens_per_step for s, _ in outcome.ideal_curve],
                              [v for _, v in outcome.ideal_curve], common)
        gap = (l_out - l_ideal) / l_ideal if l_out is not None and l_ideal is not None else None
        lines.append((f"{p} eval loss at equal tokens within 5% of synchronous (the ideal run): at {common:,} tokens "
                      + (f"{l_out:.4f} vs {l_ideal:.4f} ({gap:+.1%})" if gap is not None else "no common point"),
                      gap is not None and gap <= 0.05))
        lines += loss_targets(p, res.time_to(ideal.target), ideal)
    elif sc.key == "b":
        res = outcome.outer.get("int8")
        if res is not None:
            share = res.tokens_per_s / total_alone
            lines.append((f"{p} tokens/s >= 0.85x the sum of the regions alone: {share:.2f}x", share >= 0.85))
            lines += loss_targets(p, res.time_to(ideal.target), ideal)
            worst = max(res.waited.items(), key=lambda kv: kv[1], default=("-", 0.0))
            lines.append((f"{p} no group waits more than 10% of the wall time: most {worst[0]} {worst[1]:.1f}s of "
                          f"{res.wall_s:.1f}s ({worst[1] / res.wall_s:.0%})", worst[1] <= 0.1 * res.wall_s))
        sparse = outcome.outer.get("sparse2")
        if res is not None and sparse is not None and res.exchange_bytes and sparse.exchange_bytes is not None:
            # the outer sync's own bytes (the codec's doing): the veth counters add the coordinator's traffic with
            # the regions (heartbeats, step reports, status), the same whatever the codec, which on the tiny
            # model outweighs a sparse round; printed beside it
            a, b = res.exchange_bytes / res.tokens, sparse.exchange_bytes / sparse.tokens
            ratio = a / b if b > 0 else float("inf")
            veth = (f"; all WAN traffic {res.wan_bytes / res.tokens:,.1f} vs {sparse.wan_bytes / sparse.tokens:,.1f} "
                    f"= {res.wan_bytes / res.tokens / max(sparse.wan_bytes / sparse.tokens, 1e-9):.1f}x"
                    if res.wan_bytes and sparse.wan_bytes else "")
            lines.append((f"sparse2 >= 8x fewer outer-sync bytes per token than int8 at the same H: {a:,.1f} vs "
                          f"{b:,.1f} = {ratio:.1f}x{veth}", ratio >= 8))
            lines += loss_targets("sparse2 (b)", sparse.time_to(ideal.target), ideal)
    else:
        res = outcome.outer.get("faults")
        if res is None:
            return lines
        t_c = res.time_to(ideal.target)
        t_b = b_outer.time_to(ideal.target) if b_outer is not None else None
        if b_outer is None:
            lines.append((f"{p} T_outer <= 1.1x (b)'s: (b) was not run", False))
        else:
            lines.append((f"{p} T_outer <= 1.1x (b)'s: {_s(t_c)} vs {_s(t_b)}",
                          t_c is not None and t_b is not None and t_c <= 1.1 * t_b))
        lines.append((f"{p} every group's anchor identical at every round: {res.mismatches_logged} mismatches logged, "
                      f"{res.mismatches_status} in the status", res.mismatches_logged == 0 and res.mismatches_status == 0))
        killed_nodes = {h for h in res.went_back if h.startswith(KILLED)}
        others = sorted(set(res.went_back) - killed_nodes)
        lines.append((f"{p} no rollback except of the killed region's own steps: "
                      + (f"{', '.join(others)} went back" if others else "none"), not others))
        missing = missing_checkpoints(res.checkpoints, res.interval, res.final_checkpoint) if res.final_checkpoint \
            else None
        lines.append((f"{p} a checkpoint at every interval through the last step: "
                      + ("no final checkpoint named" if missing is None else
                         f"missing {missing}" if missing else f"all {res.final_checkpoint // res.interval} through "
                                                              f"step-{res.final_checkpoint}"),
                      missing == [] and res.last_checkpoint == res.final_checkpoint))
        bound = LEASE_S + res.round_s
        made = {f.kind for f in res.faults}
        worst = max((f.stall_s for f in res.faults), default=0.0)
        lines.append((f"{p} no stall longer than a lease plus one round after any fault: the longest {worst:.1f}s, "
                      f"bound {bound:.1f}s" + ("" if len(made) == 3 else f" (only {sorted(made)} made)"),
                      len(made) == 3 and worst <= bound))
    return lines


def picture(outcomes: Sequence[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(outcomes), 2, figsize=(11, 3.8 * len(outcomes)), squeeze=False)
    for row, o in zip(axes, outcomes):
        a, b = row
        for r, res in o.alone.items():
            if res.curve:
                a.plot([c[2] for c in res.curve], [c[3] for c in res.curve], marker=".", ms=3, label=f"{r} alone")
                b.plot([c[1] for c in res.curve], [c[3] for c in res.curve], marker=".", ms=3, label=f"{r} alone")
        for res in o.outer.values():
            a.plot([c[2] for c in res.curve], [c[3] for c in res.curve], marker="o", ms=3, label=res.name)
            b.plot([c[1] for c in res.curve], [c[3] for c in res.curve], marker="o", ms=3, label=res.name)
            for f in res.faults:
                b.axvspan(f.start, f.end, color="red", alpha=0.08)
        if o.ideal_curve:
            step_s = o.alone[o.best].step_s(o.best)
            a.plot([s * o.ideal_tokens_per_step for s, _ in o.ideal_curve], [v for _, v in o.ideal_curve], "k--",
                   lw=1, label="ideal")
            b.plot([s * step_s for s, _ in o.ideal_curve], [v for _, v in o.ideal_curve], "k--", lw=1,
                   label="ideal (steps x best step)")
        if o.ideal is not None:
            for ax in (a, b):
                ax.axhline(o.ideal.target, color="grey", lw=0.8, ls=":")
        a.set_xlabel("tokens trained (all groups)")
        b.set_xlabel("wall time since the first step (s)")
        for ax in (a, b):
            ax.set_ylabel("eval loss")
            ax.set_title(o.scenario.title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".loss-", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # leave the testbed's block, which kills its processes and removes it


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=REPO / "examples" / "regions.toml")
    ap.add_argument("--only", default="", help="scenarios to run, e.g. a,c (default: a,b,c); (c) judges its time "
                                               "against (b)'s only when (b) runs too")
    ap.add_argument("--quick", action="store_true",
                    help="a shorter run: 240 steps, a 5 s coordinator outage, a 15 s link cut, the region down 5 s")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 600; --quick 240)")
    ap.add_argument("--inner-steps", type=int, default=10,
                    help="H of the fastest group (also the checkpoint interval and the ideal's evaluation cadence x 2)")
    ap.add_argument("--no-sparse", action="store_true", help="skip (b)'s sparse2 run")
    ap.add_argument("--deadline", type=float, default=0.0, help="outer.deadline_seconds (0: the job's default)")
    ap.add_argument("--apply-after", type=int, default=0, help="outer.apply_after (0: chosen from the plan)")
    ap.add_argument("--outage", type=float, default=None, help="(c): seconds the coordinator is down (default 10)")
    ap.add_argument("--cut", type=float, default=None, help="(c): seconds the link is cut (default 30)")
    ap.add_argument("--down", type=float, default=None, help="(c): seconds the region is down (default 10)")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound of each run, seconds")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench-regions")
    args = ap.parse_args()
    try:
        only = parse_only(args.only)
    except ValueError as e:
        ap.error(str(e))
    args.steps = args.steps or (240 if args.quick else 600)
    args.outage = args.outage if args.outage is not None else (5.0 if args.quick else 10.0)
    args.cut = args.cut if args.cut is not None else (15.0 if args.quick else 30.0)
    args.down = args.down if args.down is not None else (5.0 if args.quick else 10.0)

    sys.path.insert(0, str(REPO))
    from bench.geo import geo_testbed, geo_unavailable

    reason = geo_unavailable()
    if reason:
        print(f"regions benchmark skipped: {reason}")
        return 0
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    import torch

    torch.set_num_threads(1)
    from atoll.job import JobSpec
    from atoll.node.model import build_slice

    base = JobSpec.load(args.job)
    params = sum(p.numel() for p in build_slice(base.model, 0, base.model.n_layers + 2).parameters())
    started = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {msg}", flush=True)

    print(f"regions benchmark: job {args.job.name} (model {base.model.name}, {params:,} parameters), {args.steps} "
          f"steps a run, H={args.inner_steps}, global batch {base.train.global_batch} x {base.train.seq_len}; "
          f"scenarios {', '.join(only)}{' (quick)' if args.quick else ''}", flush=True)
    outcomes: list[Outcome] = []
    targets: list[tuple[str, bool]] = []
    b_outer = None
    for sc in (SCENARIO_A, SCENARIO_B):
        keys = [k for k in only if k == sc.key or (sc.key == "b" and k == "c")]
        if not keys:
            continue
        say(f"{sc.title if 'b' in keys or sc.key == 'a' else SCENARIO_C.title}: {sc.describe()}")
        with geo_testbed(regions=sc.regions, wan_bits_per_s=sc.rate, wan_rates=sc.rates,
                         wan_latency_ms=sc.latency_ms, cpu_quota=sc.quotas) as tb:
            codecs = ["int8"] + (["sparse2"] if sc.key == "b" and "b" in keys and not args.no_sparse else [])
            if sc.key == "b" and "b" not in keys:
                codecs = []
            o = run_scenario(tb, sc, args, codecs=codecs, with_faults="c" in keys and sc.key == "b", say=say)
        add_ideal(o, args, args.out / sc.key, say)
        done = [o]
        if sc.key == "b" and "c" in keys:  # (c) is (b)'s testbed and alone runs with faults in the outer run
            c = Outcome(scenario=SCENARIO_C, alone=o.alone, best=o.best, outer={}, ideal=o.ideal,
                        ideal_curve=o.ideal_curve, ideal_tokens_per_step=o.ideal_tokens_per_step)
            if "faults" in o.outer:
                c.outer["faults"] = o.outer.pop("faults")
            if "faults" in o.failed:
                c.failed["faults"] = o.failed.pop("faults")
            done = ([o] if "b" in keys else []) + [c]
        for d in done:  # each scenario's table as soon as it is measured
            if d.scenario.key == "b":
                b_outer = d.outer.get("int8")
            targets += report(d, b_outer)
        outcomes += done
    png = args.out / "loss.png"
    picture(outcomes, png)
    print(f"\nwrote {png}; total time {time.monotonic() - started:.0f}s")
    for text, ok in targets:
        print(f"  [{'ok' if ok else 'MISSED'}] {text}")
    met = sum(ok for _, ok in targets)
    print(f"targets met: {met}/{len(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
