"""Machine probes benchmark: what a lone probe says of a link between two machines, against what each of a
machine's nodes gets while all of them send at once (`atoll.coordinator.machineprobe`), and the link's share
each one truly has.

On the geo testbed: two machines (one testbed host each, behind a link shaped to `--rate`), k nodes on each
(`atoll node --machine`), for k in `--nodes`. The coordinator probes as it always does; the table gives, per k,
the lone probes between the machines (median and range; nodes that joined together may probe at once by
chance), the per-flow figure of each machine's round, and the share of the link each of the k flows has
(rate / k, the baseline the planner should read). Ends with `targets met: N/M`: every round's figure within 25%
of rate / k.

Usage (as root): python -m bench.machine_probe [--rate 40e6] [--nodes 2 3 4]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.geo import geo_testbed, geo_unavailable  # noqa: E402

_ROUND = re.compile(r"machine probe: machine (m\d): (\d+) flows sent at once reach ([\d.]+) Mbit/s each")


def run(k: int, rate: float, out: Path) -> dict:
    """k nodes on each of two machines behind a link of `rate` bits/s; the lone probes and both rounds."""
    from atoll.job import JobSpec
    from atoll.launch.localcluster import LocalCluster

    job = JobSpec.load(REPO / "examples" / "tiny.toml")
    job = replace(job, train=replace(job.train, steps=20, warmup=2),
                  cluster=replace(job.cluster, expected_nodes=2 * k, min_nodes=2 * k))
    path = out / "job.toml"
    path.write_text(job.to_toml())
    with geo_testbed(regions={"r1": 1, "r2": 1}, wan_bits_per_s=rate, cpu_quota=None) as tb, \
            LocalCluster(job_path=path, out=out / "run", profile_seconds=1.0) as cluster:
        cluster.start_coordinator(host=tb.coordinator)
        for machine, region in (("m1", "r1"), ("m2", "r2")):
            for i in range(k):
                cluster.start_node(f"{machine}-{i}", host=tb.in_region(region)[0], region="lab",
                                   extra=["--machine", machine])
        log = cluster.out / "coordinator.log"

        def rounds() -> dict[str, tuple[int, float]]:
            text = log.read_text(errors="replace") if log.is_file() else ""
            return {m: (int(n), float(mbit)) for m, n, mbit in _ROUND.findall(text)}

        cluster.wait_status(lambda s: len(rounds()) == 2, 240, "both machines' probe rounds", dead=frozenset())
        status = cluster.status()
        machine_of = {m.node_id: m.profile.hostname for m in status.members}
        lone = sorted(x.bandwidth_bytes_per_s * 8 / 1e6 for x in status.links
                      if machine_of.get(x.src) != machine_of.get(x.dst) and x.bandwidth_bytes_per_s > 0)
        return {"lone": lone, "rounds": rounds()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=40e6, help="bits/s of the link between the machines")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4], help="nodes per machine, one run each")
    args = ap.parse_args()
    why = geo_unavailable()
    if why is not None:
        print(f"cannot run: {why}")
        return 2
    share = args.rate / 1e6
    print(f"two machines behind a {share:.0f} Mbit/s link; Mbit/s")
    print(f"{'nodes':>5} {'lone median':>11} {'lone range':>13} {'m1 at once':>10} {'m2 at once':>10} "
          f"{'rate / k':>8} {'at once / (rate / k)':>20} {'lone / (rate / k)':>17}")
    targets: list[tuple[str, bool]] = []
    for k in args.nodes:
        with tempfile.TemporaryDirectory(prefix="atoll-machine-probe-") as tmp:
            got = run(k, args.rate, Path(tmp))
        ideal = share / k
        lone = got["lone"]
        m1, m2 = (got["rounds"][m][1] for m in ("m1", "m2"))
        med = statistics.median(lone) if lone else float("nan")
        worst = max(abs(m / ideal - 1) for m in (m1, m2))
        print(f"{k:>5} {med:>11.1f} {f'{lone[0]:.1f}-{lone[-1]:.1f}' if lone else '-':>13} {m1:>10.1f} {m2:>10.1f} "
              f"{ideal:>8.1f} {f'{m1 / ideal:.2f}x, {m2 / ideal:.2f}x':>20} {med / ideal:>16.2f}x")
        targets.append((f"{k} nodes a machine: each round within 25% of rate / k", worst <= 0.25))
    missed = [n for n, ok in targets if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})"
                                                                          if missed else ""))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
