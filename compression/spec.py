"""`CodecSpec`: which codec, with which parameters, as plans, policies and the wire name it."""

from __future__ import annotations

import struct
from dataclasses import KW_ONLY, dataclass

from atoll.compression.errors import CodecError
from atoll.serde import CODEC_BY_NAME, CODEC_NAME
from atoll.v1 import atoll_pb2 as pb

DEFAULT_BLOCK_SIZE = 64
DEFAULT_TOPK_FRACTION = 0.01
MAX_BLOCK_SIZE = 1 << 20
MAX_ZSTD_LEVEL = 22
DEFAULT_BITS = 4
LOWRANK_BITS = (4, 8, 16)
DEFAULT_RANK = 16
MAX_RANK = 1 << 12


def _float32(x: float) -> float:
    # the wire carries topk_fraction as a float32; both ends must derive k from the same number
    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclass(frozen=True)
class CodecSpec:
    """A codec and its parameters. Parameters a codec does not use are kept but ignored by it."""

    codec: str
    """One of "identity", "fp16", "bf16", "int8", "int4", "topk", "sparse2", "hadamard", "lowrank" (the only
    positional field)."""
    _: KW_ONLY
    block_size: int = DEFAULT_BLOCK_SIZE
    """int8/int4/hadamard: elements that share one absmax scale (>= 1)."""
    topk_fraction: float = DEFAULT_TOPK_FRACTION
    """topk, sparse2 (per chunk): fraction of elements kept, in (0, 1]; stored at float32 precision, as on the
    wire."""
    zstd_level: int = 0
    """0: no lossless stage; 1..22: a zstd stage at this level after the codec."""
    bits: int = DEFAULT_BITS
    """hadamard: bits per code, 2, 3 or 4; lowrank: bits per factor entry, 4 or 8 (integer codes, a scale per
    row of P and per column of Q'), or 16 (bfloat16 factors)."""
    rank: int = DEFAULT_RANK
    """lowrank: rank of the factors sent, in [1, 4096] (capped by the matrix's own dimensions)."""
    seed: int = 0
    """hadamard: seed of the random sign flips; lowrank: of the first subspace. Sender and receiver share it
    through the wire's codec parameters; in [0, 2**32)."""

    def __post_init__(self) -> None:
        if self.codec not in CODEC_BY_NAME:
            raise CodecError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODEC_BY_NAME)}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise CodecError(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {self.block_size!r}")
        if not isinstance(self.topk_fraction, (int, float)) or not 0.0 < float(self.topk_fraction) <= 1.0:
            raise CodecError(f"topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        if isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int) \
                or not 0 <= self.zstd_level <= MAX_ZSTD_LEVEL:
            raise CodecError(f"zstd_level must be an integer in [0, {MAX_ZSTD_LEVEL}] (0 turns the stage off), "
                             f"got {self.zstd_level!r}")
        for name, lo, hi in (("bits", 2, 16), ("rank", 1, MAX_RANK), ("seed", 0, (1 << 32) - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise CodecError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.codec == "lowrank" and self.bits not in LOWRANK_BITS:
            raise CodecError(f"lowrank bits must be 4, 8 or 16 (bfloat16 factors), got {self.bits}")
        if self.codec != "lowrank" and not 2 <= self.bits <= 4:
            raise CodecError(f"bits must be an integer in [2, 4], got {self.bits!r}")
        object.__setattr__(self, "topk_fraction", _float32(float(self.topk_fraction)))

    @property
    def codec_id(self) -> int:
        """The `pb.Codec` value."""
        return CODEC_BY_NAME[self.codec]

    def label(self) -> str:
        """Short human name, e.g. "int8/64", "topk/0.01+zstd3"."""
        base = self.codec
        if self.codec in ("int8", "int4"):
            base += f"/{self.block_size}"
        elif self.codec in ("topk", "sparse2"):
            base += f"/{self.topk_fraction:.3g}"
        elif self.codec == "hadamard":
            base += f"/{self.bits}b/{self.block_size}"
        elif self.codec == "lowrank":
            base += f"/r{self.rank}" + ("" if self.bits == 16 else f"/{self.bits}b")
        return base + (f"+zstd{self.zstd_level}" if self.zstd_level else "")

    def to_proto(self) -> tuple[int, pb.CodecParams]:
        """(`pb.Codec` value, `pb.CodecParams`) for `TensorMeta.codec` / `.codec_params`."""
        return self.codec_id, pb.CodecParams(block_size=self.block_size, topk_fraction=self.topk_fraction,
                                             zstd_level=self.zstd_level, bits=self.bits, rank=self.rank,
                                             seed=self.seed)

    @classmethod
    def from_proto(cls, codec_id: int, params: pb.CodecParams | None = None) -> CodecSpec:
        """The spec a sender named; zero parameters mean the defaults. Raises CodecError on anything unknown."""
        name = CODEC_NAME.get(codec_id)
        if name is None:
            raise CodecError(f"unknown codec id {codec_id}; this build knows "
                             f"{', '.join(f'{v} ({k})' for k, v in CODEC_BY_NAME.items())}; upgrade the receiver "
                             f"or have the sender use a known codec")
        params = params if params is not None else pb.CodecParams()
        return cls(codec=name, block_size=params.block_size or DEFAULT_BLOCK_SIZE,
                   topk_fraction=params.topk_fraction or DEFAULT_TOPK_FRACTION, zstd_level=params.zstd_level,
                   bits=params.bits or DEFAULT_BITS, rank=params.rank or DEFAULT_RANK, seed=params.seed)
