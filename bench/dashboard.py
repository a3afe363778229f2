"""Dashboard at scale: a real `atoll coordinator --dashboard-port 0` with 1,000 and 10,000 simulated members (the
driver of `bench.coordinator_scale`), watched by headless Chromium (Playwright, the system's `chromium`).

Per size, once the plan has reached every simulated node and while they heartbeat:
- first paint: a fresh browser opens the page (token in the address) until the member count is painted, and
  Chromium's own first-contentful-paint; the median of --repeats;
- update latency: `atoll job extend --steps 1` (a ControlJob call) changes the job's last step; each of the
  --browsers pages records when its header shows the new figure (a MutationObserver, wall clock); the worst page;
- the coordinator's CPU (share of one core) with no browser, with --browsers pages watching, and with none again:
  the extra CPU is the watched window against the mean of the two unwatched ones, measured in the same run; beside
  it, what the one snapshot every page shares costs to read and serialize, as the coordinator timed it.
Targets: first paint < 1.5 s at 10,000 members; updates within 2 s; extra coordinator CPU <= 5% of a core.
`--screenshot DIR` also saves the map at each size (DIR/dashboard-map-N.png). `--job-screenshots DIR` instead
runs two small real jobs (a coordinator and four CPU nodes in two regions on loopback: one synchronous, one in
outer mode), kills one node in each and saves every view of their dashboards into DIR (the README's pictures).

Usage: python -m bench.dashboard [--nodes 1000,10000] [--browsers 10] [--window 15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/dashboard.py): imports resolve from the checkout
    sys.path.insert(0, str(ROOT))

from bench.coordinator_scale import _proc_cpu_seconds, run_size  # noqa: E402

FIRST_PAINT_TARGET_S = 1.5
UPDATE_TARGET_S = 2.0
EXTRA_CPU_TARGET = 0.05

PAINTED = """n => { const t = document.getElementById('count-members');
                    return t && Number(t.textContent.replace(/\\D/g, '')) === n; }"""
WATCH_TARGET = """want => { window.__seen = null; const el = document.getElementById('step');
  const check = () => { const parts = el.textContent.split('/');
    if (window.__seen === null && parts.length > 1 && Number(parts[1].replace(/\\D/g, '')) === want)
      window.__seen = Date.now() / 1000; };
  new MutationObserver(check).observe(el, {childList: true, characterData: true, subtree: true}); check(); }"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000", help="comma-separated sizes (simulated members)")
    ap.add_argument("--browsers", type=int, default=10, help="pages watching at once while the CPU is measured")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of each CPU measurement")
    ap.add_argument("--repeats", type=int, default=3, help="first paints and updates measured per size")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds after the plan reached every node before measuring (its delivery is a wave)")
    ap.add_argument("--clients", type=int, default=max(2, min(4, (os.cpu_count() or 2) - 1)),
                    help="client processes simulating the nodes (bench.coordinator_scale)")
    ap.add_argument("--heartbeat-budget", type=float,
                    help="the coordinator's --heartbeat-budget (heartbeats a second; default: its own): a smaller one "
                         "stretches the simulated nodes' cadence, so that 10,000 of them fit a small machine")
    ap.add_argument("--timeout", type=float, default=900.0, help="most seconds to wait for joins and the plan")
    ap.add_argument("--screenshot", metavar="DIR", help="save the map at each size as DIR/dashboard-map-N.png")
    ap.add_argument("--keep", help="folder to keep each run's state and coordinator log in")
    ap.add_argument("--job-screenshots", metavar="DIR",
                    help="only run a small real job and save each view of its dashboard into DIR")
    ap.add_argument("--job-seconds", type=float, default=120.0,
                    help="with --job-screenshots: seconds the job trains before a node is killed")
    return ap.parse_args(argv)


