"""The plan: which island runs which layers, in which pipeline, with which codec on each link.

A `Plan` is what the planner returns, what the coordinator publishes (as the `atoll.v1.Plan` message)
and what `atoll plan --json` writes. Its JSON shape:

    {"model": str, "global_batch": int, "seq_len": int,
     "predicted": {"step_time_s": float, "tokens_per_s": float, "mfu": float, "bottleneck": str},
     "islands": [{"id": str, "group": str, "device": str, "nodes": [str], "gpus": int}],
     "pipelines": [{"micro_batch": int, "num_micro_batches": int,
       "stages": [{"island": str, "layers": [first, last_exclusive], "dp": int, "tp": int, "zero": int,
                   "recompute": bool, "recompute_layers": [int], "compute_s": float, "memory_gb_per_device": float,
                   "in_flight": int, "defer_weights": int, "defer_layers": [int], "lanes": int,
                   "send": {"codec": str, "bytes": int, "seconds": float} | null}]}]}

plus the runtime fields `epoch`, `job_id`, `resume_step`, `node_addresses`, `rendezvous`, and per stage
`nodes` and `dp_rendezvous`.

A stage runs on dp x tp devices: `dp` data-parallel replicas of `tp` tensor-parallel devices each (one node's
GPUs; `nodes[r * tp + k]` is tp rank k of replica r). Its replicas share each pipeline micro-batch as evenly
as possible: replica r takes micro_batch // dp sequences, one more when r < micro_batch % dp.

Lanes (`lanes` = L > 1): the stage's replicas form L lanes of dp / L replicas each (in lane order: replica r is
in lane r // (dp / L)), and pipeline micro-batch i is trained at that stage by lane i % L alone, whose replicas
share its rows as above. A stage with more replicas than a micro-batch has rows can so still take part, each
lane working on every L-th micro-batch while the others work on theirs (PipeDream's replicated stages). The
pipeline's micro-batch count must be a multiple of L, and a laned stage and those before it open more forwards
before their first backward (`PipelinePlan.warmup_extra`), so that every lane has work.

`"idle": [{"island": str, "nodes": [str], "gpus": int, "reason": str}]` lists the devices the plan leaves
out, each group with the reason (slower than it helps, would not fit, link too slow).

A plan across regions may train in *outer* mode (`"mode": "outer"`): its pipelines are split into replica
groups (`"groups": [{"name", "pipelines": [indices], "inner_steps", ...}]`), each a whole model replica whose
pipelines share the global batch as a synchronous plan's do; every round the groups exchange compressed
pseudo-gradients as `"outer"` says (codec, H, outer lr and momentum, overlap, predicted sync time).
Layers count the embedding as layer 0 and the head as the last.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from atoll.fsutil import atomic_write_text

GB = 1e9


LIVE_FETCH_FAILED = "no live holder could give"
"""How a node's report of a run that failed because the live state its plan agreed to resume from could not be
fetched begins (`PlanRunner._fetch_live`); the coordinator counts such failures (`membership.live_resume`)."""


def resume_words(resume_step: int, reached_step: int, live: bool = True) -> str:
    """Where a plan's nodes start, for a person: the checkpoint step, and where the job had reached beyond it the
    live state that nodes keep instead (a graceful leave or a replan keeps the steps since the checkpoint).
    `live`: False where the plan resumes from the checkpoint whatever the nodes hold (`Plan.live_resume`)."""
    if reached_step > resume_step and not live:
        return (f"resume at step {resume_step} (the newest checkpoint; the plans before could not fetch the live "
                f"state of step {reached_step})")
    if reached_step > resume_step:
        return (f"resume at step {reached_step} from live state where the nodes hold it, else at step {resume_step} "
                f"(the newest checkpoint)")
    return f"resume at step {resume_step}"


def shares(micro_batch: int, dp: int) -> list[tuple[int, int]]:
    """Rows [first, last) of a micro-batch of `micro_batch` rows for each of `dp` replicas: consecutive, as
    even as possible (the first `micro_batch % dp` replicas take one row more): how a stage's replicas share each micro-batch of its pipeline."""
    if dp < 1 or micro_batch < dp:
        raise ValueError(f"{dp} replicas cannot share a micro-batch of {micro_batch} rows")
    base, extra = divmod(micro_batch, dp)
    out, row = [], 0
    for r in range(dp):
        n = base + (1 if r < extra else 0)
        out.append((row, row + n))
        row += n
    return out


