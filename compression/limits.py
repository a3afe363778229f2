"""`WireLimits`: how much a receiver is willing to allocate for one incoming tensor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WireLimits:
    """Bounds checked against the metadata before any buffer is allocated."""

    max_tensor_bytes: int = 1 << 30
    """Largest payload, and largest decoded tensor, in bytes (default 1 GiB)."""
    max_elements: int = (1 << 31) - 1
    """Largest element count of one tensor (int32 indices bound top-k anyway)."""
    max_dims: int = 8
    """Largest number of dimensions."""
    max_chunk_bytes: int = 8 << 20
    """Largest data field of one chunk (the default matches atoll.rpc's 8 MiB message limit)."""

    def __post_init__(self) -> None:
        for name in ("max_tensor_bytes", "max_elements", "max_dims", "max_chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive integer, got {value!r}")
        if self.max_elements > (1 << 31) - 1:
            raise ValueError(f"WireLimits.max_elements must be below 2**31 (top-k uses int32 indices), "
                             f"got {self.max_elements}")
