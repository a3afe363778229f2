"""Bad command-line input ends in one line saying what to change: flags checked as argparse reads them, addresses,
output paths and TLS files checked before anything starts, and what a failed call to a coordinator found."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest
from cryptography import x509

from atoll.argtypes import count, number, seconds
from atoll.launch.cli import main
from atoll.preflight import SetupError, check_dial_address, check_listen, check_output_file, check_tls_pair
from atoll.tls import cert_to_pem, key_to_pem, new_key, self_signed

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text", ["-5", "0", "nan", "inf", "1e300", "soon"])
def test_a_wait_must_be_a_positive_finite_number_of_seconds(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="seconds|number"):
        seconds()(text)
    assert seconds()("2.5") == 2.5 and seconds(positive=False)("0") == 0.0


def test_numbers_and_counts_keep_to_their_bounds() -> None:
    assert number(above=0, most=1)("1") == 1.0
    for bad in ("0", "1.5", "nan", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="a fraction"):
            number(above=0, most=1, what="a fraction")(bad)
    assert count(least=257, most=1000)("300") == 300
    for bad in ("256", "1001", "3.5", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            count(least=257, most=1000)(bad)


@pytest.mark.parametrize(("argv", "said"), [
    (["coordinator", "--job", "examples/tiny.toml", "--lease", "-5"], "argument --lease: must be a positive number"),
    (["coordinator", "--job", "examples/tiny.toml", "--lease", "1e300"], "argument --lease: must be at most"),
    (["coordinator", "--job", "examples/tiny.toml", "--island-threshold", "5"], "argument --island-threshold"),
    (["coordinator", "--job", "examples/tiny.toml", "--drift-every", "nan"], "argument --drift-every"),
    (["node", "--coordinator", "h:1", "--profile-seconds", "-1"], "argument --profile-seconds"),
    (["job", "extend", "--steps", "99999999999999999999", "--coordinator", "h:1"], "argument --steps"),
    (["tokenizer", "train", "--corpus", "x", "--vocab-size", "100000000000", "--out", "t.json"],
     "argument --vocab-size: must be a vocabulary size from 257"),
    (["export", "--checkpoint-dir", "c", "--step", "1", "--out", "o", "--shard-size", "-1"], "a size in GiB"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv: list[str], said: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_listen_addresses_are_checked_at_port_0_too() -> None:
    check_listen("127.0.0.1:0", "--listen")
    check_listen("[::1]:0", "--listen") if socket.has_ipv6 else None
    with pytest.raises(SetupError, match="cannot listen there"):
        check_listen("192.0.2.1:0", "--listen")  # TEST-NET-1: never an address of this machine
    with pytest.raises(SetupError, match="has no host"):
        check_listen(":7070", "--listen")
    with pytest.raises(SetupError, match=r"in brackets, e.g. \[::1\]:7071"):
        check_listen("::1:7071", "--listen")


def test_an_address_to_dial_is_host_port_and_no_wildcard() -> None:
    check_dial_address("10.0.0.5:7070", "--coordinator")
    check_dial_address("[fe80::1]:7070", "--coordinator")
    for bad, said in (("garbage", "is not HOST:PORT"), ("h:99999", "1-65535"), ("h:0", "1-65535"),
                      ("0.0.0.0:7070", "wildcard"), ("fe80::1:7070", "brackets")):
        with pytest.raises(SetupError, match=said):
            check_dial_address(bad, "--coordinator")


def test_output_paths_are_checked_before_the_work(tmp_path: Path) -> None:
    check_output_file(tmp_path / "new" / "deeper" / "plan.json", "--json")  # folders are made later
    with pytest.raises(SetupError, match="is a folder"):
        check_output_file(tmp_path, "--json")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SetupError, match="is a file, not a folder"):
        check_output_file(tmp_path / "afile" / "p.json", "--json")


def test_a_tls_pair_must_parse_and_belong_together(tmp_path: Path) -> None:
    key, other = new_key(), new_key()
    (tmp_path / "cert.pem").write_bytes(cert_to_pem(self_signed(key, "coordinator")))
    (tmp_path / "key.pem").write_bytes(key_to_pem(key))
    (tmp_path / "other.pem").write_bytes(key_to_pem(other))
    check_tls_pair(tmp_path / "cert.pem", tmp_path / "key.pem")
    with pytest.raises(SetupError, match="is not the key of --tls-cert"):
        check_tls_pair(tmp_path / "cert.pem", tmp_path / "other.pem")
    with pytest.raises(SetupError, match="holds no PEM certificate"):
        check_tls_pair(tmp_path / "key.pem", tmp_path / "key.pem")
    with pytest.raises(SetupError, match="not an unencrypted PEM private key"):
        check_tls_pair(tmp_path / "cert.pem", tmp_path / "cert.pem")


def _coordinator(tmp_path: Path, *extra: str) -> list[str]:
    return ["coordinator", "--job", str(ROOT / "examples" / "tiny.toml"), "--state-dir", str(tmp_path / "st"),
            "--listen", "127.0.0.1:0", "--insecure", *extra]


@pytest.mark.parametrize(("extra", "said"), [
    (["--rendezvous-host", "192.0.2.1"], "--rendezvous-host"),
    (["--metrics-port", "0", "--metrics-host", "192.0.2.1"], "--metrics-host/--metrics-port"),
    (["--address-file", "/"], "--address-file / is a folder"),
    (["--tls-cert", "README.md"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "README.md", "--tls-key", "README.md"], "holds no PEM certificate"),
])
def test_the_coordinator_refuses_a_bad_setup_in_one_line_before_it_serves(
        tmp_path: Path, extra: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_coordinator(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_an_empty_kept_token_is_named_not_taken_for_no_token(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "token").write_text("\n")
    assert main(_coordinator(tmp_path)) == 2
    assert "token is empty: delete it" in capsys.readouterr().err


def test_a_damaged_server_key_is_made_again_under_the_job_ca(tmp_path: Path) -> None:
    from atoll.coordinator.ca import SERVER_KEY, JobAuthority

    first = JobAuthority.load_or_create(tmp_path)
    first.close()
    (tmp_path / SERVER_KEY).write_text("not a key")
    again = JobAuthority.load_or_create(tmp_path)
    try:
        assert again.ca.cert_pem == first.ca.cert_pem and again.server.key_pem != b"not a key"
        assert again.ca.issued(x509.load_pem_x509_certificate(again.server.cert_pem))
    finally:
        again.close()


def test_a_node_says_a_malformed_coordinator_or_device_at_once(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    base = ["node", "--insecure", "--token", "t", "--state-dir", str(tmp_path / "n")]
    assert main([*base, "--coordinator", "garbage"]) == 2
    assert main([*base, "--coordinator", "127.0.0.1:7070", "--device", "gpu"]) == 2
    assert main([*base, "--coordinator", "127.0.0.1:7070", "--advertise", "0.0.0.0:5000"]) == 2
    err = capsys.readouterr().err
    assert "'garbage' is not HOST:PORT" in err and "--device 'gpu'" in err and "wildcard" in err


def test_status_answers_a_bad_timeout_as_its_other_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked by the command rather than argparse, so that with --json it is JSON too."""
    assert main(["status", "--coordinator", "h:1", "--token", "t", "--timeout", "inf"]) == 2
    assert "--timeout takes a positive number of seconds" in capsys.readouterr().err
    assert main(["status", "--coordinator", "h:1", "--token", "t", "--timeout", "nan", "--json"]) == 2
    assert "--timeout" in capsys.readouterr().out


