"""`atoll plan` refuses bad input in one line naming the file, the table or flag, the field and the value, before it
plans: numbers that are not finite, sizes beyond stated limits, tables of the wrong shape, profiles the cluster would
ignore, output paths that cannot be written, sequence lengths the model does not allow, and files that are not text."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from atoll.coordinator.planner.catalog import device
from atoll.coordinator.planner.cluster import (MAX_CLUSTER_GPUS, ClusterFileError, Island, load_cluster,
                                               parse_cluster)
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.launch.cli import main

REPO = Path(__file__).resolve().parent.parent
MIXED = REPO / "examples" / "clusters" / "mixed-a100-v100.toml"  # groups of A100-80GB and V100-32GB
GROUP = '[[group]]\nname = "g"\ndevice = "A100-80GB"\ncount = 8\n'
TWO_REGIONS = ('[[group]]\nname = "a"\ndevice = "A100-80GB"\ncount = 8\nregion = "r1"\n\n'
               '[[group]]\nname = "b"\ndevice = "A100-80GB"\ncount = 8\nregion = "r2"\n\n')
POINT = {"micro_batch": 4, "seq_len": 64, "forward_s": 0.001, "backward_s": 0.002}


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `atoll plan` with `argv`, expect the exit status of bad input and no traceback; the error text."""
    assert main(["plan", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def _argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", "--cluster", str(MIXED), *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


# --- 1. numbers must be finite ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "field", "shown"), [
    ("memory_gb = nan", "memory_gb", "nan"),
    ("inter_node_gbps = nan", "inter_node_gbps", "nan"),
    ("intra_node_gbps = -inf", "intra_node_gbps", "-inf"),
    ("inter_node_gbps = 1e400", "inter_node_gbps", "inf"),
    ("tflops = inf", "tflops", "inf"),
    ("latency_ms = nan", "latency_ms", "nan"),
    ("latency_ms = inf", "latency_ms", "inf"),
    ("memory_gbps = nan", "memory_gbps", "nan"),
])
def test_group_numbers_must_be_finite(line: str, field: str, shown: str) -> None:
    text = GROUP + line + "\n"
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(text, "c.toml")
    msg = str(e.value)
    assert msg.startswith("c.toml:5: [[group]] #1 'g': ") and f"field {field!r}" in msg, msg
    assert "finite" in msg and f"got {shown}" in msg, msg


@pytest.mark.parametrize(("line", "field", "shown"), [
    ("gbps = nan", "gbps", "nan"),
    ("gbps = inf", "gbps", "inf"),
    ("gbps = 1\nlatency_ms = nan", "latency_ms", "nan"),
    ("gbps = 1\nlatency_ms = inf", "latency_ms", "inf"),
])
def test_link_numbers_must_be_finite(line: str, field: str, shown: str) -> None:
    text = TWO_REGIONS + '[[link]]\nbetween = ["r1", "r2"]\n' + line + "\n"
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(text, "c.toml")
    msg = str(e.value)
    line_no = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith(field))
    assert msg.startswith(f"c.toml:{line_no}: [[link]] #1: field {field!r}"), msg
    assert "finite" in msg and f"got {shown}" in msg, msg


def test_an_island_refuses_bandwidths_and_latencies_that_are_not_finite() -> None:
    spec = device("A100-80GB")
    for bad in ({"inter_node_bandwidth": math.nan}, {"intra_node_bandwidth": math.inf}, {"latency_s": math.nan}):
        with pytest.raises(ValueError, match="finite"):
            Island(id="i", group="i", device=spec, gpus=8, **bad)


def test_a_nan_in_a_cluster_file_never_reaches_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "memnan.toml"
    path.write_text(GROUP + "memory_gb = nan\n")
    err = _plan(["--cluster", str(path)], capsys)
    assert f"{path}:5:" in err and "'memory_gb'" in err and "got nan" in err


# --- 2. stated limits -------------------------------------------------------------------------------------------------

