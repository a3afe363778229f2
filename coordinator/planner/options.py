"""What a plan is for (`TrainSpec`) and how the planner searches (`PlannerOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.coordinator.planner.network import NOMINAL, PESSIMISTIC, NetworkModel
from atoll.modelspec import dtype_bytes

CODEC_ORDER = ("identity", "bf16", "fp16", "int8", "int4", "hadamard", "lowrank")
"""Activation codecs from the least to the most lossy."""
OUTER_MODES = ("auto", "sync", "outer")
OUTER_CODECS = ("auto", "identity", "fp16", "bf16", "int8", "int4", "topk", "sparse2")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The training job the plan serves."""

    global_batch: int
    """Sequences per optimizer step, over all pipelines and replicas."""
    seq_len: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """Training dtype of weights, activations and gradients: fp32, fp16 or bf16 (16-bit keeps fp32 masters)."""
    optimizer: str = "adamw"
    """adamw, adam or sgd (decides the optimizer state per parameter)."""

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1 sequence, got {self.global_batch}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 token, got {self.seq_len}")
        dtype_bytes(self.dtype)
        if self.optimizer not in ("adamw", "adam", "sgd"):
            raise ValueError(f"optimizer must be adamw, adam or sgd, got {self.optimizer!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Knobs of the cost model and the search."""

    achievable_fraction: float = 0.5
    """Fraction of a device's peak 16-bit tensor FLOPS a large matmul-bound layer reaches (the analytic
    estimate of bf16 and fp16 jobs; calibration in `catalog`)."""
    tf32_fraction: float = 0.25
    """Fraction of the peak TF32 tensor FLOPS a large layer of an fp32 job reaches on a device with TF32
    tensor cores (calibrated with `fp32_fraction` on the measured 3.1x of an A100 over a V100 in fp32)."""
    fp32_fraction: float = 0.8
    """Fraction of the peak fp32 (non-tensor) FLOPS a large layer of an fp32 job reaches on a device without
    TF32 tensor cores (V100, T4)."""
    half_efficiency_tokens: int = 256
    """Tokens per micro-batch at which a device reaches half of `achievable_fraction` (small batches are slow)."""
    half_efficiency_width: int = 128
    """Per-rank matrix width (d_model / tp) at which a kernel runs at half its large-matrix efficiency: tensor
    parallelism's narrower shards run at (w / (w + this)) / (d / (d + this)) of the unsharded layer's
    efficiency, w = d / tp (e.g. 0.92 for d = 4096 at tp 4)."""
    max_tp: int = 8
    """Largest tensor-parallel degree the island parallelizer may choose; tp also stays within a node's GPUs
    (over its intra-node links) and divides the model's heads, kv heads and MLP width. 1: no tensor
    parallelism."""
    link_efficiency: float = 0.96
    """Share of a link's line rate a large transfer or collective reaches (NCCL's maintainers count 12 GB/s for
    a 100 Gbit/s NIC, 24 GB/s for 200 Gbit/s: nccl-tests issue 119)."""
    memory_reserve_fraction: float = 0.1
    """Share of device memory kept free for the framework, allocator fragmentation and buffers."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences one replica may process per micro-batch. A stage's replicas share a pipeline micro-batch as
    evenly as possible (shares differ by at most one sequence), every replica taking at least one and at
    most the largest of these times its tensor-parallel degree; with `equal_widths` every share is exactly
    one of these."""
    max_stages: int = 128
    """Most pipeline stages in one pipeline."""
    activation_codecs: tuple[str, ...] = ("identity", "bf16", "fp16", "int8")
    """Codecs the activations' error budget allows (int4 and top-k are excluded by default)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the island parallelizer may choose within a stage's data-parallel group."""
    allow_recompute: bool = True
    """Let the island parallelizer recompute activations in backward to save memory."""
    zero_bubble: bool = True
    """Defer the linear layers' weight gradients of every stage that can (ZeRO 0 or 1, and the memory for what
    they hold) to fill the pipeline's fill and drain (`atoll.node.schedule`); False: plain 1F1B."""
    min_deferred_s: float = 0.005
    """Least weight-gradient time per micro-batch for a stage to defer it: a weight action has a cost of its own
    that the layer profile does not see (measured on CPU nodes: the tiny demo model's weight actions of about
    1 ms made its steps 30% slower, the 125M model's of about 100 ms made them 11-22% faster)."""
    fill_warmup: bool = True
    """Let a stage run up to p - i - 1 more warm-up forwards where its memory holds them and the simulated step
    is shorter (filling the wait for its first gradient: `StagePlan.in_flight`); False: only the deep windows a
    slow link asks for."""
    memory_fraction: float = 0.8
    """Share of a device's datasheet memory bandwidth (`DeviceSpec.memory_gbps`) a memory-bound pass reaches:
    the loss over the logits and the optimizer's state updates, where no profile gives their time (the
    calibration in `catalog`)."""
    optimizer_bytes_per_s: float = 1.0e12
    """Memory bandwidth of the optimizer step's state updates on a device whose bandwidth is not known (no
    `memory_gbps`) when no profile gives its time."""
    refine_factors: tuple[float, ...] = (1.0, 1.15, 1.4)
    """Bottleneck relaxations tried after the minimum (fewer stages may shorten fill and drain)."""
    equal_widths: bool = False
    """Only pipelines whose stages all have the same data-parallel degree (replica r of a stage feeds
    replica r of the next) and share each micro-batch exactly evenly, for runtimes that cannot regroup a
    micro-batch between stages."""
    several_pipelines: bool = True
    """Also try one pipeline per region (up to 4 regions) and one per island (up to 4 islands), data-parallel
    with each other."""
    simulate_top: int = 4
    """Candidates `search` returns, best first by their simulated step time."""
    network: NetworkModel = NOMINAL
    """How the cost model reads the cluster's cross-node figures (`network`): the nominal reading, or one fitted
    to what nodes measured (`atoll.coordinator.netfit`)."""
    band: tuple[NetworkModel, ...] = (PESSIMISTIC,)
    """The other readings a plan is scored under (`robust`): the plan chosen is the one with the least worst-case
    regret over `network` and these; empty: the fastest under `network` alone."""
    band_others: int = 6
    """Besides the search's leading pipelines, the best composed pipelines of this many other device counts (and of
    the most devices) are scored under the band."""
    band_search_up_to: int = 1024
    band_search_regions: bool = False
    """Also search whole under each model of the band on clusters spanning regions (within `band_search_up_to`)."""
    """Clusters of one region and at most this many devices are searched whole under each model of the band too
    (their best plans join the candidates); larger ones, and those spanning regions (a search per region and one
    over all of them), re-score the nominal search's leading candidates only."""
    near_equal: float = 0.0
    """Pipelines predicted within this fraction of the fastest count as equally fast, and among them the planner
    takes the one with the most devices, then the fewest stages, then the largest micro-batch: a choice that
    holds from run to run where the times are measurements that vary by a few percent (the coordinator plans
    from node profiles with 0.05); 0: the fastest."""
    outer_mode: str = "auto"
    """Across regions: "auto" plans each region as a replica group with an outer sync and keeps it when it
    predicts at least `outer_min_gain` x the synchronous plan's tokens/s; "sync": one synchronous plan only;
    "outer": replica groups whenever two or more regions can each hold the model."""
    outer_min_gain: float = 1.25
    """Least tokens/s ratio of outer mode over the synchronous plan for "auto" to choose it: an outer-mode
    token is taken as worth about 0.8 of a synchronous one (the groups see each other's progress once a
    round), so outer mode must pay for that first."""
    outer_wan_gap: float = 10.0
    """"auto" considers outer mode only where the slowest link between two regions is at least this many times
    slower than the slowest link inside them (an order of magnitude, as islands part): over links that fast
    a synchronous step crosses regions well, and outer mode's gain would come from each group training the
    whole batch, not from the link."""
    outer_inner_steps: int = 0
    """H, inner steps per round of the fastest group; 0: the smallest of 1, 2, 5, ..., 500 whose sync hides
    behind a round."""
    outer_codec: str = "auto"
    """Codec of the pseudo-gradients: "auto" (from the wide-area bandwidth, see `outer`), or one of identity,
    fp16, bf16, int8, int4, topk, sparse2."""
    outer_topk_fraction: float = 0.02
    """Fraction of the pseudo-gradients' elements the top-k codec keeps."""
    outer_sparse_fraction: float = 1 / 64
    """Fraction of each chunk of the pseudo-gradients the sparse2 codec keeps (2 bits a value)."""
    outer_overlap: bool = True
    """Exchange round r while round r + 1 trains (the sync must land within one round to hide); False: each
    round blocks until its exchange lands."""
    outer_lr: float = 1.0
    """Outer learning rate, copied into the plan (1.0 with momentum 0: plain averaging)."""
    outer_momentum: float = 0.0
    """Outer momentum, copied into the plan."""
    outer_nesterov: bool = True
    """Nesterov outer momentum, copied into the plan."""
    outer_deadline_s: float = 0.0
    """How long a round waits for late groups after the first arrives (0: a round's length, at least 30 s)."""

    def __post_init__(self) -> None:
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"achievable_fraction must be in (0, 1], got {self.achievable_fraction}")
        if not 0 < self.tf32_fraction <= 1 or not 0 < self.fp32_fraction <= 1:
            raise ValueError(f"tf32_fraction and fp32_fraction must be in (0, 1], got {self.tf32_fraction} and "
                             f"{self.fp32_fraction}")
        if self.half_efficiency_tokens < 0 or self.half_efficiency_width < 0:
            raise ValueError("half_efficiency_tokens and half_efficiency_width must be >= 0")
        if self.max_tp < 1:
            raise ValueError(f"max_tp must be >= 1 (1: no tensor parallelism), got {self.max_tp}")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")
        if not 0 <= self.memory_reserve_fraction < 1:
            raise ValueError(f"memory_reserve_fraction must be in [0, 1), got {self.memory_reserve_fraction}")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise ValueError(f"micro_batches must be positive sizes, got {self.micro_batches}")
        if self.max_stages < 1:
            raise ValueError("max_stages must be >= 1")
        bad = [c for c in self.activation_codecs if c not in CODEC_ORDER]
        if bad or not self.activation_codecs:
            raise ValueError(f"activation_codecs must be some of {', '.join(CODEC_ORDER)}, got {self.activation_codecs}")
        if not self.zero_stages or any(z not in (0, 1, 2, 3) for z in self.zero_stages):
            raise ValueError(f"zero_stages must be some of 0, 1, 2, 3, got {self.zero_stages}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.optimizer_bytes_per_s <= 0:
            raise ValueError("optimizer_bytes_per_s must be positive")
        if not self.refine_factors or min(self.refine_factors) < 1:
            raise ValueError("refine_factors must be >= 1")
        if self.simulate_top < 1:
            raise ValueError("simulate_top must be >= 1")
        if self.band_others < 0:
            raise ValueError(f"band_others must be >= 0, got {self.band_others}")
        if self.band_search_up_to < 0:
            raise ValueError(f"band_search_up_to must be >= 0 devices, got {self.band_search_up_to}")
        if not 0 <= self.near_equal < 1:
            raise ValueError(f"near_equal must be in [0, 1), got {self.near_equal}")
        if self.outer_mode not in OUTER_MODES:
            raise ValueError(f"outer_mode must be one of {', '.join(OUTER_MODES)}, got {self.outer_mode!r}")
        if not self.outer_min_gain > 0:
            raise ValueError(f"outer_min_gain must be positive, got {self.outer_min_gain}")
        if not self.outer_wan_gap >= 1:
            raise ValueError(f"outer_wan_gap must be >= 1, got {self.outer_wan_gap}")
        if self.outer_inner_steps < 0:
            raise ValueError(f"outer_inner_steps must be >= 0 (0: chosen by the planner), got {self.outer_inner_steps}")
        if self.outer_codec not in OUTER_CODECS:
            raise ValueError(f"outer_codec must be one of {', '.join(OUTER_CODECS)}, got {self.outer_codec!r}")
        if not 0 < self.outer_topk_fraction <= 1:
            raise ValueError(f"outer_topk_fraction must be in (0, 1], got {self.outer_topk_fraction}")
        if not 0 < self.outer_sparse_fraction <= 1:
            raise ValueError(f"outer_sparse_fraction must be in (0, 1], got {self.outer_sparse_fraction}")
        if not 0 < self.outer_lr <= 2:
            raise ValueError(f"outer_lr must be in (0, 2], got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_deadline_s < 0:
            raise ValueError(f"outer_deadline_s must be >= 0, got {self.outer_deadline_s}")
