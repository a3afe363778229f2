"""Error feedback for lossy gradient compression: what a codec drops is added back before the next encode."""

from __future__ import annotations

import torch

from atoll.compression.errors import CodecError
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import EncodedTensor, encode_tensor, get_codec


class ErrorFeedback:
    """Keeps one float32 residual per tensor name: encode(g) sends codec(g + r) and keeps
    r' = g + r - decode(codec(g + r)), so the sum of what was sent tracks the sum of the true gradients
    within one residual. Not thread-safe: one per sender."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self._residuals: dict[str, torch.Tensor] = {}

    def encode(self, name: str, tensor: torch.Tensor) -> EncodedTensor:
        return self.encode_decoded(name, tensor)[0]

    def encode_decoded(self, name: str, tensor: torch.Tensor) -> tuple[EncodedTensor, torch.Tensor]:
        """`encode`, and what the receivers will decode (the encoder decodes it anyway, for the residual)."""
        corrected = tensor.detach().float()
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != corrected.shape:
                raise CodecError(f"error feedback for {name!r}: residual has shape {tuple(residual.shape)} but the "
                                 f"tensor has {tuple(corrected.shape)}; call reset({name!r}) when a shape changes")
            corrected = corrected + residual
        sent = corrected.to(tensor.dtype)
        enc = encode_tensor(sent, self.spec)
        decoded = get_codec(self.spec).decode(enc.payload, enc.shape, enc.dtype)
        self._residuals[name] = corrected - decoded.float()
        return enc, decoded

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual, or all of them (after a replan, or when shapes change)."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