def test_a_cluster_file_describes_at_most_a_million_gpus() -> None:
    assert parse_cluster(GROUP.replace("count = 8", f"count = {MAX_CLUSTER_GPUS}")).total_gpus == MAX_CLUSTER_GPUS
    with pytest.raises(ClusterFileError, match=r"c.toml:4: .*'count' is 100,000,000,000, more than the 1,000,000"):
        parse_cluster(GROUP.replace("count = 8", "count = 100000000000"), "c.toml")
    two = GROUP.replace("count = 8", "count = 600000") + GROUP.replace('"g"', '"h"').replace("count = 8", "count = 600000")
    with pytest.raises(ClusterFileError, match=r"c.toml:8: \[\[group\]\] #2 'h': field 'count' brings the file to "
                                               r"1,200,000 GPUs, more than the 1,000,000"):
        parse_cluster(two, "c.toml")


@pytest.mark.parametrize(("argv", "said"), [
    (["--global-batch", "100000000000"], "argument --global-batch: must be a number of sequences from 1 to 16,777,216"),
    (["--global-batch", "0"], "argument --global-batch: must be a number of sequences from 1"),
    (["--global-batch", "many"], "argument --global-batch: must be a number of sequences, got 'many'"),
    (["--inner-steps", "-1"], "argument --inner-steps: must be a number of steps from 0"),
    (["--topk-fraction", "nan"], "argument --topk-fraction: must be a fraction greater than 0 and at most 1"),
])
def test_flags_out_of_range_are_argparse_errors(argv: list[str], said: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert said in _argparse_error(argv, capsys)


# --- 3. tables of the wrong shape -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "said"), [
    ("group = [1, 2]\n", "c.toml:1: group = [...] holds 1, not a table; write a [[group]] table"),
    ("group = 5\n", "c.toml:1: group = 5 is not a table; write a [[group]] table"),
    ('[group]\nname = "a"\ndevice = "A100-80GB"\ncount = 8\n',
     "c.toml:1: [group] is a single table; write [[group]] (double brackets: an array of tables)"),
    ("link = [1]\n" + GROUP, "c.toml:1: link = [...] holds 1, not a table; write a [[link]] table"),
    (TWO_REGIONS + '[link]\nbetween = ["r1", "r2"]\ngbps = 1\n',
     "c.toml:13: [link] is a single table; write [[link]] (double brackets"),
])
def test_tables_of_the_wrong_shape_say_how_to_write_them(text: str, said: str) -> None:
    with pytest.raises(ClusterFileError) as e:
        parse_cluster(text, "c.toml")
    assert str(e.value).startswith(said), str(e.value)


def test_wrong_shapes_print_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for k, text in enumerate(("group = [1, 2]\n", "link = [1]\n" + GROUP)):
        path = tmp_path / f"shape{k}.toml"
        path.write_text(text)
        assert "not a table" in _plan(["--cluster", str(path)], capsys)


