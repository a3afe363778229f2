"""Device catalog: peak dense throughput and memory of the accelerators the planner knows by name.

Figures are the vendors' datasheet numbers for dense math (no structured sparsity; datasheets that quote
the sparse figure first are halved here), one per *math path* a training dtype runs on:
- ``tflops_16``: peak 16-bit tensor-core TFLOPS with fp32 accumulation (bf16 where the device has it,
  fp16 on V100 and T4, which lack bf16) -- the path of bf16 and fp16 jobs;
- ``tflops_tf32``: peak TF32 tensor-core TFLOPS, 0 where the device has no TF32 tensor cores (V100, T4) --
  the path of fp32 jobs' matmuls on devices that have it (the node turns TF32 on for fp32 matmuls, as
  NVIDIA's containers do by default; PyTorch's own default since 1.12 is off);
- ``tflops_32``: peak non-tensor fp32 TFLOPS -- the path of fp32 jobs on devices without TF32.

A peak is not what training reaches: `effective_tflops` multiplies it by the fraction of its path's peak a
large transformer layer achieves (`PlannerOptions.achievable_fraction` for 16-bit tensor cores,
`tf32_fraction`, `fp32_fraction`), and the cost model further by a curve over tokens per kernel and the
per-rank matrix width under tensor parallelism. Those fractions are calibrated on measurements, not
datasheets:
- 16-bit: 0.5 of peak, the order of Megatron-LM's 52% of an A100's 312 TFLOPS on GPT models (Narayanan et
  al., SC'21); the A100 / V100 ratio is then 2.5x, the top of Lambda's estimate for language models with
  fp16 tensor cores (1.95x-2.5x, "NVIDIA A100 GPU Benchmarks for Deep Learning", 2020).
- fp32: an A100 training in fp32 runs its matmuls on TF32 tensor cores and measures about 3.1x a V100 on
  fp32 (NVIDIA, "Getting Immediate Speedups with NVIDIA A100 TF32", 2020, gives 2x to over 5x time to
  solution across networks; 3.1x is the language-model figure this planner is checked against). Large
  SGEMMs reach about 0.8 of the fp32 units' peak (V100: 12.6 of 15.7 TFLOPS), so TF32 kernels must reach
  0.25 of theirs (A100: 39 of 156) for that ratio: fp32 activations move twice the bytes of 16-bit ones,
  and the layer's memory-bound work weighs more. Mixed precision over TF32 on an A100 then comes out at
  4x, above the 1.3x-2.5x PyTorch's AMP notes quote across (mostly vision) networks; a measured profile
  overrides either.

Sources (datasheets, retrieved 2024-2025; dense figures):
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (bf16 1,979 with sparsity -> 989; TF32 989 with
  sparsity -> 494.5; fp32 67).
- H200 SXM 141GB: NVIDIA H200 datasheet (same compute as H100 SXM; 141 GB HBM3e).
- A100 SXM 40GB / 80GB: NVIDIA A100 datasheet (bf16 312; TF32 156; fp32 19.5).
- A10 24GB: NVIDIA A10 datasheet (bf16 125, 250 with sparsity; TF32 62.5, 125 with sparsity; fp32 31.2).
- L4 24GB: NVIDIA L4 datasheet (bf16 242 with sparsity -> 121; TF32 120 with sparsity -> 60; fp32 30.3).
- L40S 48GB: NVIDIA L40S datasheet (bf16 733 with sparsity -> 362; TF32 366 with sparsity -> 183; fp32
  91.6).
- V100 SXM2 16/32GB: NVIDIA V100 datasheet (fp16 tensor 125; no TF32; fp32 15.7).
- T4 16GB: NVIDIA T4 datasheet (fp16 tensor 65; no TF32; fp32 8.1).
- RTX 3090 24GB: NVIDIA Ampere GA102 whitepaper, appendix A (fp16/bf16 tensor with fp32 accumulate 71,
  142 with sparsity; TF32 tensor 35.6, 71 with sparsity; fp32 35.6). GeForce cards run fp16 with fp32
  accumulate at half the rate of fp16 accumulate (142 dense); an earlier version of this catalog took 71 for
  the sparse figure and halved it.
- RTX 4090 24GB: NVIDIA Ada Lovelace (AD102) whitepaper, appendix (fp16/bf16 tensor with fp32 accumulate
  165.2, 330.3 with sparsity; TF32 tensor 82.6, 165.2 with sparsity; fp32 82.6).

Memory is the device's total in GB (1e9 bytes as datasheets count; the planner keeps a reserve, see
`PlannerOptions.memory_reserve_fraction`).

Memory bandwidth (``memory_gbps``, GB/s, the same datasheets): H100 SXM5 3,350; H200 SXM 4,800; A100 SXM
80GB 2,039 and 40GB 1,555; A10 600; L4 300; L40S 864; V100 SXM2 900; T4 320; RTX 3090 936 (GA102 whitepaper);
RTX 4090 1,008 (AD102 whitepaper). It prices the work a layer's FLOPs do not: memory-bound passes such as the
loss over the vocabulary's logits and the optimizer's state updates, at `PlannerOptions.memory_fraction` of the
figure (a streaming kernel reaches about 0.8-0.9 of it: a read kernel measured 1.80 of 2.04 TB/s on an A100
80GB SXM, and the GTC talk that thread cites found about 90% the best of any kernel: NVIDIA developer forums,
"Trouble to Reach Peak Bandwidth of A100"; PyTorch's elementwise and multi-tensor optimizer kernels, which read
and write, sit at the low end). 0: not known (the optimizer then falls back to
`PlannerOptions.optimizer_bytes_per_s`, and the loss is left in the head's FLOPs estimate alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator model as the planner sees it."""

    name: str
    """Canonical name (as written in cluster files, case-insensitive)."""
    tflops_16: float
    """Peak dense 16-bit tensor TFLOPS (bf16, or fp16 where the device has no bf16)."""
    tflops_32: float
    """Peak dense fp32 TFLOPS (non-tensor)."""
    memory_gb: float
    """Device memory, GB (1e9 bytes)."""
    source: str = ""
    """Where the figures come from."""
    tflops_tf32: float = 0.0
    """Peak dense TF32 tensor TFLOPS; 0 when the device has no TF32 tensor cores (fp32 then runs on the
    fp32 units)."""
    memory_gbps: float = 0.0
    """Peak memory bandwidth, GB/s (1e9 bytes/s as datasheets count); 0: not known."""

    def __post_init__(self) -> None:
        if self.tflops_16 < 0 or self.tflops_32 < 0 or self.tflops_tf32 < 0:
            raise ValueError(f"device {self.name!r}: tflops must be >= 0")
        if self.memory_gbps < 0:
            raise ValueError(f"device {self.name!r}: memory_gbps must be >= 0 (0: not known), got {self.memory_gbps}")
        if self.memory_gb <= 0:
            raise ValueError(f"device {self.name!r}: memory_gb must be positive, got {self.memory_gb}")

    def math_path(self, dtype: str) -> str:
        """Where a training dtype's matmuls run: "tensor16" (bf16, fp16), "tf32" (fp32 on a device with
        TF32 tensor cores) or "fp32" (fp32 on the fp32 units)."""
        if dtype not in ("fp32", "float32"):
            return "tensor16"
        return "tf32" if self.tflops_tf32 > 0 else "fp32"

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of the math path a training dtype runs on (`math_path`)."""
        path = self.math_path(dtype)
        return {"tensor16": self.tflops_16, "tf32": self.tflops_tf32, "fp32": self.tflops_32}[path] * 1e12

    def effective_flops(self, dtype: str, fractions: Mapping[str, float]) -> float:
        """FLOP/s a large transformer layer reaches: the path's peak times its achievable fraction
        (`fractions` by path name; see the module docstring for the calibration)."""
        return self.peak_flops(dtype) * fractions[self.math_path(dtype)]

    def effective_memory_bandwidth(self, fraction: float) -> float:
        """Bytes/s a streaming (memory-bound) kernel reaches: the datasheet bandwidth times `fraction`; 0 when
        the bandwidth is not known."""
        return self.memory_gbps * 1e9 * fraction


def _d(name: str, t16: float, tf32: float, t32: float, mem: float, gbps: float, source: str) -> DeviceSpec:
    return DeviceSpec(name=name, tflops_16=t16, tflops_tf32=tf32, tflops_32=t32, memory_gb=mem, memory_gbps=gbps,
                      source=source)


CATALOG: dict[str, DeviceSpec] = {
    d.name.lower(): d
    for d in (
        _d("H100", 989.0, 494.5, 67.0, 80, 3350, "NVIDIA H100 datasheet (SXM5)"),
        _d("H200", 989.0, 494.5, 67.0, 141, 4800, "NVIDIA H200 datasheet (SXM)"),
        _d("A100-80GB", 312.0, 156.0, 19.5, 80, 2039, "NVIDIA A100 datasheet (SXM 80GB)"),
        _d("A100-40GB", 312.0, 156.0, 19.5, 40, 1555, "NVIDIA A100 datasheet (SXM 40GB)"),
        _d("A10", 125.0, 62.5, 31.2, 24, 600, "NVIDIA A10 datasheet"),
        _d("L4", 121.0, 60.0, 30.3, 24, 300, "NVIDIA L4 datasheet"),
        _d("L40S", 362.0, 183.0, 91.6, 48, 864, "NVIDIA L40S datasheet"),
        _d("V100-32GB", 125.0, 0.0, 15.7, 32, 900, "NVIDIA V100 datasheet (SXM2 32GB)"),
        _d("V100-16GB", 125.0, 0.0, 15.7, 16, 900, "NVIDIA V100 datasheet (SXM2 16GB)"),
        _d("T4", 65.0, 0.0, 8.1, 16, 320, "NVIDIA T4 datasheet"),
        _d("RTX3090", 71.0, 35.6, 35.6, 24, 936, "NVIDIA GA102 whitepaper"),
        _d("RTX4090", 165.2, 82.6, 82.6, 24, 1008, "NVIDIA AD102 whitepaper"),
    )
}

ALIASES: dict[str, str] = {
    "h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200",
    "a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb",
    "v100": "v100-32gb", "v100-32": "v100-32gb", "v100-16": "v100-16gb",
    "rtx-3090": "rtx3090", "rtx 3090": "rtx3090", "3090": "rtx3090",
    "rtx-4090": "rtx4090", "rtx 4090": "rtx4090", "4090": "rtx4090",
    "l40s-48gb": "l40s", "a10-24gb": "a10", "l4-24gb": "l4", "t4-16gb": "t4",
}


def device(name: str) -> DeviceSpec:
    """The catalog entry for a device name (case-insensitive; common aliases such as "A100" accepted)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    try:
        return CATALOG[key]
    except KeyError:
        known = ", ".join(d.name for d in CATALOG.values())
        raise ValueError(f"unknown device {name!r}; the catalog knows {known} "
                         "(or give tflops and memory_gb instead of a catalog name)") from None
