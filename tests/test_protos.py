"""The committed generated code matches what the pinned grpcio-tools makes of protos/ today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("atoll_protos_generate", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra: pip install -e '.[dev]'")
    gen = _load_generator()
    written = gen.generate(tmp_path)
    assert written, "no .proto files found under protos/"
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = REPO / rel
        assert committed.exists(), f"{rel} is not committed: run python protos/generate.py"
        assert committed.read_text() == fresh.read_text(), f"{rel} is stale: run python protos/generate.py"


def test_every_codec_enum_value_has_a_name() -> None:
    from atoll.serde import CODEC_NAME
    from atoll.v1 import atoll_pb2 as pb

    assert set(CODEC_NAME) == set(pb.Codec.values())


def test_services_are_importable() -> None:
    from atoll.v1 import atoll_pb2_grpc as pb_grpc

    assert hasattr(pb_grpc, "CoordinatorServicer") and hasattr(pb_grpc, "PeerServicer")
