"""`atoll plan` end to end: every shipped cluster file plans; JSON, picture and errors are what users see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atoll.launch.cli import main
from atoll.plan import Plan

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples" / "clusters").glob("*.toml"))


@pytest.mark.parametrize("cluster", EXAMPLES, ids=lambda p: p.stem)
def test_plans_every_example(cluster: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "1.3b", "--cluster", str(cluster), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "bottleneck:" in text and "pipeline 0:" in text
    d = json.loads(out.read_text())
    assert set(d) >= {"model", "global_batch", "seq_len", "predicted", "islands", "pipelines"}
    assert set(d["predicted"]) >= {"step_time_s", "tokens_per_s", "mfu", "bottleneck"}
    stage = d["pipelines"][0]["stages"][0]
    assert set(stage) >= {"island", "layers", "dp", "tp", "zero", "recompute", "compute_s", "memory_gb_per_device",
                          "send"}
    plan = Plan.from_json_dict(d)
    plan.validate(24 + 2)
    # a synchronous plan's pipelines share the global batch; in outer mode each replica group's do
    for group in [g.pipelines for g in plan.groups] or [range(len(plan.pipelines))]:
        assert sum(plan.pipelines[k].micro_batch * plan.pipelines[k].num_micro_batches for k in group) \
            == plan.global_batch


def test_picture(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "7b", "--cluster", str(REPO / "examples/clusters/mixed-a100-v100.toml"),
                 "--picture", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_fits_nowhere_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "small.toml"
    small.write_text('[[group]]\nname = "t4"\ndevice = "T4"\ncount = 4\n')
    assert main(["plan", "--model", "70b", "--cluster", str(small), "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "needs" in err and "GB" in err and "offer" in err


def test_malformed_cluster_names_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[group]]\nname = "x"\ndevice = "A100"\ncount = 0\n')
    assert main(["plan", "--model", "350m", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:" in err and "'count'" in err


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt-9", "--cluster", str(EXAMPLES[0])]) == 2
    assert "unknown model preset" in capsys.readouterr().err
