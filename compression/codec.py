"""The `Codec` interface, the buffer helpers every codec shares, and the registry keyed by `pb.Codec`.

A payload is a flat byte string whose length is a function of (shape, dtype, spec) alone, so decoders
check the exact size before they touch the bytes and never need a header.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Union

import torch

from atoll.compression.dtypes import FLOAT_DTYPES, element_size
from atoll.compression.errors import CodecError
from atoll.compression.spec import CodecSpec

Payload = Union[bytes, bytearray, memoryview]
"""What encoders return and decoders accept: any C-contiguous byte buffer."""


class Codec(ABC):
    """Turns a tensor into a payload and back. Instances are immutable and thread-safe."""

    id: int
    """The `pb.Codec` value."""
    name: str
    """The codec's name in `CodecSpec.codec`."""
    accepts: frozenset[torch.dtype] = FLOAT_DTYPES

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    @abstractmethod
    def encode(self, t: torch.Tensor) -> Payload:
        """The payload of `t` (any shape, a dtype in `accepts`)."""

    @abstractmethod
    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of `shape` and `dtype` that `payload` encodes; CodecError when it cannot be."""

    @abstractmethod
    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        """Exact payload bytes for a tensor of `numel` elements of `dtype`."""

    def wire_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact payload bytes for a tensor of `shape` (a codec whose size depends on more than the element
        count overrides it)."""
        return self.payload_size(numel_of(shape), dtype)

    @abstractmethod
    def error_bound(self, t: torch.Tensor) -> float:
        """A bound on max |decode(encode(t)) - t| for this `t` (finite values)."""

    @property
    @abstractmethod
    def expected_error(self) -> float:
        """Expected relative L2 error on Gaussian data (what the link policy budgets with)."""

    def expected_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        """Raw bytes over payload bytes for a large tensor of `dtype`."""
        n = 1 << 24
        return n * element_size(dtype) / self.payload_size(n, dtype)

    # --- shared helpers ---------------------------------------------------------------------------------

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise CodecError(f"{self.name} encodes torch.Tensor, got {type(t).__name__}")
        if t.dtype not in self.accepts:
            raise CodecError(f"codec {self.name} cannot encode dtype {t.dtype}; it accepts "
                             f"{', '.join(sorted(str(d) for d in self.accepts))} (use identity for other dtypes)")
        return t.detach().reshape(-1)

    def _check_decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """(payload as a uint8 tensor of the exact expected size, numel)."""
        if dtype not in self.accepts:
            raise CodecError(f"codec {self.name} cannot decode to dtype {dtype}")
        numel = numel_of(shape)
        buf = as_uint8(payload)
        expected = self.wire_size(shape, dtype)
        if buf.numel() != expected:
            raise CodecError(f"{self.name} payload for shape {tuple(shape)} {dtype} must be {expected} bytes, got "
                             f"{buf.numel()} (truncated or corrupt payload, or metadata that disagrees with it)")
        return buf, numel


def numel_of(shape: Sequence[int]) -> int:
    for d in shape:
        if d < 0:
            raise CodecError(f"negative dimension in shape {tuple(shape)}")
    return math.prod(shape)


def as_uint8(payload: Payload) -> torch.Tensor:
    """A uint8 tensor over the payload's memory, without copying. Callers never write to it."""
    mv = memoryview(payload)
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not mv.c_contiguous:
        raise CodecError("payload buffer must be contiguous")
    if mv.readonly:
        # torch warns that the tensor will be read-only; decoders only read it and never return an alias of it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)
    return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)


def is_readonly(payload: Payload) -> bool:
    return memoryview(payload).readonly


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a memoryview that keeps the tensor alive (no copy)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


# --- registry -------------------------------------------------------------------------------------------

_REGISTRY: dict[int, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    if cls.id in _REGISTRY:
        raise RuntimeError(f"codec id {cls.id} registered twice: {_REGISTRY[cls.id].__name__} and {cls.__name__}")
    _REGISTRY[cls.id] = cls
    return cls


def codec_class(codec_id: int) -> type[Codec]:
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        raise CodecError(f"no codec registered for id {codec_id}") from None


def registered() -> dict[int, type[Codec]]:
    return dict(_REGISTRY)


def check_registry(enum_values: Sequence[int], names: dict[int, str]) -> None:
    """Every `pb.Codec` value has a codec whose name matches atoll.serde's map (run at import)."""
    missing = [v for v in enum_values if v not in _REGISTRY]
    if missing:
        raise RuntimeError(f"pb.Codec values without a registered codec: {missing}")
    for v in enum_values:
        if names.get(v) != _REGISTRY[v].name:
            raise RuntimeError(f"codec id {v}: registered as {_REGISTRY[v].name!r}, serde names it {names.get(v)!r}")

