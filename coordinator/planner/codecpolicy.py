"""The planner's link codecs from atoll.compression's own policy, so plans predict what the links will do.

`PolicyCodecModel` makes the choice a `LinkPolicy` primed with the link's bandwidth and latency makes for
an activation ("activation" role, its error budget): the least lossy candidate whose transfer, timed by
`predict_transfer_seconds`, hides under the overlap, else the fastest. Timings are memoised per tensor
size and link, since the composer asks about the same links many times. (tests/test_planner.py checks the
choice against `LinkPolicy.choose`.) Where the codecs include a wide-area one (hadamard, lowrank: compression mode
"wan" or either alone) the policy is `PolicyConfig.wan`: the least measured loss cost that hides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from atoll.compression.losscost import WAN_CANDIDATES
from atoll.compression.policy import ROLES, LinkPolicy, PolicyConfig, predict_transfer_seconds
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import get_codec

TORCH_DTYPE = {4: torch.float32, 2: torch.bfloat16}
WAN_ONLY = frozenset({"hadamard", "lowrank"})
"""Codecs only the quality-aware policy ranks (their expected error on Gaussian data says nothing of their cost)."""


def mode_codecs(mode: str) -> tuple[str, ...]:
    """The activation codecs the planner chooses among under a job's compression mode (`CompressionSpec.mode`)."""
    return {"adaptive": ("identity", "bf16", "fp16", "int8"),
            "wan": tuple(c.codec for c in WAN_CANDIDATES)}.get(mode, (mode,))


@dataclass(kw_only=True)
class PolicyCodecModel:
    """LinkCodecModel backed by atoll.compression.LinkPolicy."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    """The compression policy's configuration (candidates and error budgets)."""
    names: tuple[str, ...] | None = None
    """Restrict the candidates to these codec names (None: every candidate within the budget)."""
    role: str = "activation"
    """Whose error budget applies."""
    width: int | None = None
    """The boundary tensor's last dimension (d_model): a low-rank codec's size depends on the shape."""

    def __post_init__(self) -> None:
        if self.names is not None and len(self.names) == 1 and self.names[0] in WAN_ONLY:
            # one codec the job fixed: the user chose its loss, so no budget applies
            spec = next(c for c in WAN_CANDIDATES if c.codec == self.names[0])
            self.config = PolicyConfig(candidates=(spec,), error_budgets={r: math.inf for r in ROLES})
        elif self.names is not None and WAN_ONLY & set(self.names) and self.config.loss_costs is None:
            self.config = PolicyConfig.wan(names=self.names)
        cands = tuple(c for c in self.config.allowed(self.role) if self.names is None or c.codec in self.names)
        if not cands:
            raise ValueError(f"no codec among {self.names} is within the {self.role} error budget of the "
                             "compression policy; allow identity")
        self.config = PolicyConfig(candidates=cands, error_budgets=self.config.error_budgets,
                                   hysteresis=self.config.hysteresis, loss_costs=self.config.loss_costs,
                                   max_loss_cost=self.config.max_loss_cost)
        self._specs = cands
        self._times: dict[tuple[int, int, float, float], list[tuple[str, float]]] = {}

    def _accepts(self, spec: CodecSpec, dtype: torch.dtype) -> bool:
        return dtype in get_codec(spec).accepts

    def _timed(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float) -> list[tuple[str, float]]:
        key = (raw_bytes, elem_bytes, bandwidth, latency_s)
        got = self._times.get(key)
        if got is None:
            dtype = TORCH_DTYPE.get(elem_bytes, torch.float32)
            numel, w = raw_bytes // elem_bytes, self.width
            shape = (numel // w, w) if w and numel % w == 0 else None
            got = [(c.codec, predict_transfer_seconds(raw_bytes, c, bandwidth, latency_s, dtype=dtype, shape=shape))
                   for c in self._specs if self._accepts(c, dtype)]
            self._times[key] = got
        return got

    def choose(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float,
               overlap_s: float) -> tuple[str, float]:
        # what a fresh LinkPolicy decides (no hysteresis yet): the least lossy that fits, else the fastest
        timed = self._timed(raw_bytes, elem_bytes, bandwidth, latency_s)
        for codec, sec in timed:
            if sec <= overlap_s:
                return codec, sec
        return min(timed, key=lambda x: x[1])

    def policy(self, bandwidth: float, latency_s: float) -> LinkPolicy:
        """A link policy primed as the planner assumed (for the nodes' links to start from)."""
        return LinkPolicy(self.config, initial_bandwidth_bytes_per_s=bandwidth, latency_s=latency_s)

    def block_size(self, codec: str) -> int:
        return next((c.block_size for c in self._specs if c.codec == codec), 0)

    def fastest(self, raw_bytes: int, elem_bytes: int, bandwidth: float, latency_s: float) -> float:
        return min(sec for _, sec in self._timed(raw_bytes, elem_bytes, bandwidth, latency_s))
