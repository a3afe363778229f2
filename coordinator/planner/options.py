"""What a plan is for (`TrainSpec`) and how the planner searches (`PlannerOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.modelspec import dtype_bytes

CODEC_ORDER = ("identity", "bf16", "fp16", "int8", "int4")
"""Activation codecs from the least to the most lossy."""


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
    """Fraction of a device's peak FLOPS a large matmul-bound layer reaches (the analytic estimate)."""
    half_efficiency_tokens: int = 256
    """Tokens per micro-batch at which a device reaches half of `achievable_fraction` (small batches are slow)."""
    memory_reserve_fraction: float = 0.1
    """Share of device memory kept free for the framework, allocator fragmentation and buffers."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences one replica may process per micro-batch; every stage's share of a pipeline micro-batch is
    one of these."""
    max_stages: int = 128
    """Most pipeline stages in one pipeline."""
    activation_codecs: tuple[str, ...] = ("identity", "bf16", "fp16", "int8")
    """Codecs the activations' error budget allows (int4 and top-k are excluded by default)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the island parallelizer may choose within a stage's data-parallel group."""
    allow_recompute: bool = True
    """Let the island parallelizer recompute activations in backward to save memory."""
    optimizer_bytes_per_s: float = 1.0e12
    """Memory bandwidth of the optimizer step's state updates when no profile gives its time."""
    refine_factors: tuple[float, ...] = (1.0, 1.15, 1.4)
    """Bottleneck relaxations tried after the minimum (fewer stages may shorten fill and drain)."""
    equal_widths: bool = False
    """Only pipelines whose stages all have the same data-parallel degree (replica r of a stage feeds
    replica r of the next), for runtimes that cannot regroup a micro-batch between stages."""
    several_pipelines: bool = True
    """Also try one pipeline per region (up to 4 regions) and one per island (up to 4 islands), data-parallel
    with each other."""
    simulate_top: int = 4
    """Candidates `search` returns, best first by their simulated step time."""

    def __post_init__(self) -> None:
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"achievable_fraction must be in (0, 1], got {self.achievable_fraction}")
        if self.half_efficiency_tokens < 0:
            raise ValueError("half_efficiency_tokens must be >= 0")
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
        if self.optimizer_bytes_per_s <= 0:
            raise ValueError("optimizer_bytes_per_s must be positive")
        if not self.refine_factors or min(self.refine_factors) < 1:
            raise ValueError("refine_factors must be >= 1")
        if self.simulate_top < 1:
            raise ValueError("simulate_top must be >= 1")
