"""Bytes tensors hold, each storage counted once, for the memory a stage reports (`atoll.node.stage`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding `t`'s elements."""
    # tensor parallelism: a DTensor (a shard) or an AsyncCollectiveTensor (a collective's result) has no
    # storage of its own; its inner tensor has
    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    return t.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages holding `tensors`, each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = storage(t)
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