def _cpu(pid: int, seconds: float) -> float:
    c0, t0 = _proc_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (_proc_cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def _dashboard_url(work: Path, timeout: float = 30.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = re.search(r"dashboard on (http://\S+/)", (work / "coordinator.log").read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator logged no dashboard address; see {work / 'coordinator.log'}")


def measure(ctx: dict, browser, args: argparse.Namespace, out: dict) -> None:
    """The measurements of one size (run by `run_size` while the simulated nodes heartbeat)."""
    from atoll.launch.job import control_job

    n, pid = ctx["n"], ctx["pid"]
    url = _dashboard_url(ctx["work"]) + f"?token={ctx['token']}"
    print(f"  {n} members planned; dashboard at {url.split('?')[0]}; letting the plan's wave pass "
          f"({args.settle:g} s)", flush=True)
    time.sleep(args.settle)
    cpu_idle_a = _cpu(pid, args.window)
    paints, fcps = [], []
    for _ in range(args.repeats):
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        t0 = time.monotonic()
        page.goto(url)
        page.wait_for_function(PAINTED, arg=n, timeout=60_000, polling="raf")
        paints.append(time.monotonic() - t0)
        fcp = page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || 0")
        fcps.append(fcp / 1000)
        context.close()
    print(f"  first paint {statistics.median(paints):.2f} s (of {', '.join(f'{x:.2f}' for x in paints)})",
          flush=True)
    contexts, pages = [], []
    for _ in range(args.browsers):
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.goto(url)
        contexts.append(context)
        pages.append(page)
    for page in pages:
        page.wait_for_function(PAINTED, arg=n, timeout=60_000)
    if args.screenshot:
        Path(args.screenshot).mkdir(parents=True, exist_ok=True)
        pages[0].screenshot(path=str(Path(args.screenshot) / f"dashboard-map-{n}.png"))
    cpu_watched = _cpu(pid, args.window)
    import json
    import urllib.request

    req = urllib.request.Request(url.split("?")[0] + "api/snapshot",
                                 headers={"Authorization": f"Bearer {ctx['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    snapshot_s, period_s = doc["snapshot_seconds"], doc["snapshot_period_seconds"]
    latencies = []
    for _ in range(args.repeats):
        # every page watches for the next figure before the call that makes it; the latency counts from the
        # call's start (so it includes the call itself)
        target = int(re.sub(r"\D", "", pages[0].text_content("#step").split("/")[1])) + 1
        for page in pages:
            page.evaluate(WATCH_TARGET, target)
        changed = time.time()
        made = control_job(ctx["address"], "extend", steps=1, token=ctx["token"],
                           timeout=timedelta(seconds=30)).target_steps
        if made != target:
            raise RuntimeError(f"the job's last step moved to {made}, not {target}: something else extends it")
        for page in pages:
            page.wait_for_function("window.__seen !== null", timeout=30_000)
        latencies.append(max(page.evaluate("window.__seen") for page in pages) - changed)
    for context in contexts:
        context.close()
    cpu_idle_b = _cpu(pid, args.window)
    idle = (cpu_idle_a + cpu_idle_b) / 2
    out.update(n=n, paint_s=statistics.median(paints), fcp_s=statistics.median(fcps), update_s=max(latencies),
               updates=latencies, cpu_idle=idle, cpu_idle_a=cpu_idle_a, cpu_idle_b=cpu_idle_b,
               cpu_watched=cpu_watched, extra_cpu=cpu_watched - idle, snapshot_s=snapshot_s, period_s=period_s)


VIEWS = ("map", "plan", "training", "outer", "events")


def job_screenshots(out: Path, browser, seconds: float, keep: Path | None, *, mode: str = "sync",
                    views: tuple[str, ...] = VIEWS, node_page: bool = True) -> list[Path]:
    """Run four CPU nodes in two regions (`mode`: "sync" or "outer") for `seconds`, kill one, and save the
    pictures of `views` (and of a node's page)."""
    import signal
    from dataclasses import replace

    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster

    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=100_000, warmup=10, eval_every=25),
                  data=replace(job.data, validation_fraction=0.05),
                  checkpoint=replace(job.checkpoint, interval=50, keep=2),
                  cluster=replace(job.cluster, expected_nodes=4, min_nodes=1),
                  outer=replace(job.outer, mode=mode, inner_steps=10, deadline_seconds=30.0))
    work = (keep / mode) if keep else Path(tempfile.mkdtemp(prefix="atoll-dashboard-job-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.toml").write_text(job.to_toml())
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    names = {"node1": "lab-a-0", "node2": "lab-a-1", "node3": "lab-b-0", "node4": "lab-b-1"}
    extra = ["--dashboard-port", "0", "--lease", "5", "--join-settle", "2", "--island-threshold", "0.001"]
    if mode == "sync":
        # a pinned two-stage pipeline across the regions (the planner puts this tiny model on one CPU a replica),
        # so the plan view has stages, dp and a link between them; once a node it names is gone, the planner plans
        from atoll.plan import PipelinePlan, Plan, StagePlan

        pinned = Plan(model="tiny", global_batch=16, seq_len=64, pipelines=[PipelinePlan(
            micro_batch=4, num_micro_batches=4, stages=[
                StagePlan(island="lab-a", layers=(0, 3), dp=2, nodes=["lab-a-0", "lab-a-1"]),
                StagePlan(island="lab-b", layers=(3, 6), dp=2, nodes=["lab-b-0", "lab-b-1"])])])
        pinned.validate(job.model.n_layers + 2)
        pinned.save(work / "plan.json")
        extra += ["--plan", str(work / "plan.json")]
    with LocalCluster(job_path=work / "job.toml", out=work / "run", profile_seconds=1.0) as c:
        c.start_coordinator(extra=extra)
        for i, region in enumerate(["lab-a", "lab-a", "lab-b", "lab-b"]):
            c.start_node(f"node{i + 1}", region=region, node_id=names[f"node{i + 1}"])
        c.wait_status(lambda s: s.plan.epoch >= 1 and len(s.members) == 4, 180, "a plan of four nodes")
        print(f"  training for {seconds:g} s ...", flush=True)
        time.sleep(seconds)
        url = _dashboard_url(work / "run")
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.goto(url + f"?token={c.token}")
        page.wait_for_function("document.getElementById('count-members').textContent !== '-'", timeout=30_000)

        def shoot(view: str) -> None:
            page.click(f"nav a[data-view={view}]")
            page.wait_for_timeout(1500)
            path = out / f"dashboard-{view}.png"
            page.screenshot(path=str(path))
            saved.append(path)

        if "plan" in views:  # the plan as it ran before the kill
            shoot("plan")
        import os as _os

        _os.killpg(c.procs["node4"].pid, signal.SIGKILL)  # a machine lost: its lease lapses, the job replans
        epoch = c.status().plan.epoch
        c.wait_status(lambda s: s.plan.epoch > epoch, 120, "the replan after the kill", dead=frozenset({"node4"}))
        time.sleep(20)
        for view in views:
            if view != "plan":
                shoot(view)
        if not node_page:
            context.close()
            return saved
        page.click("nav a[data-view=map]")
        page.click("#map-svg .island")
        page.wait_for_selector("#island-table tbody tr", timeout=10_000)
        page.click("#island-table tbody tr a")
        page.wait_for_function("document.getElementById('node-facts').children.length > 0", timeout=10_000)
        page.wait_for_timeout(500)
        path = out / "dashboard-node.png"
        page.screenshot(path=str(path))
        saved.append(path)
        context.close()
    return saved


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("bench.dashboard needs Chromium on PATH: apt-get install chromium", file=sys.stderr)
        return 2
    if args.job_screenshots:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                keep = Path(args.keep) if args.keep else None
                saved = job_screenshots(Path(args.job_screenshots), browser, args.job_seconds, keep,
                                        views=tuple(v for v in VIEWS if v != "outer"))
                saved += job_screenshots(Path(args.job_screenshots), browser, args.job_seconds, keep, mode="outer",
                                         views=("outer",), node_page=False)
                for path in saved:
                    print(f"  saved {path}")
            finally:
                browser.close()
        return 0
    sizes = [int(x) for x in args.nodes.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="atoll-dashboard-"))
    print(f"dashboard bench: sizes {sizes}, {args.browsers} browsers, {args.window:g} s CPU windows; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; runs in {root}", flush=True)
    results = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for n in sizes:
                print(f"\n{n} simulated members: joining ...", flush=True)
                r: dict = {}
                run_size(n, args.clients, 1.0, args.timeout, True, root / f"n{n}", settle=0.0,
                         budget=args.heartbeat_budget,
                         extra=["--dashboard-port", "0"], during=lambda ctx: measure(ctx, browser, args, r))
                if not r:
                    raise RuntimeError(f"size {n}: the plan did not reach every simulated node; see "
                                       f"{root / f'n{n}' / 'coordinator.log'}")
                results.append(r)
                print(f"  first paint (data)          {r['paint_s']:8.2f} s   (Chromium's first contentful paint "
                      f"{r['fcp_s']:.2f} s)")
                print(f"  update latency, worst page  {r['update_s']:8.2f} s   (each try: "
                      f"{', '.join(f'{x:.2f}' for x in r['updates'])} s, over {args.browsers} pages)")
                print(f"  coordinator CPU             {100 * r['cpu_idle']:8.1f} % of a core unwatched "
                      f"({100 * r['cpu_idle_a']:.1f} before, {100 * r['cpu_idle_b']:.1f} after), "
                      f"{100 * r['cpu_watched']:.1f} % with {args.browsers} browsers")
                print(f"  extra CPU for {args.browsers} browsers    {100 * r['extra_cpu']:8.1f} % of a core   (the "
                      f"snapshot they share: {1000 * r['snapshot_s']:.1f} ms to read and serialize, every "
                      f"{r['period_s']:.2f} s: {100 * r['snapshot_s'] / r['period_s']:.1f} % of a core)")
        finally:
            browser.close()
    big = results[-1]
    targets = {f"first paint < {FIRST_PAINT_TARGET_S} s at {big['n']:,} members (got {big['paint_s']:.2f})":
               big["paint_s"] < FIRST_PAINT_TARGET_S}
    for r in results:
        targets[f"updates within {UPDATE_TARGET_S:g} s at {r['n']:,} (got {r['update_s']:.2f})"] = \
            r["update_s"] <= UPDATE_TARGET_S
        targets[f"extra CPU <= {100 * EXTRA_CPU_TARGET:.0f}% at {r['n']:,} (got {100 * r['extra_cpu']:.1f}%)"] = \
            r["extra_cpu"] <= EXTRA_CPU_TARGET
    print()
    for what, ok in targets.items():
        print(f"  [{'x' if ok else ' '}] {what}")
    print(f"targets met: {sum(targets.values())}/{len(targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
