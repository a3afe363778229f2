"""Atoll: train large models across heterogeneous, geo-distributed GPUs.

The shared core: configuration, model and plan types, wire conversion and gRPC factories; it imports no
component. Components live in `atoll.coordinator`, `atoll.node` and `atoll.compression`; the command line,
the local cluster launcher, the demo and its pictures in `atoll.launch`, above them all.
"""

__version__ = "0.1.0"
WIRE_VERSION = "atoll.v1"


def _map_source_checkout() -> None:
    """In a source checkout (not installed), serve the component folders as atoll.node & co.

    Installed, setuptools maps node/ -> atoll.node etc.; running `python -m atoll` or tests from the
    repository root puts this folder first on sys.path, so the same mapping is made here.
    """
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "node" / "__init__.py").is_file():
        if str(root) not in __path__:
            __path__.append(str(root))


_map_source_checkout()