def lane_warmups(lanes: list[int]) -> list[int]:
    """Warm-up forwards of each stage of a pipeline whose stages have `lanes` lanes (before any deep window).

    A stage holds in flight, besides its own, what its downstream works on: one micro-batch per lane of every
    later stage (D = their lanes summed; strict 1F1B's p - s - 1 without lanes). A stage of L lanes shares its
    window among its lanes, so it opens L (ceil(D / L) + 1) - 1 forwards before its first backward (every lane
    then has ceil(D / L) in flight beyond its own); and never fewer than one more than the next stage, as 1F1B's
    warm-ups go (the deadlock-freedom condition, `atoll.node.schedule`)."""
    out = [0] * len(lanes)
    need, after = -1, 0  # the next stage's warm-up, the lanes of the stages after this one
    for s in range(len(lanes) - 1, -1, -1):
        need = out[s] = lane_warmup(lanes[s], after, need)
        after += lanes[s]
    return out


def lane_warmup(lanes: int, after: int, next_warmup: int) -> int:
    """One step of `lane_warmups`, from the last stage back: the warm-up forwards of a stage of `lanes` lanes
    with `after` lanes in the stages after it, the next of which opens `next_warmup` (-1 for the last stage)."""
    return max(lanes * (-(-after // lanes) + 1) - 1, next_warmup + 1)


def lane_in_flight(warmup: int, lanes: int, micro_batches: int) -> int:
    """Micro-batches a lane of a stage that opens `warmup` forwards holds at once: its share of them and the one
    it works on, at most its share of the step's `micro_batches` (strict 1F1B's min(p - s, m) without lanes)."""
    return min(warmup // lanes + 1, -(-micro_batches // lanes))


@dataclass(kw_only=True)
class SendPlan:
    """The link from a stage to the next: codec of the activations and the predicted transfer."""

    codec: str = "identity"
    """Codec name: identity, fp16, bf16, int8, int4, topk."""
    bytes: int = 0
    """Bytes of one micro-batch's activation before encoding."""
    seconds: float = 0.0
    """Predicted transfer time of one micro-batch under the codec."""
    block_size: int = 0
    topk_fraction: float = 0.0
    zstd_level: int = 0
    backward_seconds: float = 0.0
    """Predicted transfer time of one micro-batch's activation-gradient back (0: as `seconds`)."""
    latency_s: float = 0.0
    """Of each transfer, the one-way latency the planner counted."""


@dataclass(frozen=True, kw_only=True)
class StageTiming:
    """What the planner's 1F1B simulation took for a stage (`atoll.coordinator.planner.simulator.StageTimes`), so
    a plan received over the wire can be simulated and drawn as the planner predicted it: per micro-batch the
    forward and backward, per step the gradient all-reduce (of it, what overlaps the last backward) and the
    optimizer step, and of the backward the deferrable weight-gradient products and the split's extra cost."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    sync_s: float = 0.0
    sync_hidden_s: float = 0.0
    optimizer_s: float = 0.0
    weight_s: float = 0.0
    split_s: float = 0.0


@dataclass(kw_only=True)
class StagePlan:
    island: str
    layers: tuple[int, int]
    dp: int = 1
    tp: int = 1
    zero: int = 0
    """ZeRO stage over the stage's data-parallel replicas: 1 shards the optimizer states, 2 also the gradients."""
    recompute: bool = False
    """Recompute every block of the stage in backward (`recompute_layers` names some of them instead)."""
    recompute_layers: list[int] = field(default_factory=list)
    """Global indices of the blocks whose activations are recomputed in backward (empty: as `recompute` says)."""
    compute_s: float = 0.0
    """Predicted forward+backward time of one micro-batch."""
    memory_gb_per_device: float = 0.0
    send: SendPlan | None = None
    nodes: list[str] = field(default_factory=list)
    """Node ids of the data-parallel replicas, in rank order (empty when planned from a cluster file)."""
    lanes: int = 1
    """Lanes the stage's `dp` replicas form (module docstring): micro-batch i is trained by lane i % lanes."""
    dp_rendezvous: str = ""
    """torch.distributed init address (tcp://HOST:PORT) of this stage's replicas."""
    in_flight: int = 0
    """Extra micro-batches this stage keeps in flight beyond strict 1F1B (that many more warm-up forwards): a
    deep window, so a slow or distant link downstream does not stall it, or the wait for the first gradient
    filled with forwards where memory holds them; never more than one above the previous stage's
    (`Plan.validate`)."""
    defer_weights: int = 0
    """Zero-bubble: backward computes the input's gradient first, and the weight gradients of the stage's linear
    layers wait this many micro-batches for an action of their own (`atoll.node.schedule`); 0: computed in
    backward, as 1F1B does."""
    defer_layers: list[int] = field(default_factory=list)
    """With `defer_weights`, the global indices of the layers whose weight gradients wait (the others compute
    theirs in backward: what memory allows); empty: every layer of the stage."""
    timing: StageTiming | None = None
    """The planner's simulated times of the stage (None: a plan made without the planner, the fallback's)."""

    def __post_init__(self) -> None:
        a, b = self.layers
        if not 0 <= a < b:
            raise ValueError(f"stage layers must be [first, last_exclusive) with first < last, got {self.layers}")
        self.layers = (int(a), int(b))
        if self.in_flight < 0:
            raise ValueError(f"stage in_flight (extra micro-batches in flight) must be >= 0, got {self.in_flight}")
        if self.defer_weights < 0:
            raise ValueError(f"stage defer_weights (micro-batches whose weight gradients wait) must be >= 0, got "
                             f"{self.defer_weights}")
        if self.lanes < 1 or self.dp % self.lanes:
            raise ValueError(f"stage lanes must be >= 1 and divide dp (each lane holds dp / lanes replicas), got "
                             f"{self.lanes} lanes of dp {self.dp}")
        outside = [i for i in self.recompute_layers if not a <= i < b]
        if outside:
            raise ValueError(f"recompute_layers {outside} are outside the stage's layers [{a}, {b})")
        self.recompute_layers = sorted({int(i) for i in self.recompute_layers})
        outside = [i for i in self.defer_layers if not a <= i < b]
        if outside:
            raise ValueError(f"defer_layers {outside} are outside the stage's layers [{a}, {b})")
        if self.defer_layers and not self.defer_weights:
            raise ValueError(f"defer_layers {self.defer_layers} name layers whose weight gradients wait, but "
                             "defer_weights is 0 (nothing waits): set defer_weights or leave defer_layers empty")
        self.defer_layers = sorted({int(i) for i in self.defer_layers})

    def recomputed(self, num_layers: int) -> list[int]:
        """The blocks this stage recomputes: `recompute_layers`, or every block of it when `recompute` is set
        (the embedding, layer 0, and the head, layer num_layers - 1, are never recomputed)."""
        if self.recompute_layers:
            return list(self.recompute_layers)
        if not self.recompute:
            return []
        return [i for i in range(*self.layers) if 0 < i < num_layers - 1]


@dataclass(kw_only=True)
class PipelinePlan:
    micro_batch: int
    num_micro_batches: int
    stages: list[StagePlan]

    def warmup_extra(self, stage: int) -> int:
        """Micro-batches stage `stage` keeps in flight beyond strict 1F1B: its own `in_flight` plus what lanes ask
        (`lane_warmups`)."""
        p = len(self.stages)
        return lane_warmups([st.lanes for st in self.stages])[stage] - (p - stage - 1) + self.stages[stage].in_flight


@dataclass(kw_only=True)
class Prediction:
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bottleneck: str = ""


@dataclass(kw_only=True)
class IslandInfo:
    id: str
    group: str = ""
    device: str = ""
    nodes: list[str] = field(default_factory=list)
    gpus: int = 0
    inner_bandwidth: float = 0.0
    """Slowest link inside the island, bytes/s (0: unknown)."""
    outer_bandwidth: float = 0.0
    """Fastest link leaving the island, bytes/s (0: none)."""


@dataclass(kw_only=True)
class ReplicaGroup:
    """A whole model replica trained apart from the others (normally one region), synced every round."""

    name: str
    """Readable name: the region it runs in."""
    pipelines: list[int]
    """Indices into `Plan.pipelines`; together they train the global batch every inner step."""
    inner_steps: int = 1
    """Inner steps this group trains per outer round (a slower group trains fewer, so rounds take about the
    same wall time everywhere; the average weights each group by the tokens it trained)."""
    step_time_s: float = 0.0
    """Predicted time of one inner step."""
    tokens_per_s: float = 0.0
    """Predicted tokens per second of the group."""
    since_epoch: int = 0
    """Plan epoch from which this group has run as it is: a replan that keeps it leaves it running (its
    process groups and transfers are named by this epoch, not the plan's)."""
    round: int = 0
    """Outer round the group starts at (live plans: the newest round the coordinator has decided)."""


FETCH_BOUND_MIN_S = 30.0
"""The least time a node retries fetching a contribution to an outer round (`OuterPlan.fetch_bound_s`)."""


@dataclass(kw_only=True)
class OuterPlan:
    """How the replica groups sync: every round, pseudo-gradients through a codec, averaged by tokens."""

    inner_steps: int
    """H: inner steps per round of the fastest group."""
    codec: str = "int8"
    """Codec of the pseudo-gradients on the wide-area links (error feedback keeps what lossy codecs drop)."""
    topk_fraction: float = 0.0
    """Fraction of elements kept by the topk and sparse2 codecs (0: the codec's default)."""
    block_size: int = 0
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True
    overlap: bool = True
    """Round r's exchange runs while round r + 1 trains and is applied at its end (one round of delay)."""
    deadline_s: float = 30.0
    """How long a round waits for late groups after the first arrives; later groups are left out of it."""
    sync_s: float = 0.0
    """Predicted wall time of one round's exchange over the slowest wide-area link."""
    round_s: float = 0.0
    """Predicted compute time of one round (what the exchange hides behind)."""
    bytes_per_round: int = 0
    """Predicted wide-area bytes one group sends per round."""
    reason: str = ""
    """Why the planner chose outer mode and this H (against the synchronous plan)."""

    @property
    def fetch_bound_s(self) -> float:
        """How long a node retries fetching one contribution to a round from the nodes holding it before it reports
        it out of reach (the coordinator then decides the round again without it): the deadline, at least
        `FETCH_BOUND_MIN_S` (a round's payload over a slow link)."""
        return max(self.deadline_s, FETCH_BOUND_MIN_S)

    def end_step(self, target_steps: int) -> int:
        """The steps every group trains of a job of `target_steps`: whole rounds, (target // H) x H (at least one
        round), however many inner steps a group trains a round (a round's steps are numbered to end at a multiple of
        H: `atoll.node.outer.OuterSync.next_step`), so no group is left with a round to sync alone."""
        return max(1, target_steps // self.inner_steps) * self.inner_steps


@dataclass(kw_only=True)
class IdleDevices:
    """Devices of one island a plan leaves out, and why."""

    island: str
    gpus: int
    """How many of the island's devices are left out."""
    reason: str
    """Why: slower than it helps, would not fit, link too slow (with the figures that decided it)."""
    nodes: list[str] = field(default_factory=list)
    """Node ids of the devices left out (live plans; empty when planned from a cluster file)."""


@dataclass(kw_only=True)
class RelayRoute:
    """The link between two nodes that both accept no connections goes through `via`, a node that does
    (live plans): both open a Connect stream to it and it forwards their tensors."""

    a: str
    b: str
    via: str
    bandwidth_bytes_per_s: float = 0.0
    """The relayed link as the planner priced it: the slower of its two legs."""


@dataclass(kw_only=True)
class CheckpointCopy:
    """An alive node holding a copy of layers [a, b) of the resume step's checkpoint (live plans)."""

    node_id: str
    layers: tuple[int, int]
    address: str
    """HOST:PORT of its Peer server."""


@dataclass(kw_only=True)
class Plan:
    model: str
    global_batch: int
    seq_len: int
    predicted: Prediction = field(default_factory=Prediction)
    islands: list[IslandInfo] = field(default_factory=list)
    pipelines: list[PipelinePlan] = field(default_factory=list)
    epoch: int = 0
    job_id: str = ""
    resume_step: int = 0
    """Step the nodes start from: the last complete checkpoint (0: the seeded initialisation)."""
    reached_step: int = 0
    """Steps the job had trained when the plan was made (the newest reported + 1): what a resume from
    `resume_step`, or from live state older than it, rolls back from."""
    live_resume: bool = True
    """Whether the nodes may resume from live state (False: from the checkpoint of `resume_step`, because the
    plans before this one failed to fetch the live state they agreed on, `LIVE_FETCH_FAILED`)."""
    node_addresses: dict[str, str] = field(default_factory=dict)
    """Node id -> HOST:PORT of its Peer server (live plans)."""
    rendezvous: str = ""
    """HOST:PORT of the torch.distributed store the nodes of this epoch meet at (live plans)."""
    mode: str = "sync"
    """"sync": one synchronous step over every pipeline; "outer": replica groups with an outer sync."""
    mode_reason: str = ""
    """Where the plan's nodes span regions, why it trains in its mode (sync: why not replica groups; the planner's
    `PlanResult.note`); empty in one region."""
    groups: list[ReplicaGroup] = field(default_factory=list)
    """Outer mode: the replica groups (every pipeline in exactly one)."""
    outer: OuterPlan | None = None
    """Outer mode: how the groups sync."""
    idle: list[IdleDevices] = field(default_factory=list)
    """Devices no stage runs on, with the reason, per island."""
    checkpoint_copies: list[CheckpointCopy] = field(default_factory=list)
    """Alive nodes holding copies of the `resume_step` checkpoint, per layer range (checkpoint dirs are local)."""
    handover: dict[str, str] = field(default_factory=dict)
    """Node id -> HOST:PORT of nodes that left gracefully and serve their live state until it is taken."""
    relays: list[RelayRoute] = field(default_factory=list)
    """Links between two nodes that accept no connections (their `node_addresses` are empty), and who relays."""

    def relay_of(self, a: str, b: str) -> str | None:
        """The node relaying between `a` and `b`, if the plan names one."""
        for r in self.relays:
            if {r.a, r.b} == {a, b}:
                return r.via
        return None

    def region_of(self, node_id: str) -> str:
        """The region (site label) of a node in a live plan: its island's group; "" when not known."""
        for island in self.islands:
            if node_id in island.nodes:
                return island.group
        return ""

    def group_nodes(self, group: int) -> set[str]:
        """The nodes of replica group `group`: every node of its pipelines' stages."""
        return {n for p in self.groups[group].pipelines for st in self.pipelines[p].stages for n in st.nodes}

    def group_of(self, pipeline: int) -> int:
        """Index of the replica group that runs `pipeline` (0 in a synchronous plan)."""
        for g, group in enumerate(self.groups):
            if pipeline in group.pipelines:
                return g
        return 0

    def validate(self, num_layers: int | None = None) -> None:
        """Check that every pipeline covers the layers contiguously, once."""
        if not self.pipelines:
            raise ValueError("plan has no pipelines")
        for pi, p in enumerate(self.pipelines):
            if not p.stages:
                raise ValueError(f"pipeline {pi} has no stages")
            expect = 0
            for si, s in enumerate(p.stages):
                if s.layers[0] != expect:
                    raise ValueError(f"pipeline {pi} stage {si} starts at layer {s.layers[0]}, expected {expect}")
                expect = s.layers[1]
            for si in range(len(p.stages) - 1):
                a, b = p.warmup_extra(si), p.warmup_extra(si + 1)
                if b > a + 1:  # the downstream's warm-up would outgrow the upstream's
                    raise ValueError(f"pipeline {pi} stage {si + 1} keeps {b} extra micro-batches in flight but "
                                     f"stage {si} only {a}, which deadlocks 1F1B; a stage may keep at most one more "
                                     f"than the stage before it")
            for si, s in enumerate(p.stages):
                if p.num_micro_batches % s.lanes:
                    raise ValueError(f"pipeline {pi} stage {si} has {s.lanes} lanes, which must divide the pipeline's "
                                     f"{p.num_micro_batches} micro-batches (every lane trains as many)")
            if num_layers is not None and expect != num_layers:
                raise ValueError(f"pipeline {pi} ends at layer {expect}, the model has {num_layers}")
        if self.mode not in ("sync", "outer"):
            raise ValueError(f"plan mode must be sync or outer, got {self.mode!r}")
        if self.mode == "outer":
            if self.outer is None or not self.groups:
                raise ValueError("an outer-mode plan needs replica groups and outer settings")
            owned = sorted(p for g in self.groups for p in g.pipelines)
            if owned != list(range(len(self.pipelines))):
                raise ValueError(f"every pipeline must be in exactly one replica group; the groups hold {owned}")
            if any(g.inner_steps < 1 for g in self.groups):
                raise ValueError("every replica group needs inner_steps >= 1")

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p in d["pipelines"]:
            for s in p["stages"]:
                s["layers"] = list(s["layers"])
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "Plan":
        pipelines = []
        for p in d["pipelines"]:
            stages = []
            for s in p["stages"]:
                s = dict(s)
                send = s.pop("send", None)
                timing = s.pop("timing", None)
                stages.append(StagePlan(**{**s, "layers": tuple(s["layers"])},
                                        send=SendPlan(**send) if send else None,
                                        timing=StageTiming(**timing) if timing else None))
            pipelines.append(PipelinePlan(micro_batch=p["micro_batch"], num_micro_batches=p["num_micro_batches"],
                                          stages=stages))
        return cls(
            model=d["model"], global_batch=d["global_batch"], seq_len=d["seq_len"],
            predicted=Prediction(**d.get("predicted", {})),
            islands=[IslandInfo(**i) for i in d.get("islands", [])],
            pipelines=pipelines,
            epoch=d.get("epoch", 0), job_id=d.get("job_id", ""), resume_step=d.get("resume_step", 0),
            reached_step=d.get("reached_step", 0), live_resume=d.get("live_resume", True),
            node_addresses=dict(d.get("node_addresses", {})), rendezvous=d.get("rendezvous", ""),
            mode=d.get("mode", "sync"), mode_reason=d.get("mode_reason", ""), groups=[ReplicaGroup(**g) for g in d.get("groups", [])],
            outer=OuterPlan(**d["outer"]) if d.get("outer") else None,
            idle=[IdleDevices(**x) for x in d.get("idle", [])],
            checkpoint_copies=[CheckpointCopy(**{**c, "layers": tuple(c["layers"])})
                               for c in d.get("checkpoint_copies", [])],
            handover=dict(d.get("handover", {})),
            relays=[RelayRoute(**r) for r in d.get("relays", [])],
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_json_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_json_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), self.to_json() + "\n")
