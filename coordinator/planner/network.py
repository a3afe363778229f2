"""Network models: how the cost model reads the cluster's cross-node figures.

A cluster file (or the coordinator's probes) gives each link a figure per GPU flow (`cluster`). Whether a real
NIC reaches it with every GPU of its node sending at once, and whether NCCL's hierarchical all-reduce runs as the
cost model prices it, depends on the hardware; a plan should not bet the job on it. A `NetworkModel` is one
reading of the figures: the nominal one takes them as given, the pessimistic one as one flow per node (cross-node
point-to-point transfers 4x slower, the all-reduce a flat ring at one flow per node paying every hop's latency), and a
fitted one is what nodes measured (`atoll.coordinator.netfit`). Intra-node links (NVLink, PCIe) are never scaled:
they are inside one machine and do not depend on the NIC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """A reading of the cluster's cross-node figures (every field at its default: the nominal one)."""

    name: str = "nominal"
    """What it is called in the plan's figures and the CLI."""
    p2p_scale: float = 1.0
    """Multiplies the bandwidth of every activation transfer that crosses nodes (between islands, regions, or
    nodes of one island)."""
    collective_scale: float = 1.0
    """Multiplies the inter-node bandwidth an all-reduce (or reduce-scatter, all-gather) sees across nodes."""
    flat_ring: bool = False
    """An all-reduce spanning nodes runs as one flat ring over every replica (2 (N-1) hops, each at the
    cross-node rate and latency), not hierarchically inside each node first."""
    p2p_latency_s: float = 0.0
    """Added to the one-way latency of every cross-node transfer."""
    collective_latency_s: float = 0.0
    """Added to the latency of every cross-node hop of a collective."""

    def __post_init__(self) -> None:
        for what in ("p2p_scale", "collective_scale"):
            v = getattr(self, what)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"network model {self.name!r}: {what} must be a positive finite factor, got {v}")
        for what in ("p2p_latency_s", "collective_latency_s"):
            v = getattr(self, what)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"network model {self.name!r}: {what} must be finite seconds >= 0, got {v}")

    @property
    def nominal(self) -> bool:
        return self == NetworkModel(name=self.name)

    def describe(self) -> str:
        """One line: what this model assumes against the cluster's figures."""
        if self.nominal:
            return f"{self.name}: the cluster's figures as given"
        parts = []
        if self.p2p_scale != 1:
            parts.append(f"cross-node transfers at {self.p2p_scale:.3g}x")
        if self.collective_scale != 1:
            parts.append(f"cross-node collectives at {self.collective_scale:.3g}x")
        if self.flat_ring:
            parts.append("all-reduce a flat ring")
        if self.p2p_latency_s:
            parts.append(f"+{self.p2p_latency_s * 1e3:.3g} ms a transfer")
        if self.collective_latency_s:
            parts.append(f"+{self.collective_latency_s * 1e3:.3g} ms a collective hop")
        return f"{self.name}: " + ", ".join(parts)


NOMINAL = NetworkModel()
PESSIMISTIC = NetworkModel(name="pessimistic", p2p_scale=0.25, flat_ring=True)
"""One flow per node: cross-node transfers 4x slower than the per-GPU-flow figures (a node of 4 GPUs sharing one
NIC), and the all-reduce a flat ring over every replica at one flow per node, paying each of its 2 (N-1) hops'
latency: gpus_per_node times slower across nodes than the hierarchical all-reduce the nominal model prices (4x on
nodes of 4 GPUs; the all-reduce tail a published planner's simulator charges on such nodes is 4-6x the nominal)."""
