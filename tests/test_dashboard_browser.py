"""The dashboard in a real browser: a coordinator and two nodes as processes on loopback, the page in headless
Chromium (Playwright driving the system's `chromium`, which .ci/run installs).

One cluster serves the module's tests, in order: the page refuses without a token; it shows the right counts;
its loss chart grows; a killed node and the replan that follows reach the page within 2 s of the coordinator's
status (bounded at 3x that, for a loaded machine; the figure is printed).
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from atoll.job import JobSpec
from atoll.launch.localcluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent
UPDATE_BOUND_S = 3 * 2.0
"""The issue's 2 s with the 3x margin of tests on a loaded machine."""

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=100_000, warmup=5),
                  checkpoint=replace(job.checkpoint, interval=0),
                  cluster=replace(job.cluster, expected_nodes=2, min_nodes=1),
                  outer=replace(job.outer, mode="sync"))
    (tmp / "job.toml").write_text(job.to_toml())
    with LocalCluster(job_path=tmp / "job.toml", out=tmp / "run", profile_seconds=1.0) as c:
        c.start_coordinator(extra=["--dashboard-port", "0", "--lease", "4", "--join-settle", "1",
                                   "--island-threshold", "0.001"])
        for i, region in enumerate(["lab-a", "lab-b"]):
            c.start_node(f"node{i + 1}", region=region)
        c.wait_status(lambda s: s.plan.epoch >= 1 and sum(m.state == "alive" for m in s.members) == 2, 120,
                      "a plan of both nodes")
        log = (tmp / "run" / "coordinator.log").read_text()
        c.dashboard_url = re.search(r"dashboard on (http://\S+/)", log).group(1)
        yield c


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, cluster):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(cluster.dashboard_url + f"?token={cluster.token}")
    page.wait_for_function("document.getElementById('count-members').textContent !== '-'", timeout=15_000)
    return page


def test_page_refuses_without_its_token(browser, cluster) -> None:
    page = browser.new_page()
    r = page.goto(cluster.dashboard_url)
    assert r.status == 401 and page.locator("input[name=token]").count() == 1
    assert page.request.get(cluster.dashboard_url + "api/snapshot").status == 401
    page.fill("input[name=token]", cluster.token + "-wrong")
    page.click("button[type=submit]")
    assert "opens no dashboard" in page.text_content("#login-error")
    page.fill("input[name=token]", cluster.token)  # the form sets the cookie the page's own calls then carry
    page.click("button[type=submit]")
    page.wait_for_function("document.getElementById('count-members').textContent === '2'", timeout=15_000)
    page.close()


def test_counts_and_the_loss_chart_grows(browser, cluster) -> None:
    page = _open(browser, cluster)
    status = cluster.status()
    assert page.text_content("#count-members") == str(len(status.members)) == "2"
    assert page.text_content("#count-alive") == "2"
    assert page.text_content("#count-regions") == "2"  # lab-a and lab-b
    assert page.locator("#map-svg .island").count() == len(status.islands)
    page.click("nav a[data-view=plan]")
    assert page.text_content("#plan-epoch") == str(status.plan.epoch)
    assert page.locator(".stage").count() == sum(len(p.stages) for p in status.plan.pipelines)
    page.click("nav a[data-view=training]")
    page.wait_for_function("Number(document.getElementById('loss-chart').dataset.points) > 0", timeout=60_000)
    first = int(page.get_attribute("#loss-chart", "data-points"))
    page.wait_for_function(f"Number(document.getElementById('loss-chart').dataset.points) > {first}", timeout=60_000)
    print(f"loss chart: {first} -> {page.get_attribute('#loss-chart', 'data-points')} points")
    page.close()


def _race(cluster, page, status_done, page_done, timeout: float, what: str) -> float:
    """Seconds from the coordinator's status showing a change to the page showing it (negative: the page first)."""
    seen_status = seen_page = None
    end = time.monotonic() + timeout
    while time.monotonic() < end and (seen_status is None or seen_page is None):
        if seen_page is None and page_done():
            seen_page = time.monotonic()
        if seen_status is None:
            try:
                if status_done(cluster.status(timeout=2.0)):
                    seen_status = time.monotonic()
            except ConnectionError:
                pass
        time.sleep(0.05)
    assert seen_status is not None, f"the coordinator's status did not show {what} within {timeout:.0f}s\n" \
                                    f"{cluster.log_tails()}"
    assert seen_page is not None, f"the page did not show {what} within {timeout:.0f}s of the start"
    return seen_page - seen_status


def test_a_killed_node_and_the_replan_reach_the_page(browser, cluster) -> None:
    page = _open(browser, cluster)
    epoch = int(page.text_content("#epoch"))
    node2 = cluster.procs["node2"]
    import os

    os.killpg(node2.pid, signal.SIGKILL)  # the machine is gone: no leave, only a lapsed lease
    lag = _race(cluster, page, lambda s: sum(m.state == "alive" for m in s.members) == 1,
                lambda: page.text_content("#count-alive") == "1", 60, "the node gone")
    print(f"killed node: on the page {lag:+.2f} s after the coordinator's status")
    assert lag <= UPDATE_BOUND_S
    assert page.text_content("#count-gone") == "1"
    lag = _race(cluster, page, lambda s: s.plan.epoch > epoch,
                lambda: int(page.text_content("#epoch")) > epoch, 90, "a new plan")
    print(f"replan: on the page {lag:+.2f} s after the coordinator's status")
    assert lag <= UPDATE_BOUND_S
    page.click("nav a[data-view=events]")
    page.wait_for_selector("#event-list li[data-kind=failure]", timeout=5_000)
    assert page.locator("#event-list li[data-kind=replan]").count() >= 1
    page.close()
