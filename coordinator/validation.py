"""Checks of what nodes send, before anything is stored: sizes, ranges, formats.

Each check raises `InvalidArgument` naming the field, the bad value and the accepted range.
"""

from __future__ import annotations

import math
import re

from atoll.coordinator.errors import InvalidArgument
from atoll.preflight import dial_address_problem
from atoll.types import MAX_SPLIT_OVERHEAD
from atoll.v1 import atoll_pb2 as pb

MAX_STRING = 256
MAX_TIMINGS = 64
MAX_LINKS_PER_REPORT = 1024
MAX_DEVICES = 1024
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: beyond this a profile is wrong, not large
MAX_SECONDS = 3600.0
MAX_BANDWIDTH = 1e13  # 10 TB/s, beyond any link
MAX_FLOWS = 1024  # nodes of one machine that probe at once
MAX_JOIN_BYTES = 64 * 1024
"""Largest Join accepted: a profile of 64 timings, a CSR and its strings take a few KiB."""
MAX_CSR_BYTES = 16 * 1024
"""Largest certificate signing request (PEM) accepted: an EC or RSA-4096 key's is under 2 KiB."""
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")


def check_string(name: str, value: str, *, required: bool = False, limit: int = MAX_STRING) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{name} is {len(value)} characters long; at most {limit} are accepted")
    if required and not value.strip():
        raise InvalidArgument(f"{name} is empty")


def check_seconds(name: str, value: float) -> None:
    if not math.isfinite(value) or not 0.0 <= value <= MAX_SECONDS:
        raise InvalidArgument(f"{name} = {value} must be a finite time between 0 and {MAX_SECONDS:g} seconds")


def check_join_size(req: pb.JoinRequest) -> None:
    """A Join is small: its size and its CSR's are bounded before anything in it is read, kept or dialled."""
    size = req.ByteSize()
    if size > MAX_JOIN_BYTES:
        raise InvalidArgument(f"the Join is {size} bytes; at most {MAX_JOIN_BYTES} are accepted (a node's profile and "
                              f"certificate request take a few KiB)")
    if len(req.csr_pem) > MAX_CSR_BYTES:
        raise InvalidArgument(f"csr_pem is {len(req.csr_pem)} bytes; at most {MAX_CSR_BYTES} are accepted")


def check_node_id(node_id: str) -> None:
    if not NODE_ID_RE.match(node_id):
        raise InvalidArgument(f"node id {node_id[:80]!r} must be 1-64 letters, digits, '.', '_' or '-', starting "
                              f"with a letter or digit")


def check_address(name: str, address: str) -> None:
    """HOST:PORT a peer can dial (`atoll.preflight.dial_address_problem`, as the node's own flags are checked)."""
    check_string(name, address, required=True)
    problem = dial_address_problem(address)
    if problem is not None:
        raise InvalidArgument(f"{name} {address!r} {problem}; advertise an address peers can dial "
                              f"(atoll node --advertise HOST:PORT)")


def check_profile(p: pb.NodeProfile) -> None:
    """A node's self-description: plausible sizes, non-negative finite timings, bounded strings and lists."""
    check_string("profile.hostname", p.hostname, required=True)
    check_string("profile.device_kind", p.device_kind, required=True)
    if p.device_kind not in DEVICE_KINDS:
        raise InvalidArgument(f"profile.device_kind {p.device_kind[:40]!r} is not one of {', '.join(DEVICE_KINDS)}")
    check_string("profile.device_name", p.device_name, required=True)
    check_string("profile.torch_version", p.torch_version)
    check_string("profile.atoll_version", p.atoll_version)
    if not 1 <= p.device_count <= MAX_DEVICES:
        raise InvalidArgument(f"profile.device_count = {p.device_count} must be between 1 and {MAX_DEVICES}")
    if not 0 < p.memory_total_bytes <= MAX_MEMORY_BYTES:
        raise InvalidArgument(f"profile.memory_total_bytes = {p.memory_total_bytes} must be positive and at most "
                              f"{MAX_MEMORY_BYTES}")
    if p.memory_free_bytes > p.memory_total_bytes:
        raise InvalidArgument(f"profile.memory_free_bytes ({p.memory_free_bytes}) exceeds memory_total_bytes "
                              f"({p.memory_total_bytes})")
    if not 1 <= p.cpu_count <= 1 << 16:
        raise InvalidArgument(f"profile.cpu_count = {p.cpu_count} must be between 1 and 65536")
    check_seconds("profile.optimizer_step_seconds", p.optimizer_step_seconds)
    if len(p.layer_timings) > MAX_TIMINGS:
        raise InvalidArgument(f"profile.layer_timings has {len(p.layer_timings)} entries; at most {MAX_TIMINGS}")
    for i, t in enumerate(p.layer_timings):
        if t.layer_kind not in ("embedding", "block", "head"):
            raise InvalidArgument(f"profile.layer_timings[{i}].layer_kind {t.layer_kind[:40]!r} is not embedding, "
                                  f"block or head")
        if not 1 <= t.micro_batch <= 1 << 16 or not 1 <= t.seq_len <= 1 << 20:
            raise InvalidArgument(f"profile.layer_timings[{i}] has micro_batch {t.micro_batch} and seq_len "
                                  f"{t.seq_len}; both must be positive and plausible")
        check_seconds(f"profile.layer_timings[{i}].forward_seconds", t.forward_seconds)
        check_seconds(f"profile.layer_timings[{i}].backward_seconds", t.backward_seconds)
        if not 0.0 <= t.weight_fraction < 1.0:  # NaN fails too
            raise InvalidArgument(f"profile.layer_timings[{i}].weight_fraction is {t.weight_fraction}; a share of the "
                                  f"backward must be in [0, 1) (0: not measured)")
        if not 0.0 <= t.split_overhead < MAX_SPLIT_OVERHEAD:  # NaN fails too
            raise InvalidArgument(f"profile.layer_timings[{i}].split_overhead is {t.split_overhead}; the split "
                                  f"backward's extra time over the fused one must be in [0, {MAX_SPLIT_OVERHEAD:g}) "
                                  f"(0: not measured)")


def check_link(i: int, x: pb.LinkMeasurement, node_id: str) -> None:
    if x.src != node_id:
        raise InvalidArgument(f"links[{i}].src is {x.src[:80]!r}; a node reports only its own probes ({node_id})")
    check_node_id(x.dst)
    if x.dst == node_id:
        raise InvalidArgument(f"links[{i}] measures the node against itself")
    if not math.isfinite(x.bandwidth_bytes_per_s) or not 0 <= x.bandwidth_bytes_per_s <= MAX_BANDWIDTH:
        raise InvalidArgument(f"links[{i}].bandwidth_bytes_per_s = {x.bandwidth_bytes_per_s} must be between 0 and "
                              f"{MAX_BANDWIDTH:g}")
    check_seconds(f"links[{i}].rtt_seconds", x.rtt_seconds)
    if x.flows > MAX_FLOWS:
        raise InvalidArgument(f"links[{i}].flows = {x.flows}: a machine probe has at most {MAX_FLOWS} flows")
