"""Each codec's measured loss cost at a stage boundary: how much worse training goes through it than identity.

A loss cost is (eval loss at equal tokens through the codec, in both directions) / (identity's) - 1, keyed by
the spec's label ("int8/64", "lowrank/r16"). The quality-aware link policy (`PolicyConfig.wan`) and the planner
take, per boundary, the codec of least loss cost whose transfer hides behind compute.

`MEASURED` is the table this build ships; `python -m bench.wan_pipeline` measures it again on the geo testbed and
writes its own (`write_table`), which `table(path)` reads over it. Entries are clamped at 0: a codec measured a
hair better than identity is noise, not a gain.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from atoll.compression.spec import CodecSpec

MEASURED: dict[str, float] = {
    # python -m bench.wan_pipeline (60 steps of its d_model-256 model on two stages, float32 boundary; the mean gap
    # of the last third of 7 evaluations); a codec measured better than identity is entered at 0
    "identity": 0.0,
    "int8/64": 0.0009,
    "int4/64": 0.0040,
    "hadamard/4b/64": 0.0,  # -0.43%
    "lowrank/r32/4b": 0.0313,  # just over the 3% budget of mode "wan": not chosen unless a table or budget allows
    "lowrank/r16/4b": 0.179,
    "lowrank/r8/4b": 0.213,
    # the tiny job's 30 steps on two stages (tests/test_wan_codecs.py), bfloat16 factors
    "lowrank/r16": 0.003,
}
"""label -> loss cost as this build ships it; a codec without an entry is not a candidate of mode "wan"."""

WAN_CANDIDATES: tuple[CodecSpec, ...] = (CodecSpec("identity"), CodecSpec("bf16"), CodecSpec("int8"), CodecSpec("int4"),
                                         CodecSpec("hadamard"), CodecSpec("lowrank", rank=32))
"""What a wide-area boundary chooses among (compression mode "wan"): lowrank at rank 32 of 4-bit factors, the
rank bench.wan_pipeline measured nearest 3% (ranks 16 and 8 lose 18-21%)."""


def table(path: str | Path | None = None) -> dict[str, float]:
    """`MEASURED`, with the entries of the JSON table at `path` (a bench's; none: `ATOLL_LOSS_COST` if set) over
    it."""
    out = dict(MEASURED)
    path = path if path is not None else os.environ.get("ATOLL_LOSS_COST") or None
    if path is not None:
        out.update(read_table(path))
    return out


def read_table(path: str | Path) -> dict[str, float]:
    """A loss-cost table as `write_table` wrote it; ValueError saying what is wrong otherwise."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the loss-cost table {path}: {e} (run python -m bench.wan_pipeline to write "
                         f"one, or unset ATOLL_LOSS_COST)") from None
    costs = doc.get("loss_cost") if isinstance(doc, dict) else None
    if not isinstance(costs, dict):
        raise ValueError(f"{path}: a loss-cost table is a JSON object with a 'loss_cost' object of label -> number")
    out = {}
    for label, v in costs.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{path}: loss cost of {label!r} must be a finite number, got {v!r}")
        out[str(label)] = max(0.0, float(v))
    return out


def write_table(path: str | Path, costs: Mapping[str, float], *, note: str) -> None:
    """Write `costs` (label -> loss cost) to `path` atomically, with a note on how they were measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"note": note, "loss_cost": {k: max(0.0, float(v)) for k, v in costs.items()}},
                              indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def loss_cost(spec: CodecSpec, costs: Mapping[str, float] | None = None) -> float | None:
    """The loss cost of `spec` (its zstd stage is lossless and costs nothing), None when unmeasured."""
    costs = MEASURED if costs is None else costs
    label = spec.label().split("+zstd", 1)[0]
    return costs.get(label)
