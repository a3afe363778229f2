"""Error feedback: what the codec drops comes back in later steps, so sums of gradients are preserved."""

from __future__ import annotations

import pytest
import torch

from atoll.compression import CodecError, CodecSpec, ErrorFeedback, decode_tensor


@pytest.mark.parametrize("spec", [CodecSpec("topk", topk_fraction=0.01), CodecSpec("int4"),
                                  CodecSpec("topk", topk_fraction=0.05, zstd_level=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_decoded_tracks_sum_of_true_gradients(spec: CodecSpec, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(spec)
    true_sum = torch.zeros(2000)
    sent_sum = torch.zeros(2000)
    plain_sum = torch.zeros(2000)
    gaps = []
    for _ in range(120):
        grad = (torch.randn(2000, generator=g) + 0.1).to(dtype)  # a bias makes dropped mass accumulate
        enc = ef.encode("layer.weight", grad)
        assert enc.dtype == dtype
        sent_sum += decode_tensor(enc.payload, enc.shape, enc.dtype, spec).float()
        plain = ErrorFeedback(spec).encode("x", grad)
        plain_sum += decode_tensor(plain.payload, plain.shape, plain.dtype, spec).float()
        true_sum += grad.float()
        gaps.append((true_sum - sent_sum).norm().item())
        # the gap is exactly the residual held back
        assert torch.allclose(true_sum - sent_sum, ef.residual("layer.weight"), atol=1e-2)
    # bounded: the gap stops growing, while without feedback the error grows with the number of steps
    assert max(gaps[60:]) < 1.5 * max(gaps[:60]) + 1.0
    assert (true_sum - sent_sum).norm() < 0.5 * (true_sum - plain_sum).norm()


def test_residuals_are_per_name_and_resettable() -> None:
    ef = ErrorFeedback(CodecSpec("topk", topk_fraction=0.1))
    ef.encode("a", torch.randn(100))
    ef.encode("b", torch.randn(5, 5))
    assert ef.residual("a").shape == (100,) and ef.residual("b").shape == (5, 5)
    with pytest.raises(CodecError, match="call reset"):
        ef.encode("a", torch.randn(50))
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.encode("a", torch.randn(50))
    ef.reset()
    assert ef.residual("a") is None and ef.residual("b") is None


def test_input_gradient_is_not_modified() -> None:
    ef = ErrorFeedback(CodecSpec("topk", topk_fraction=0.1))
    grad = torch.randn(100)
    copy = grad.clone()
    ef.encode("w", grad)
    ef.encode("w", grad)
    assert torch.equal(grad, copy)