# --- 4. profiles --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "said"), [
    ('{"devices": {"A100-80GB": {"layers": {"block": [{"micro_batch": 4, "seq_len": 64, "forward_s": NaN, '
     '"backward_s": 0.002}]}}}}', "devices.A100-80GB.layers.block[0].forward_s: seconds, a finite number >= 0, got nan"),
    ('{"devices": {"A100-80GB": {"layers": {"block": [{"micro_batch": 4, "seq_len": 64, "forward_s": 0.001, '
     '"backward_s": Infinity}]}}}}', "layers.block[0].backward_s: seconds, a finite number >= 0, got inf"),
    ('{"devices": {"A100-80GB": {"layers": [1]}}}', "devices.A100-80GB.layers: expected an object of layer kind"),
    ('{"devices": {"A100-80GB": {"layerz": {}}}}',
     "devices.A100-80GB: unknown key 'layerz'; allowed keys: layers, optimizer_s_per_gparam"),
    ('{"devices": {"A100-80GB": {"layers": {"block": [{"micro_batch": 4, "seq_len": 64, "forward_s": 0.001, '
     '"backward_s": 0.002, "fwd": 1}]}}}}', "layers.block[0]: unknown key 'fwd'; allowed keys: micro_batch"),
    ('{"devices": {"A100-80GB": {"layers": {"block": [{"micro_batch": 1e30, "seq_len": 64, "forward_s": 0.001, '
     '"backward_s": 0.002}]}}}}', "micro_batch: a whole number from 1 to 16,777,216, got 1e+30"),
    ('{"devices": {"A100-80GB": {"optimizer_s_per_gparam": Infinity}}}', "optimizer_s_per_gparam: seconds per"),
    ('{"devices": {"A100-80GB": {}, "a100-80gb": {}}}', "devices.a100-80gb repeats devices.A100-80GB"),
    ('{"devices": {}}', '"devices" is empty'),
    ('{"devices": {"A100-80GB": {}}, "version": 2}', "unknown key 'version'"),
    ('{"devices": {"Z9000": {"layers": {"block": [' + json.dumps(POINT) + ']}}}}',
     "devices.Z9000 matches no device of the cluster (its devices: A100-80GB, V100-32GB; keys are case-insensitive)"),
])
def test_bad_profiles_are_refused_naming_the_key(text: str, said: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        ProfileSet.load(path, known=["A100-80GB", "V100-32GB"])
    assert str(e.value).startswith(f"{path}: ") and said in str(e.value), str(e.value)
    assert said in _plan(["--cluster", str(MIXED), "--profiles", str(path)], capsys)


def test_profiles_keys_match_the_cluster_case_insensitively(tmp_path: Path) -> None:
    doc = {"devices": {"a100-80gb": {"layers": {"block": [POINT]}, "optimizer_s_per_gparam": 0.01}}}
    ps = ProfileSet.from_dict(doc, known=["A100-80GB"])
    assert ps.get("A100-80GB") is not None and ps.get("A100-80GB").optimizer_s_per_gparam == 0.01
    assert ProfileSet.from_dict({"devices": {"Z9000": {}}}).get("z9000") is not None  # no cluster given: any key


# --- 5. output paths, checked before the search ------------------------------------------------------------------------

@pytest.fixture
def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """`atoll plan` must fail before it searches."""
    def search(*_a: object, **_k: object) -> None:
        raise AssertionError("planned before checking the output paths")
    monkeypatch.setattr("atoll.coordinator.planner.planjob.search_plan", search)


@pytest.mark.parametrize("flag", ["--json", "--picture"])
def test_an_output_path_that_is_a_folder_fails_before_planning(flag: str, tmp_path: Path, no_search: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    err = _plan(["--cluster", str(MIXED), flag, str(tmp_path)], capsys)
    assert f"{flag} {tmp_path} is a folder; give a file name" in err


def test_an_output_path_under_a_file_fails_before_planning(tmp_path: Path, no_search: None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    for given in (tmp_path / "afile" / "p.json", tmp_path / "afile" / "deeper" / "p.json"):
        err = _plan(["--cluster", str(MIXED), "--json", str(given)], capsys)
        assert f"--json {given}: {tmp_path / 'afile'} is a file, not a folder" in err


def test_empty_and_clashing_output_paths_fail_before_planning(tmp_path: Path, no_search: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert "--json: the file name is empty" in _plan(["--cluster", str(MIXED), "--json="], capsys)
    same = str(tmp_path / "x")
    assert "--json and --picture both name" in _plan(["--cluster", str(MIXED), "--json", same, "--picture", same],
                                                    capsys)


def test_an_unwritable_folder_fails_before_planning(tmp_path: Path, no_search: None, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)  # (root may write anywhere: pretend it may not)
    err = _plan(["--cluster", str(MIXED), "--json", str(tmp_path / "new" / "p.json")], capsys)
    assert f"cannot write in {tmp_path}; give another path" in err


def test_good_output_paths_are_written_with_their_folders(tmp_path: Path) -> None:
    out = tmp_path / "new" / "plan.json"
    assert main(["plan", "--model", "tiny", "--cluster", str(MIXED), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model"]


# --- 6. sequence length -------------------------------------------------------------------------------------------

def test_seq_len_beyond_the_models_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _plan(["--cluster", str(MIXED), "--seq-len", "100000"], capsys)
    assert "--seq-len (100000) exceeds the model's seq_len (64); lower --seq-len" in err


@pytest.mark.parametrize("value", ["0", "-3", "long"])
def test_seq_len_must_be_a_positive_whole_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --seq-len: must be" in _argparse_error(["--seq-len", value], capsys)


def test_seq_len_up_to_the_models_plans(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny", "--cluster", str(MIXED), "--seq-len", "32"]) == 0
    assert "tokens/s" in capsys.readouterr().out


# --- 7. values that contradict each other --------------------------------------------------------------------------

def test_two_links_between_the_same_pair_name_both() -> None:
    text = (TWO_REGIONS + '[[link]]\nbetween = ["r1", "r2"]\ngbps = 1\n\n'
            '[[link]]\nbetween = ["r2", "r1"]\ngbps = 50\n')
    with pytest.raises(ClusterFileError, match=r"c.toml:18: \[\[link\]\] #2: field 'between' repeats \[\[link\]\] #1 "
                                               r"\(line 13\) between 'r2' and 'r1'; give each pair one"):
        parse_cluster(text, "c.toml")


@pytest.mark.parametrize(("ends", "hint"), [('["g", "g"]', "inside a group"), ('["default", "default"]',
                                                                             "inside a region")])
def test_a_link_from_a_name_to_itself_is_refused(ends: str, hint: str) -> None:
    with pytest.raises(ClusterFileError, match=rf"c.toml:6: \[\[link\]\] #1: field 'between' names .* twice.*{hint}"):
        parse_cluster(GROUP + f"[[link]]\nbetween = {ends}\ngbps = 1\n", "c.toml")


def test_more_gpus_per_node_than_the_group_holds_is_read_as_its_count_with_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = GROUP.replace("count = 8", "count = 4") + "gpus_per_node = 8\n"
    cluster = parse_cluster(text, "c.toml")
    assert cluster.islands[0].gpus_per_node == 4 and len(cluster.islands[0].nodes) == 1
    assert cluster.notes == ("c.toml:5: [[group]] #1 'g': field 'gpus_per_node' is 8, more than the group's count (4): "
                             "read as gpus_per_node = 4, all of its GPUs on one node; write that to silence this note",)
    assert not parse_cluster(GROUP).notes
    path = tmp_path / "small.toml"
    path.write_text(text)
    assert main(["plan", "--model", "tiny", "--cluster", str(path)]) == 0
    assert f"note: {path}:5:" in capsys.readouterr().out


# --- 8. files that are not cluster files ---------------------------------------------------------------------------

def test_a_cluster_file_that_is_not_utf8_is_named_with_its_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(GROUP.encode() + b'region = "\xff"\n')
    with pytest.raises(ClusterFileError, match=rf"cluster file {path} is not UTF-8 text \(.*line 5: 0xff\); save it as UTF-8"):
        load_cluster(path)
    assert "not UTF-8" in _plan(["--cluster", str(path)], capsys)


def test_a_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GROUP.encode())
    assert load_cluster(path).total_gpus == 8


def test_a_folder_or_an_empty_name_is_not_a_cluster_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.toml").write_text(GROUP)
    with pytest.raises(IsADirectoryError, match=r"is a folder, not a file \(it holds a.toml\); name a cluster file"):
        load_cluster(tmp_path)
    with pytest.raises(ClusterFileError, match="the file name is empty"):
        load_cluster("")
    assert f"cluster file {tmp_path} is a folder" in _plan(["--cluster", str(tmp_path)], capsys)
    assert "--cluster: the file name is empty" in _plan(["--cluster", ""], capsys)


def test_profile_files_that_are_folders_or_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"profile file {tmp_path} is a folder" in _plan(["--cluster", str(MIXED), "--profiles", str(tmp_path)],
                                                           capsys)
    path = tmp_path / "p.json"
    path.write_bytes(b'{"devices": "\xff"}')
    assert f"profile file {path} is not UTF-8 text" in _plan(["--cluster", str(MIXED), "--profiles", str(path)], capsys)


def test_a_model_that_fits_only_on_paper_is_told_to_add_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """70b on the consumer-mix example: its states fit the cluster's memory in sum (88%), yet no layout does; the
    message says there is too little room and how many devices would give it, not to change a batch that
    divides already."""
    assert main(["plan", "--model", "70b", "--cluster", str(REPO / "examples" / "clusters" / "consumer-mix.toml")]) != 0
    err = capsys.readouterr().err
    assert "too little room" in err and "add GPUs (about" in err and "divisible" not in err, err
