"""Generate the Python code of the wire schema (atoll/v1/*_pb2*.py, .pyi) with the pinned grpcio-tools.

Usage: python protos/generate.py [--out DIR]   (DIR defaults to the repository root)

The generated files are committed; tests/test_protos.py regenerates into a temporary folder and fails
when the committed copies are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc on every .proto under protos/ and return the files it wrote."""
    from grpc_tools import protoc  # the pinned dev dependency
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTO_FILES,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = proto[: -len(".proto")]
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out / f"{stem}{suffix}")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    ns = parser.parse_args()
    for path in generate(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
