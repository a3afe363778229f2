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


UNUSED = """
[[group]]
name = "a100"
device = "A100-80GB"
count = 16
gpus_per_node = 8
region = "lab"

[[group]]
name = "far"
device = "A100-80GB"
count = 8
gpus_per_node = 8
region = "lab"

[[group]]
name = "tiny"
device = "T4"
count = 1
gpus_per_node = 1
memory_gb = 0.5
region = "lab"

[[link]]
between = ["far", "a100"]
gbps = 0.0001

[[link]]
between = ["far", "tiny"]
gbps = 0.0001
"""


def test_unused_islands_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "unused.toml"
    cluster.write_text(UNUSED)
    assert main(["plan", "--model", "1.3b", "--cluster", str(cluster)]) == 0
    lines = capsys.readouterr().out.splitlines()
    unused = lines[lines.index("idle:") + 1:]
    far = next(line for line in unused if line.startswith("  far: idle, "))
    assert "links are too slow" in far and "0.0001 Gbit/s to a100" in far
    tiny = next(line for line in unused if line.startswith("  tiny: idle, "))
    assert "too little memory" in tiny


def test_the_plan_says_devices_for_cpus_and_leaves_out_mfu() -> None:
    from atoll.coordinator.planner.report import format_plan
    from atoll.plan import IslandInfo, PipelinePlan, Prediction, StagePlan

    plan = Plan(model="tiny", global_batch=16, seq_len=64, predicted=Prediction(step_time_s=0.1, tokens_per_s=1e4),
                islands=[IslandInfo(id="cpu0", device="EPYC", gpus=3)],
                pipelines=[PipelinePlan(micro_batch=8, num_micro_batches=2,
                                        stages=[StagePlan(island="cpu0", layers=(0, 6), dp=2)])])
    text = format_plan(plan, device_kinds={"cpu"})
    assert "2 of 3 CPUs" in text and "GPU" not in text and "MFU" not in text
    assert "cpu0: 2 of its 3 CPUs used; the plan found is faster with fewer" in text
    assert "2 of 3 devices" in format_plan(plan, device_kinds={"cpu", "cuda"})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_out_of_memory_hint_knows_the_dtype(dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = tmp_path / "small.toml"
    small.write_text('[[group]]\nname = "t4"\ndevice = "T4"\ncount = 4\n')
    assert main(["plan", "--model", "70b", "--cluster", str(small), "--global-batch", "8", "--dtype", dtype]) == 2
    err = capsys.readouterr().err
    assert "16-bit" not in err and "more T4" in err
    if dtype == "bf16":
        assert "already trains in bf16" in err
    else:
        assert "bf16 instead of fp32 would not fit either" in err


def test_picture_orders_islands_as_the_pipeline_runs(tmp_path: Path) -> None:
    from atoll.coordinator.planner.picture import draw_plan, pipeline_order
    from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes
    from atoll.plan import IslandInfo, PipelinePlan, Prediction, SendPlan, StagePlan

    # the file lists c, b, a (and an unused d); the pipeline runs a -> b -> c
    islands = [IslandInfo(id=i, device=dev, gpus=4) for i, dev in (("c", "L4"), ("d", "T4"), ("b", "A100"),
                                                                    ("a", "H100"))]
    stages = [StagePlan(island=i, layers=(k, k + 1), dp=4, send=SendPlan(codec="int8", bytes=1 << 20, seconds=0.01))
              for k, i in enumerate("abc")]
    stages[-1].send = None
    plan = Plan(model="m", global_batch=8, seq_len=16, predicted=Prediction(step_time_s=1.0, tokens_per_s=128.0),
                islands=islands, pipelines=[PipelinePlan(micro_batch=4, num_micro_batches=2, stages=stages)])
    assert [i.id for i in pipeline_order(plan)] == ["a", "b", "c", "d"]
    png = tmp_path / "order.png"
    times = PipelineTimes(stages=tuple(StageTimes(forward_s=0.1, backward_s=0.2) for _ in stages),
                          links=tuple(LinkTimes(forward_s=0.01, backward_s=0.01) for _ in stages[1:]),
                          num_micro_batches=2)
    draw_plan(plan, times, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_chain_never_crosses_two_regions_without_a_link(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's four-region cluster links us-east to ap only through others: planning 70b there once failed
    an assertion, the first (unbounded) chain placing a boundary on the missing link (`inf > inf` is false)."""
    assert main(["plan", "--model", "70b", "--cluster", str(REPO / "examples" / "clusters" / "four-regions.toml")]) == 0
    out = capsys.readouterr().out
    assert "plan for 70b" in out and "tokens/s" in out
