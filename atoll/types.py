"""Core records exchanged between components: node profiles, link measurements and step metrics.

Their wire forms are the `atoll.v1` messages of the same names; `atoll.serde` converts both ways.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


MAX_SPLIT_OVERHEAD = 4.0
"""Bound of `LayerTiming.split_overhead`: a split backward five times the fused one is a broken measurement."""


@dataclass(kw_only=True)
class LayerTiming:
    """Measured time of one layer kind at one micro-batch size on a node's device."""

    layer_kind: str
    micro_batch: int
    seq_len: int
    forward_seconds: float
    backward_seconds: float
    weight_fraction: float = 0.0
    """Of the backward, the share its weight-gradient products take when a zero-bubble stage computes them
    in an action of their own (measured: W / (B + W) of the split backward); 0: not measured (the planner then
    takes the layer's FLOPs share)."""
    split_overhead: float = 0.0
    """How much longer the backward takes split in two (input gradients, then the deferred weight-gradient
    products) than in one pass: (B + W) / backward - 1, measured with `weight_fraction`; 0: not measured or none."""


@dataclass(kw_only=True)
class NodeProfile:
    """What a node measured of itself before joining."""

    hostname: str = ""
    device_kind: str = "cpu"
    device_name: str = ""
    device_count: int = 1
    memory_total_bytes: int = 0
    memory_free_bytes: int = 0
    cpu_count: int = 1
    layer_timings: list[LayerTiming] = field(default_factory=list)
    optimizer_step_seconds: float = 0.0
    torch_version: str = ""
    atoll_version: str = ""
    region: str = ""
    """Site label the operator gives (a lab, a datacenter, a cloud region); islands never span two."""
    unreachable: bool = False
    """The node accepts no connections (`--no-listen`, or the coordinator could not dial its advertised address
    back at join): its neighbours send to it over the streams it opens (`atoll.node.reverse`)."""

    def scaled(self, factor: float) -> "NodeProfile":
        """The profile of a device `factor` times slower: every layer timing and the optimizer step."""
        if factor == 1.0:
            return self
        timings = [dataclasses.replace(t, forward_seconds=t.forward_seconds * factor,
                                       backward_seconds=t.backward_seconds * factor) for t in self.layer_timings]
        return dataclasses.replace(self, layer_timings=timings,
                                   optimizer_step_seconds=self.optimizer_step_seconds * factor)


@dataclass(kw_only=True)
class LinkMeasurement:
    """One probe of the link from `src` to `dst`."""

    src: str
    dst: str
    bandwidth_bytes_per_s: float
    rtt_seconds: float
    probe_bytes: int = 0
    measured_unix: float = 0.0
    flows: int = 1
    """1: a flow alone; k > 1: one of k flows every node of src's machine sent at once (a machine probe)."""


@dataclass(kw_only=True)
class LinkStats:
    """Traffic of one step on one link, as a node saw it."""

    peer: str
    direction: str  # "forward" or "backward"
    bytes_raw: int = 0
    bytes_wire: int = 0
    seconds: float = 0.0
    codec: str = "identity"
    bandwidth_bytes_per_s: float = 0.0
    transfers: int = 0
    """Messages the totals add up (0: not counted)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveStats:
    """The collectives of one kind and size a node ran in one step, timed from call to completion."""

    kind: str
    """"all_reduce", "reduce_scatter" or "all_gather"."""
    bytes: int
    """Bytes of each call's whole tensor."""
    participants: int
    seconds: float
    """Summed over `count` calls."""
    count: int = 1


@dataclass(frozen=True, kw_only=True)
class TensorOffence:
    """A tensor a node rejected at its door, or a bad loss it computed (kind "loss", sender: the node itself)."""

    sender: str
    kind: str
    """"non-finite", "norm" (far outside the link's running statistics), "loss", or "loss-vote" (a loss the other
    loss holders contradicted, named by the coordinator)."""
    direction: str
    """"forward", "backward" or "loss"."""
    step: int
    micro_batch: int = 0
    norm: float = 0.0
    """The tensor's norm (the loss, for kind "loss"); 0 when not finite."""
    finite: bool = True
    detail: str = ""

    def describe(self) -> str:
        norm = f"{self.norm:.4g}" if self.finite else "not finite"
        if self.kind == "loss":
            return f"step {self.step}: the loss of {self.sender}'s stage ({norm}) {self.detail}".rstrip()
        if self.kind == "loss-vote":
            return f"step {self.step}: {self.sender} reported the loss {norm} {self.detail}".rstrip()
        what = "activation" if self.direction == "forward" else "activation-gradient"
        return (f"step {self.step}: {self.sender} sent a {self.kind} {what} (micro-batch {self.micro_batch}, norm "
                f"{norm}) {self.detail}").rstrip()


@dataclass(kw_only=True)
class StepMetrics:
    """What one node reports after one training step."""

    job_id: str
    node_id: str
    plan_epoch: int
    step: int
    pipeline: int = 0
    stage: int = 0
    loss: float | None = None
    tokens: int = 0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    links: list[LinkStats] = field(default_factory=list)
    unix_time: float = 0.0
    peak_memory_bytes: int = 0
    """The step's peak memory of the stage: the CUDA allocator's peak on a GPU; on a CPU the bytes of its
    parameters, gradients and optimizer states plus the most activation bytes saved for backward at once
    (0: not measured)."""
    val_loss: float | None = None
    """Mean loss over the held-out validation batches after this step (None: no validation pass this step)."""
    loss_scale: float | None = None
    """fp16: the loss scale this step's gradients carried (None under fp32 and bf16)."""
    skipped: bool = False
    """fp16: a gradient overflowed somewhere in the job, so no node stepped (atoll.node.precision)."""
    restored_from: str = ""
    """On the first step of a node's run of a plan: "live" (state from live nodes, no rollback) or "checkpoint";
    empty on every other step."""
    restore_bytes: int = 0
    """First step of a run: bytes of stage state the node fetched from peers for it."""
    restore_seconds: float = 0.0
    """First step of a run: seconds those fetches took."""
    steps_rolled_back: int = 0
    """First step of a run: the furthest step any node had reached minus the step the run resumed at."""
    offences: list[TensorOffence] = field(default_factory=list)
    """What the node rejected in this step (`atoll.node.door`): the step was skipped on every node."""
    collectives: list[CollectiveStats] = field(default_factory=list)
    """The step's timed collectives (`atoll.node.dataparallel.CollectiveTimer`), per kind and size."""
