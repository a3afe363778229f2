"""Tensor dtypes on the wire: torch dtype <-> `pb.DType`, and which codecs accept which dtype."""

from __future__ import annotations

import torch

from atoll.compression.errors import CodecError
from atoll.v1 import atoll_pb2 as pb

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""What every codec accepts."""

WIRE_DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
}
"""Every dtype the wire can carry; the integer ones only through the identity codec."""

TORCH_DTYPES: dict[int, torch.dtype] = {v: k for k, v in WIRE_DTYPES.items()}


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return WIRE_DTYPES[dtype]
    except KeyError:
        names = ", ".join(str(d) for d in WIRE_DTYPES)
        raise CodecError(f"dtype {dtype} cannot be sent; convert the tensor to one of {names}") from None


def dtype_from_proto(value: int) -> torch.dtype:
    try:
        return TORCH_DTYPES[value]
    except KeyError:
        name = pb.DType.Name(value) if value in pb.DType.values() else str(value)
        raise CodecError(f"unknown or unspecified tensor dtype {name} in the metadata; "
                         f"the sender must set one of {', '.join(pb.DType.Name(v) for v in TORCH_DTYPES)}") from None


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a real number to `dtype` (half an ulp), 0 for integers."""
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps) / 2
    return 0.0