def test_status_against_nothing_says_what_it_found() -> None:
    from datetime import timedelta

    from atoll.coordinator.status import fetch_status

    with pytest.raises(SetupError, match="is not HOST:PORT"):
        fetch_status("garbage", token="t")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="refuses connections"):
        fetch_status(f"127.0.0.1:{port}", token="t", timeout=timedelta(seconds=30), say=said.append)
    # nothing listens there: said at once, without waiting out the timeout (a refusal answers in milliseconds;
    # 10 s is far under the 30 s timeout the old code waited)
    assert time.monotonic() - started < 10 and not said, said


def test_written_files_take_the_umask_and_secrets_are_owner_only_from_the_first_byte(tmp_path: Path) -> None:
    import os
    import stat

    from atoll.fsutil import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "plan.json", "{}")
        atomic_write_text(tmp_path / "token", "s3cret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o644  # as `open` would make it
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600


def test_export_and_tokenizer_name_what_the_user_typed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing checkpoint folder is named as missing (not "steps there: none"); the tokenizer's data messages
    name --field, the flag given, not the job spec's [data] field."""
    assert main(["export", "--checkpoint-dir", str(tmp_path / "nowhere"), "--step", "5",
                 "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err
    assert "no checkpoint folder" in err and "--checkpoint-dir" in err and "steps there" not in err, err
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"body": "hello world"}\n{"body": "more text"}\n')
    assert main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "300",
                 "--out", str(tmp_path / "t.json")]) != 0
    err = capsys.readouterr().err
    assert "--field 'text' is not in the first row" in err and "give --field the key" in err, err
    assert "[data]" not in err, err


def test_a_node_without_a_job_ca_is_told_of_tls_ca_and_ca_hash(tmp_path: Path) -> None:
    from atoll.tls import find_ca

    (tmp_path / "token").write_text("t")
    with pytest.raises(FileNotFoundError, match="--tls-ca") as status:
        find_ca(None, tmp_path / "token")
    assert "--ca-hash" not in str(status.value)  # atoll status and atoll job take no --ca-hash
    with pytest.raises(FileNotFoundError, match="--ca-hash with the fingerprint the coordinator logs"):
        find_ca(None, tmp_path / "token", ca_hash_flag=True)


def test_a_setup_mistake_leaves_no_empty_folders(tmp_path: Path) -> None:
    from atoll.launch.cli import main

    job = str(Path(__file__).resolve().parents[1] / "examples" / "tiny.toml")
    assert main(["coordinator", "--job", job, "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "coord"),
                 "--token-file", str(tmp_path / "missing-token")]) == 2
    (tmp_path / "token").write_text("t")
    assert main(["node", "--coordinator", "127.0.0.1:7070", "--token-file", str(tmp_path / "token"), "--device",
                 "cuda:7", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "node"), "--checkpoint-dir",
                 str(tmp_path / "ckpt")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]
