"""Cluster files: the shipped examples parse; malformed ones fail naming the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator.planner.catalog import CATALOG, device
from atoll.coordinator.planner.cluster import GBPS, ClusterFileError, load_cluster, parse_cluster

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples" / "clusters").glob("*.toml"))

GOOD = """\
[[group]]
name = "a100-east"
device = "A100-80GB"
count = 32
gpus_per_node = 8
region = "us-east"
intra_node_gbps = 600
inter_node_gbps = 100

[[group]]
name = "v100-east"
device = "V100"
count = 16
region = "us-east"
inter_node_gbps = 50

[[group]]
name = "custom-west"
tflops = 200
memory_gb = 48
count = 8
region = "eu-west"

[[link]]
between = ["us-east", "eu-west"]
gbps = 1.0
latency_ms = 80
"""


def test_examples_parse() -> None:
    assert len(EXAMPLES) >= 3
    for path in EXAMPLES:
        c = load_cluster(path)
        assert c.total_gpus > 0 and c.islands


def test_good_file() -> None:
    c = parse_cluster(GOOD, "good.toml")
    a, v, w = c.islands
    assert (a.gpus, a.gpus_per_node, a.device.memory_gb, a.region) == (32, 8, 80, "us-east")
    assert v.device.name == "V100-32GB" and w.device.tflops_16 == 200 and w.device.memory_gb == 48
    assert len(a.nodes) == 4
    # same region, no [[link]]: the smaller inter-node bandwidth, per node
    same = c.link("a100-east", "v100-east")
    assert same is not None and same.bandwidth == 50 * GBPS and not same.shared
    # across regions: the [[link]], a shared capacity
    wan = c.link("v100-east", "custom-west")
    assert wan is not None and wan.bandwidth == 1.0 * GBPS and wan.latency_s == pytest.approx(0.08) and wan.shared


def test_regions_without_a_link_are_not_connected() -> None:
    text = GOOD.split("[[link]]")[0]
    assert parse_cluster(text).link("a100-east", "custom-west") is None


def _line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize("old,new,field", [
    ('count = 16', 'count = -3', "count"),
    ('count = 16', 'count = "many"', "count"),
    ('device = "V100"', 'device = "Z9000"', "device"),
    ('inter_node_gbps = 50', 'inter_node_gbps = 0', "inter_node_gbps"),
    ('inter_node_gbps = 50', 'inter_nod_gbps = 50', "inter_nod_gbps"),
    ('region = "us-east"\ninter_node_gbps = 50', 'region = ""\ninter_node_gbps = 50', "region"),
])
def test_bad_group_field_names_line_group_and_field(old: str, new: str, field: str) -> None:
    assert old in GOOD
    text = GOOD.replace(old, new, 1) if old != 'count = 16' else GOOD.replace("count = 16", new)
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(text, "bad.toml")
    msg = str(e.value)
    line = _line_of(text, new.splitlines()[0])
    assert msg.startswith(f"bad.toml:{line}:"), msg
    assert f"field {field!r}" in msg
    assert "[[group]] #2 'v100-east'" in msg or field == "region"


def test_missing_field_points_at_the_group() -> None:
    text = GOOD.replace('count = 8\n', '')
    with pytest.raises(ClusterFileError, match=r"bad.toml:\d+: \[\[group\]\] #3 'custom-west': field 'count' must be"):
        parse_cluster(text, "bad.toml")
    text = GOOD.replace('tflops = 200\n', '')
    with pytest.raises(ClusterFileError, match=r"field 'device' is missing"):
        parse_cluster(text, "bad.toml")


def test_duplicate_group_names() -> None:
    text = GOOD.replace('name = "v100-east"', 'name = "a100-east"')
    second = [n for n, line in enumerate(text.splitlines(), 1) if line == 'name = "a100-east"'][1]
    with pytest.raises(ClusterFileError, match=rf"bad.toml:{second}: \[\[group\]\] #2: .*repeats"):
        parse_cluster(text, "bad.toml")


@pytest.mark.parametrize("old,new,field", [
    ('between = ["us-east", "eu-west"]', 'between = ["us-east", "mars"]', "between"),
    ('between = ["us-east", "eu-west"]', 'between = "us-east"', "between"),
    ('gbps = 1.0', 'gbps = -1', "gbps"),
    ('latency_ms = 80', 'latency = 80', "latency"),
])
def test_bad_link_names_line_and_field(old: str, new: str, field: str) -> None:
    text = GOOD.replace(old, new)
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(text, "bad.toml")
    msg = str(e.value)
    assert msg.startswith(f"bad.toml:{_line_of(text, new)}: [[link]] #1: field {field!r}"), msg


def test_toml_syntax_error_names_the_line() -> None:
    text = GOOD.replace('count = 32', 'count = = 32')
    with pytest.raises(ClusterFileError, match=r"bad.toml: not valid TOML: .*line 4"):
        parse_cluster(text, "bad.toml")


def test_empty_and_unknown_tables() -> None:
    with pytest.raises(ClusterFileError, match="no \\[\\[group\\]\\]"):
        parse_cluster("", "e.toml")
    with pytest.raises(ClusterFileError, match="unknown table"):
        parse_cluster(GOOD + "\n[train]\nbatch = 3\n", "e.toml")


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_cluster("/nonexistent/cluster.toml")


def test_catalog_covers_the_issue_list_and_states_sources() -> None:
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "A10", "L4", "L40S", "V100", "T4", "RTX3090", "RTX 4090"):
        d = device(name)
        assert d.tflops_16 > 0 and d.memory_gb > 0 and d.source
    assert all(d.source for d in CATALOG.values())
    with pytest.raises(ValueError, match="unknown device"):
        device("TPUv9")
