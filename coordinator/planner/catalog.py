"""Device catalog: peak dense throughput and memory of the accelerators the planner knows by name.

Figures are the vendors' datasheet numbers for dense (no structured sparsity) math:
- ``tflops_16``: peak 16-bit tensor-core TFLOPS with fp32 accumulation (bf16 where the device has it,
  fp16 on V100 and T4, which lack bf16);
- ``tflops_32``: peak non-tensor fp32 TFLOPS, used when a job trains in fp32.

Sources (datasheets, retrieved 2024-2025):
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (bf16 1,979 TFLOPS with sparsity -> 989 dense; fp32 67).
- H200 SXM 141GB: NVIDIA H200 datasheet (same compute as H100 SXM: bf16 989 dense; fp32 67; 141 GB HBM3e).
- A100 SXM 40GB / 80GB: NVIDIA A100 datasheet (bf16 312 dense; fp32 19.5).
- A10 24GB: NVIDIA A10 datasheet (bf16 125 dense, 250 with sparsity; fp32 31.2).
- L4 24GB: NVIDIA L4 datasheet (bf16 242 with sparsity -> 121 dense; fp32 30.3).
- L40S 48GB: NVIDIA L40S datasheet (bf16 733 with sparsity -> 362 dense; fp32 91.6).
- V100 SXM2 16/32GB: NVIDIA V100 datasheet (fp16 tensor 125; fp32 15.7).
- T4 16GB: NVIDIA T4 datasheet (fp16 tensor 65; fp32 8.1).
- RTX 3090 24GB: NVIDIA Ampere GA102 whitepaper, appendix (fp16/bf16 tensor with fp32 accumulate 71 with
  sparsity -> 35.6 dense; fp32 35.6).
- RTX 4090 24GB: NVIDIA Ada Lovelace (AD102) whitepaper, appendix (fp16/bf16 tensor with fp32 accumulate
  330.3 with sparsity -> 165.2 dense; fp32 82.6).

Memory is the device's total in GB (1e9 bytes as datasheets count; the planner keeps a reserve, see
`PlannerOptions.memory_reserve_fraction`).
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.tflops_16 < 0 or self.tflops_32 < 0:
            raise ValueError(f"device {self.name!r}: tflops must be >= 0")
        if self.memory_gb <= 0:
            raise ValueError(f"device {self.name!r}: memory_gb must be positive, got {self.memory_gb}")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a training dtype (fp32 uses the fp32 figure, 16-bit types the tensor figure)."""
        return (self.tflops_32 if dtype in ("fp32", "float32") else self.tflops_16) * 1e12


def _d(name: str, t16: float, t32: float, mem: float, source: str) -> DeviceSpec:
    return DeviceSpec(name=name, tflops_16=t16, tflops_32=t32, memory_gb=mem, source=source)


CATALOG: dict[str, DeviceSpec] = {
    d.name.lower(): d
    for d in (
        _d("H100", 989.0, 67.0, 80, "NVIDIA H100 datasheet (SXM5)"),
        _d("H200", 989.0, 67.0, 141, "NVIDIA H200 datasheet (SXM)"),
        _d("A100-80GB", 312.0, 19.5, 80, "NVIDIA A100 datasheet (SXM 80GB)"),
        _d("A100-40GB", 312.0, 19.5, 40, "NVIDIA A100 datasheet (SXM 40GB)"),
        _d("A10", 125.0, 31.2, 24, "NVIDIA A10 datasheet"),
        _d("L4", 121.0, 30.3, 24, "NVIDIA L4 datasheet"),
        _d("L40S", 362.0, 91.6, 48, "NVIDIA L40S datasheet"),
        _d("V100-32GB", 125.0, 15.7, 32, "NVIDIA V100 datasheet (SXM2 32GB)"),
        _d("V100-16GB", 125.0, 15.7, 16, "NVIDIA V100 datasheet (SXM2 16GB)"),
        _d("T4", 65.0, 8.1, 16, "NVIDIA T4 datasheet"),
        _d("RTX3090", 35.6, 35.6, 24, "NVIDIA GA102 whitepaper"),
        _d("RTX4090", 165.2, 82.6, 24, "NVIDIA AD102 whitepaper"),
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
