"""`atoll demo` as a newcomer runs it: any length of job, from any folder, run again, stopped by a signal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from atoll.coordinator.store import SqliteStore
from atoll.job import JobSpec
from atoll.launch.demo import _draw
from atoll.launch.localcluster import LocalCluster
from atoll.types import StepMetrics

REPO = Path(__file__).resolve().parent.parent
ATOLL = [sys.executable, "-m", "atoll"]


def test_losses_follow_a_job_longer_than_the_store_keeps(tmp_path: Path) -> None:
    """The coordinator's store keeps only its latest reports; asked often enough, the cluster has every step."""
    cluster = LocalCluster(job_path=tmp_path / "job.toml", out=tmp_path / "run")
    store = SqliteStore(cluster.state_db)
    store.recent_steps_kept = 50
    t = 1000.0
    try:
        for first in range(0, 160, 20):  # 40 reports (two nodes a step) between two looks, of 50 kept
            for step in range(first, first + 20):
                for node, loss in (("a", None), ("b", 10.0 - step / 100)):
                    t += 0.01
                    store.add_step(StepMetrics(job_id="j", node_id=node, plan_epoch=1, step=step, loss=loss,
                                               unix_time=t))
            cluster.losses()
        assert len(store.recent_steps(limit=1000)) == 50  # one look now would see 25 steps
    finally:
        store.close()
    losses = cluster.losses()
    assert sorted(losses) == list(range(160)) and losses[159] == pytest.approx(8.41)


def test_a_timed_out_wait_shows_the_end_of_every_log(tmp_path: Path) -> None:
    """A wait that times out (in CI, where the run's folder is gone afterwards) says what each process last
    logged, and whether it is still running."""
    cluster = LocalCluster(job_path=tmp_path / "job.toml", out=tmp_path / "run")
    cluster.out.mkdir(parents=True, exist_ok=True)
    (cluster.out / "a0.log").write_text("".join(f"line {i}\n" for i in range(20)) + "x" * 500 + "\n")
    cluster.procs["a0"] = subprocess.Popen([sys.executable, "-c", "pass"])
    cluster.procs["a0"].wait()
    cluster.procs["coordinator"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(AssertionError) as e:
            cluster.wait_status(lambda s: True, 0.0, "nothing", dead=frozenset())
    finally:
        cluster.procs["coordinator"].kill()
        cluster.procs["coordinator"].wait()
    text = str(e.value)
    assert "timed out after 0s waiting for nothing" in text
    assert "--- a0 (exited 0):" in text and "--- coordinator (running):" in text
    assert "line 13" in text and "line 12" not in text  # the last 8 lines
    assert "x" * 220 + " ..." in text and "x" * 221 not in text


def test_an_unfinished_run_still_gets_its_loss_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    _draw(job, {0: 5.0, 1: 4.5, 2: 4.0}, tmp_path, None, steps=1500, elapsed=61.0)
    out = capsys.readouterr().out
    assert "over 3 steps in 61 s" in out and (tmp_path / "loss.png").stat().st_size > 1000
    # a resumed run (2 steps reported before it) says its time of the steps it trained, not of the whole job's
    _draw(job, {0: 5.0, 1: 4.5, 2: 4.0}, tmp_path, None, steps=1500, elapsed=61.0, start=2)
    assert "over 3 steps, the last 1 of them in this run's 61 s" in capsys.readouterr().out


def _demo(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*ATOLL, "demo", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_demo_from_another_folder_then_again_with_an_edited_job(tmp_path: Path) -> None:
    first = _demo(tmp_path)  # the README's `atoll demo`, outside the checkout
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "over 100 steps" in first.stdout
    # the progress bar ends on the loss the summary prints
    summary = re.search(r"loss [0-9.]+ -> ([0-9.]+) over", first.stdout)
    bar = re.findall(r"loss=([0-9.]+)", first.stderr)
    assert summary and bar and bar[-1] == summary.group(1), (bar[-3:], first.stdout[-500:])
    assert (tmp_path / "runs" / "demo" / "loss.png").is_file() and (tmp_path / "runs" / "demo" / "plan.png").is_file()

    again = _demo(tmp_path, "--resume")
    assert again.returncode == 0 and "already finished its 100 steps" in again.stdout

    # the newcomer edits the job: a relative path, another job id; a plain re-run trains it afresh
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    (tmp_path / "mine.toml").write_text(replace(job, id="", train=replace(job.train, steps=30)).to_toml())
    edited = _demo(tmp_path, "--job", "mine.toml")
    assert edited.returncode == 0, edited.stdout[-2000:] + edited.stderr[-2000:]
    assert "runs/demo holds an earlier run" in edited.stdout and "over 30 steps" in edited.stdout
    assert "Traceback" not in edited.stderr


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sigterm_stops_the_coordinator_and_every_node(tmp_path: Path) -> None:
    demo = subprocess.Popen([*ATOLL, "demo", "--out", str(tmp_path / "run")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    children: list[psutil.Process] = []
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:  # the coordinator and three nodes
            children = psutil.Process(demo.pid).children(recursive=True)
            if len([c for c in children if "node" in c.cmdline()]) == 3:
                break
            assert demo.poll() is None, demo.stdout.read().decode() if demo.stdout else ""
            time.sleep(0.2)
        else:
            pytest.fail("the demo did not start three nodes within 120 s")
        time.sleep(1.0)  # let them get going: profiling, joining
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 128 + signal.SIGTERM
        output = demo.stdout.read().decode() if demo.stdout else ""
        assert "stopped by SIGTERM" in output
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [c.cmdline() for c in alive]
    finally:
        for proc in [demo, *children]:  # whatever a failure left behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        demo.wait(10)



@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_demo_follows_atoll_job_extend_and_stop(tmp_path: Path) -> None:
    """`atoll job extend` and `stop`, given with the flags the demo prints, move the end the demo's bar runs to: it
    ends when the coordinator says the job is finished, not at the spec's step count, and not after a stall."""
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    (tmp_path / "long.toml").write_text(replace(job, id="", train=replace(job.train, steps=3000)).to_toml())
    demo = subprocess.Popen([*ATOLL, "demo", "--job", "long.toml", "--out", "run", "--stall-timeout", "60"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert demo.stdout is not None
        line = ""
        while "from another terminal: atoll status" not in line:
            line = demo.stdout.readline()
            assert line, "the demo ended before it said how to reach its coordinator"
        flags = line.split("atoll status ", 1)[1].split(" (", 1)[0].split()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:  # some steps trained
            status = subprocess.run([*ATOLL, "status", *flags, "--json"], cwd=tmp_path, capture_output=True,
                                    text=True, timeout=60)
            if status.returncode == 0 and json.loads(status.stdout)["step"] >= 20:
                break
            time.sleep(1.0)
        else:
            pytest.fail("the demo's job did not reach step 20")
        ext = subprocess.run([*ATOLL, "job", "extend", "--steps", "500", *flags], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert ext.returncode == 0 and "ends after step 3499" in ext.stdout, ext.stdout + ext.stderr
        stop = subprocess.run([*ATOLL, "job", "stop", *flags], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
        assert stop.returncode == 0, stop.stderr
        end = int(re.search(r"after step (\d+)", stop.stdout)[1]) + 1
        out, _ = demo.communicate(timeout=120)
        assert demo.returncode == 0, out[-2000:]
        assert f"over {end} steps" in out and "no step finished in" not in out, out[-2000:]  # (not the stall-timeout error)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
