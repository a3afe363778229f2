"""Atoll: train large models across heterogeneous, geo-distributed GPUs.

The shared core: CLI, configuration, model and plan types, wire conversion and gRPC factories.
Components live in `atoll.coordinator`, `atoll.node` and `atoll.compression`.
"""

__version__ = "0.1.0"
WIRE_VERSION = "atoll.v1"
