"""The plan: which island runs which layers, in which pipeline, with which codec on each link.

A `Plan` is what the planner returns, what the coordinator publishes (as the `atoll.v1.Plan` message)
and what `atoll plan --json` writes. Its JSON shape:

    {"model": str, "global_batch": int, "seq_len": int,
     "predicted": {"step_time_s": float, "tokens_per_s": float, "mfu": float, "bottleneck": str},
     "islands": [{"id": str, "group": str, "device": str, "nodes": [str], "gpus": int}],
     "pipelines": [{"micro_batch": int, "num_micro_batches": int,
       "stages": [{"island": str, "layers": [first, last_exclusive], "dp": int, "tp": int, "zero": int,
                   "recompute": bool, "compute_s": float, "memory_gb_per_device": float,
                   "send": {"codec": str, "bytes": int, "seconds": float} | null}]}]}

plus the runtime fields `epoch`, `job_id`, `resume_step`, `node_addresses`, `rendezvous`, and per stage
`nodes` and `dp_rendezvous`.
Layers count the embedding as layer 0 and the head as the last.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from atoll.fsutil import atomic_write_text

GB = 1e9


@dataclass(kw_only=True)
class SendPlan:
    """The link from a stage to the next: codec of the activations and the predicted transfer."""

    codec: str = "identity"
    """Codec name: identity, fp16, bf16, int8, int4, topk."""
    bytes: int = 0
    """Bytes of one micro-batch's activation before encoding."""
    seconds: float = 0.0
    """Predicted transfer time of one micro-batch under the codec."""
    block_size: int = 0
    topk_fraction: float = 0.0
    zstd_level: int = 0


@dataclass(kw_only=True)
class StagePlan:
    island: str
    layers: tuple[int, int]
    dp: int = 1
    tp: int = 1
    zero: int = 0
    recompute: bool = False
    compute_s: float = 0.0
    """Predicted forward+backward time of one micro-batch."""
    memory_gb_per_device: float = 0.0
    send: SendPlan | None = None
    nodes: list[str] = field(default_factory=list)
    """Node ids of the data-parallel replicas, in rank order (empty when planned from a cluster file)."""
    dp_rendezvous: str = ""
    """torch.distributed init address (tcp://HOST:PORT) of this stage's replicas."""

    def __post_init__(self) -> None:
        a, b = self.layers
        if not 0 <= a < b:
            raise ValueError(f"stage layers must be [first, last_exclusive) with first < last, got {self.layers}")
        self.layers = (int(a), int(b))


@dataclass(kw_only=True)
class PipelinePlan:
    micro_batch: int
    num_micro_batches: int
    stages: list[StagePlan]


@dataclass(kw_only=True)
class Prediction:
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bottleneck: str = ""


@dataclass(kw_only=True)
class IslandInfo:
    id: str
    group: str = ""
    device: str = ""
    nodes: list[str] = field(default_factory=list)
    gpus: int = 0
    inner_bandwidth: float = 0.0
    """Slowest link inside the island, bytes/s (0: unknown)."""
    outer_bandwidth: float = 0.0
    """Fastest link leaving the island, bytes/s (0: none)."""


@dataclass(kw_only=True)
class Plan:
    model: str
    global_batch: int
    seq_len: int
    predicted: Prediction = field(default_factory=Prediction)
    islands: list[IslandInfo] = field(default_factory=list)
    pipelines: list[PipelinePlan] = field(default_factory=list)
    epoch: int = 0
    job_id: str = ""
    resume_step: int = 0
    """Step the nodes start from: the last complete checkpoint (0: the seeded initialisation)."""
    node_addresses: dict[str, str] = field(default_factory=dict)
    """Node id -> HOST:PORT of its Peer server (live plans)."""
    rendezvous: str = ""
    """HOST:PORT of the torch.distributed store the nodes of this epoch meet at (live plans)."""

    def validate(self, num_layers: int | None = None) -> None:
        """Check that every pipeline covers the layers contiguously, once."""
        if not self.pipelines:
            raise ValueError("plan has no pipelines")
        for pi, p in enumerate(self.pipelines):
            if not p.stages:
                raise ValueError(f"pipeline {pi} has no stages")
            expect = 0
            for si, s in enumerate(p.stages):
                if s.layers[0] != expect:
                    raise ValueError(f"pipeline {pi} stage {si} starts at layer {s.layers[0]}, expected {expect}")
                expect = s.layers[1]
            if num_layers is not None and expect != num_layers:
                raise ValueError(f"pipeline {pi} ends at layer {expect}, the model has {num_layers}")

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p in d["pipelines"]:
            for s in p["stages"]:
                s["layers"] = list(s["layers"])
        return d

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "Plan":
        pipelines = []
        for p in d["pipelines"]:
            stages = []
            for s in p["stages"]:
                s = dict(s)
                send = s.pop("send", None)
                stages.append(StagePlan(**{**s, "layers": tuple(s["layers"])},
                                        send=SendPlan(**send) if send else None))
            pipelines.append(PipelinePlan(micro_batch=p["micro_batch"], num_micro_batches=p["num_micro_batches"],
                                          stages=stages))
        return cls(
            model=d["model"], global_batch=d["global_batch"], seq_len=d["seq_len"],
            predicted=Prediction(**d.get("predicted", {})),
            islands=[IslandInfo(**i) for i in d.get("islands", [])],
            pipelines=pipelines,
            epoch=d.get("epoch", 0), job_id=d.get("job_id", ""), resume_step=d.get("resume_step", 0),
            node_addresses=dict(d.get("node_addresses", {})), rendezvous=d.get("rendezvous", ""),
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_json_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_json_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), self.to_json() + "\n")
