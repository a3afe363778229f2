"""The optional lossless zstd stage, composable after any codec (`CodecSpec.zstd_level > 0`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import zstandard

from atoll.compression.codec import Codec, Payload
from atoll.compression.errors import CodecError


class ZstdStage(Codec):
    """`inner`'s payload compressed as one zstd frame that records its content size (which the decoder
    checks against the size the metadata implies before it decompresses anything) and a checksum."""

    def __init__(self, inner: Codec, level: int) -> None:
        super().__init__(inner.spec)
        self.inner = inner
        self.level = level
        self.id = inner.id
        self.name = inner.name
        self.accepts = inner.accepts

    def encode(self, t: torch.Tensor) -> Payload:
        raw = self.inner.encode(t)
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True, write_checksum=True).compress(raw)

    def decode(self, payload: Payload, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        expected = self.inner.wire_size(shape, dtype)
        try:
            size = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd stage: payload is not a zstd frame ({e}); truncated or corrupt payload") from None
        if size != expected:
            raise CodecError(f"zstd stage: frame holds {size} bytes but shape {tuple(shape)} {dtype} under "
                             f"{self.inner.name} needs {expected} (corrupt payload or metadata that disagrees)")
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd stage: cannot decompress the payload ({e}); truncated or corrupt") from None
        if len(raw) != expected:
            raise CodecError(f"zstd stage: decompressed {len(raw)} bytes, expected {expected}")
        return self.inner.decode(raw, shape, dtype)

    def payload_size(self, numel: int, dtype: torch.dtype) -> int:
        return self.inner.payload_size(numel, dtype)

    def expected_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        # what zstd gains depends on the data; predictions count only the codec's own ratio
        return self.inner.expected_ratio(dtype)

    def error_bound(self, t: torch.Tensor) -> float:
        return self.inner.error_bound(t)

    @property
    def expected_error(self) -> float:
        return self.inner.expected_error
