"""Coordinator scale: one real `atoll coordinator` process and thousands of simulated nodes.

For each size N (`--nodes 1000,10000`), a fresh coordinator process (SQLite state, default lease) serves N
simulated nodes driven from `--clients` processes over grpc.aio. Each simulated node joins with a profile
(an H100 in one of four regions), opens its plan watch, heartbeats at the cadence the coordinator asks for (on
one heartbeat stream per node, as `atoll node` does; `--unary-heartbeats`: a unary call each),
and answers the probes it is handed with a measurement of the simulated topology (fast inside a region,
slow across). The cadence is the coordinator's: past its heartbeat budget (`--heartbeat-budget`, 2,000 a second
by default) the interval and the lease stretch with the membership, and the simulated nodes follow what each
heartbeat reply announces, as `atoll node` does. The benchmark prints per size:
- join: wall time from the first join to the last join acknowledged;
- heartbeat p50/p99 (client-measured round trips, steady state after the plan) and the errors;
- false lapses: a heartbeat answered NOT_FOUND although the node's previous heartbeat was sent within the lease,
  i.e. a live simulated node was marked gone; a NOT_FOUND after the simulated node itself went longer than the
  lease between heartbeats (its process starved of CPU) is counted apart, as the node's own late heartbeat;
- time from the last join to the plan reaching every node's watch, and the plan epoch;
- the cadence the coordinator announced (interval, lease) and the heartbeats a second it took;
- the coordinator's CPU (share of one core, steady state) and RSS.
The first size is the baseline the others are set against (a heartbeat should cost the same at any size).

This machine runs the clients and the coordinator together; with --pin (the default where there are at least
two CPUs) the coordinator has CPU 0 to itself and the clients share the rest, so its latency is not the
clients' queueing. The coordinator serves plaintext (--insecure): mutual TLS costs a handshake per
connection, and the simulated nodes share a few connections, so it would not change the per-call figures
much while each simulated node would need a certificate of its own. Ends with `targets met: N/M` for the largest size: 10,000 nodes served, heartbeat
p99 < 100 ms, 0 false lapses, a plan within 10 s of the last join.

Usage: python -m bench.coordinator_scale [--nodes 1000,10000] [--clients 3] [--measure 30] [--unary-heartbeats]
       [--heartbeat-budget PER_SECOND (0: a fixed cadence)]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REGIONS = 4
FAST, SLOW = 10e9, 100e6
JOB = """
[job]
name = "scale"
[model]
preset = "tiny"
[data]
source = "builtin"
tokenizer = "bytes"
[train]
global_batch = 16
seq_len = 64
micro_batch = 4
steps = 1000000
[cluster]
expected_nodes = {n}
min_nodes = 1
"""


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _region(i: int) -> int:
    return i % REGIONS


# --- the simulated nodes (one client process) -----------------------------------------------------------


def _client(address: str, token: str, first: int, count: int, channels: int, phase, out, cpus,
            streams: bool) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    # thousands of simulated nodes keep hundreds of thousands of objects (coroutines, calls, messages) alive: with
    # Python's default thresholds the collector's full scans of them stalled this process's loop for hundreds of
    # milliseconds, which the heartbeats' round trips then counted. As the coordinator does (atoll.coordinator.heap):
    # start-up's objects are frozen out of collection and collections are spaced out.
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    asyncio.run(_client_main(address, token, first, count, channels, phase, out, streams))


async def _client_main(address: str, token: str, first: int, count: int, channels: int, phase, out,
                       streams: bool) -> None:
    import grpc

    from atoll.v1 import atoll_pb2 as pb

    meta = (("authorization", f"Bearer {token}"),)
    chans = [grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
             for _ in range(channels)]
    rpcs = []
    for ch in chans:
        rpcs.append({
            "join": ch.unary_unary("/atoll.v1.Coordinator/Join", request_serializer=pb.JoinRequest.SerializeToString,
                                   response_deserializer=pb.JoinReply.FromString),
            # each node's heartbeat request is serialized once, up front: the clients' CPU is the coordinator's
            "hb": ch.unary_unary("/atoll.v1.Coordinator/Heartbeat", request_serializer=None,
                                 response_deserializer=pb.HeartbeatReply.FromString),
            "hbs": ch.stream_stream("/atoll.v1.Coordinator/HeartbeatStream", request_serializer=None,
                                    response_deserializer=pb.HeartbeatReply.FromString),
            "probes": ch.unary_unary("/atoll.v1.Coordinator/ReportProbes",
                                     request_serializer=pb.ProbeReport.SerializeToString,
                                     response_deserializer=pb.Ack.FromString),
            # the plan is counted, not parsed: the clients' CPU goes to heartbeats (packed, as nodes watch)
            "watch": ch.unary_stream("/atoll.v1.Coordinator/WatchPlanPacked",
                                     request_serializer=pb.WatchPlanRequest.SerializeToString,
                                     response_deserializer=len),
        })
    stats = {"joined": [], "plan": {}, "lat": [], "lag": [], "lapses": 0, "late": 0, "errors": 0, "error_kinds": {},
             "measuring": False, "examples": []}
    stop = asyncio.Event()
    join_gate = asyncio.Semaphore(64)

    # the coordinator dials each joining node's peer address back: this process's nodes share one listener that
    # takes the connection and closes it (a real node's Peer server would answer; an address nobody serves
    # would cost each join the dial-back's timeout)
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    listener = await asyncio.start_server(hang_up, "127.0.0.1", 0, backlog=4096)
    peer_address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"

    def profile(i: int) -> pb.NodeProfile:
        timings = [pb.LayerTiming(layer_kind=k, micro_batch=4, seq_len=64, forward_seconds=f, backward_seconds=2 * f)
                   for k, f in (("embedding", 1e-4), ("block", 1e-3), ("head", 5e-4))]
        return pb.NodeProfile(hostname=f"sim{i}", device_kind="cuda", device_name="H100", device_count=1,
                              memory_total_bytes=80 << 30, memory_free_bytes=79 << 30, cpu_count=16,
                              layer_timings=timings, optimizer_step_seconds=1e-3, region=f"r{_region(i)}")

    def error(e: Exception, what: str) -> None:
        stats["errors"] += 1
        kind = f"{what} {e.code().name}" if isinstance(e, grpc.aio.AioRpcError) else f"{what} {type(e).__name__}"
        kind += " (steady state)" if stats["measuring"] else " (joins and plan)"
        stats["error_kinds"][kind] = stats["error_kinds"].get(kind, 0) + 1
        if len(stats["examples"]) < 3:
            stats["examples"].append(f"{kind}: {e.details() if isinstance(e, grpc.aio.AioRpcError) else e} "
                                     f"{e.debug_error_string() if isinstance(e, grpc.aio.AioRpcError) else ''}"
                                     f"{' (while measuring)' if stats['measuring'] else ''}")

    async def join(i: int, rpc) -> tuple[str, float]:
        async with join_gate:
            while True:
                try:
                    r = await rpc["join"](pb.JoinRequest(token=token, node_id=f"sim{i:05d}", profile=profile(i),
                                                         peer_address=peer_address),
                                          metadata=meta, timeout=60)
                    return r.node_id, r.heartbeat_interval_seconds, r.lease_seconds
                except grpc.aio.AioRpcError as e:
                    error(e, "join")
                    await asyncio.sleep(1.0)

    async def watch(node_id: str, rpc) -> None:
        while not stop.is_set():
            try:
                async for _ in rpc["watch"](pb.WatchPlanRequest(node_id=node_id), metadata=meta, timeout=600):
                    stats["plan"].setdefault(node_id, time.time())
            except grpc.aio.AioRpcError as e:
                if stop.is_set() or e.code() == grpc.StatusCode.CANCELLED:
                    return
                error(e, "watch")
                await asyncio.sleep(1.0)

    async def node(i: int) -> None:
        rpc = rpcs[i % len(rpcs)]
        node_id, interval, lease = await join(i, rpc)
        sent = time.perf_counter()  # when the lease was last renewed from this side (the join, then each heartbeat)
        stats["joined"].append(time.time())
        watcher = asyncio.ensure_future(watch(node_id, rpc))
        request = pb.HeartbeatRequest(node_id=node_id).SerializeToString()
        due = time.perf_counter()  # the first heartbeat at once, as `atoll node` sends it (its reply hands out probes)
        stream = None  # a real node's one heartbeat stream (atoll.node.heartbeat_stream), opened at the first beat
        while not stop.is_set():
            t0 = time.perf_counter()
            if stats["measuring"]:  # how late this process's loop woke the node: its own queueing, not the server's
                stats["lag"].append(t0 - due)
            try:
                if streams:
                    if stream is None:
                        stream = rpc["hbs"](metadata=meta, timeout=3600)
                    await stream.write(request)
                    reply = await stream.read()
                    if reply is grpc.aio.EOF:  # the stream's life ended: the next beat opens another
                        stream = None
                        continue
                else:
                    reply = await rpc["hb"](request, metadata=meta, timeout=30)
                if stats["measuring"]:
                    done_at = time.perf_counter()
                    stats["lat"].append((time.time(), done_at - t0))
                if reply.heartbeat_interval_seconds > 0:  # the cadence stretches with the membership
                    interval, lease = reply.heartbeat_interval_seconds, reply.lease_seconds
                    stats["cadence"] = (interval, lease)
                if reply.probe:
                    links = [pb.LinkMeasurement(src=node_id, dst=t.node_id, rtt_seconds=1e-3,
                                                bandwidth_bytes_per_s=(FAST if _region(int(t.node_id[3:])) == _region(i)
                                                                       else SLOW) * random.uniform(0.9, 1.1))
                             for t in reply.probe]
                    await rpc["probes"](pb.ProbeReport(node_id=node_id, links=links), metadata=meta, timeout=30)
            except grpc.aio.AioRpcError as e:
                if stream is not None:
                    stream.cancel()
                    stream = None
                if e.code() == grpc.StatusCode.NOT_FOUND:  # marked gone while alive; join again
                    # a false lapse when this node renewed its lease in time; else its own heartbeat came late
                    stats["lapses" if t0 - sent <= lease else "late"] += 1
                    node_id, interval, lease = await join(i, rpc)
                    request = pb.HeartbeatRequest(node_id=node_id).SerializeToString()
                    t0 = time.perf_counter()
                elif not stop.is_set():
                    error(e, "heartbeat")
            sent = t0
            due = t0 + interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))  # (no timer task per beat: stop is seen next)
        if stream is not None:
            stream.cancel()
        watcher.cancel()

    tasks = [asyncio.ensure_future(node(i)) for i in range(first, first + count)]
    loop = asyncio.get_running_loop()
    parent = os.getppid()
    # the parent steps the phases: 1 measure heartbeats, 2 stop; progress is reported every half second
    while True:
        await asyncio.sleep(0.5)
        out.put(("progress", first, len(stats["joined"]), len(stats["plan"]),
                 max(stats["joined"], default=0.0), max(stats["plan"].values(), default=0.0)))
        p = phase.value
        if os.getppid() != parent:  # the benchmark was killed: stop instead of calling a coordinator that is gone
            p = 2
        if p >= 1 and not stats["measuring"]:
            stats["measuring"] = True
            stats["lat"].clear()
            stats["lag"].clear()
            stats["cpu0"] = (time.process_time(), time.monotonic())
            stats["lapses_before"] = stats["lapses"]
        if p >= 2:
            break
    cpu0, wall0 = stats.get("cpu0", (time.process_time(), time.monotonic()))
    stats["cpu"] = (time.process_time() - cpu0) / max(1e-9, time.monotonic() - wall0)
    stop.set()
    await loop.run_in_executor(None, lambda: None)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in chans:
        await ch.close()
    listener.close()
    out.put(("done", first, stats["lat"], stats["lapses"], stats["errors"], stats["error_kinds"],
             min(stats["joined"], default=0.0), stats["examples"], stats["lag"], stats["cpu"], stats["late"],
             stats.get("cadence")))


# --- one size -------------------------------------------------------------------------------------------


def run_size(n: int, clients: int, measure: float, timeout: float, pin: bool, work: Path,
             streams: bool = True, settle: float = 0.0, budget: float | None = None,
             extra: Sequence[str] = (), during: Callable[[dict], None] | None = None) -> dict:
    """One size: `extra` goes on the coordinator's command line; `during`, when given, is called once the plan has
    reached every simulated node, while they keep heartbeating, with {"pid", "work", "address", "token", "n"}
    (`bench.dashboard` measures its browsers there), before the steady-state measurement."""
    if work.exists():  # a kept folder from an earlier run: its state and address are not this run's
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / "job.toml").write_text(JOB.format(n=n))
    token = "scale-bench-token"
    (work / "token").write_text(token + "\n")
    addr_file = work / "address"
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[0]} if pin and len(cpus) >= 2 else None
    client_cpus = set(cpus[1:]) if server_cpus else None
    log = open(work / "coordinator.log", "w")
    coord = subprocess.Popen(
        [sys.executable, "-m", "atoll", "coordinator", "--job", str(work / "job.toml"), "--listen", "127.0.0.1:0",
         "--state-dir", str(work / "state"), "--token-file", str(work / "token"), "--address-file", str(addr_file),
         "--insecure"] + ([] if budget is None else ["--heartbeat-budget", f"{budget:g}"]) + list(extra),
        stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None)
    procs: list[mp.Process] = []
    try:
        t0 = time.monotonic()
        while not addr_file.exists():
            if coord.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"the coordinator did not start; see {work / 'coordinator.log'}")
            time.sleep(0.1)
        address = addr_file.read_text().strip()
        ctx = mp.get_context("spawn")
        phase, out = ctx.Value("i", 0), ctx.Queue()
        per = -(-n // clients)
        channels = max(2, min(16, per // 250))
        started = time.time()
        for k in range(clients):
            first, count = k * per, min(per, n - k * per)
            if count <= 0:
                break
            p = ctx.Process(target=_client, daemon=True,
                            args=(address, token, first, count, channels, phase, out, client_cpus, streams))
            p.start()
            procs.append(p)
        progress: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        cpu_join0 = _proc_cpu_seconds(coord.pid)
        while time.monotonic() < deadline:
            while not out.empty():
                msg = out.get()
                progress[msg[1]] = msg[2:]
            joined = sum(p[0] for p in progress.values())
            planned = sum(p[1] for p in progress.values())
            if planned >= n:
                break
            if coord.poll() is not None:
                raise RuntimeError(f"the coordinator exited ({coord.returncode}); see {work / 'coordinator.log'}")
            time.sleep(0.5)
        joined = sum(p[0] for p in progress.values())
        planned = sum(p[1] for p in progress.values())
        last_join = max((p[2] for p in progress.values()), default=0.0)
        last_plan = max((p[3] for p in progress.values()), default=0.0)
        cpu_join = _proc_cpu_seconds(coord.pid) - cpu_join0
        if during is not None:
            during({"pid": coord.pid, "work": work, "address": address, "token": token, "n": n,
                    "planned": planned})
        # steady state: heartbeats only (plans are out, probes done)
        # the plan went to every watch at once (each receives all of it): let that wave pass before measuring
        time.sleep(settle)
        phase.value = 1
        time.sleep(1.0)
        cpu0, w0 = _proc_cpu_seconds(coord.pid), time.monotonic()
        time.sleep(measure)
        cpu_steady = (_proc_cpu_seconds(coord.pid) - cpu0) / (time.monotonic() - w0)
        rss = _proc_rss_mb(coord.pid)
        load = os.getloadavg()[0]
        phase.value = 2
        samples: list[tuple[float, float]] = []  # (wall time answered, round trip s)
        lag: list[float] = []
        client_cpu = 0.0
        lapses = errors = late = 0
        cadence = None  # (interval, lease) the coordinator last announced
        kinds: dict[str, int] = {}
        firsts = []
        examples: list[str] = []
        done = 0
        end = time.monotonic() + 120
        while done < len(procs) and time.monotonic() < end:
            msg = out.get(timeout=120)
            if msg[0] != "done":
                continue
            done += 1
            samples += msg[2]
            lapses += msg[3]
            errors += msg[4]
            for k, v in msg[5].items():
                kinds[k] = kinds.get(k, 0) + v
            firsts.append(msg[6])
            examples += msg[7]
            lag += msg[8]
            client_cpu += msg[9]
            late += msg[10]
            cadence = msg[11] or cadence
        lat = sorted(x for _, x in samples)
        lag.sort()
        # the p99 of each tenth of the measurement: a transient (a stall, a late wave) shows in one, load in all
        t_first = min((t for t, _ in samples), default=0.0)
        width = max(1e-9, measure / 10)
        windows: dict[int, list[float]] = {}
        for t, x in samples:
            windows.setdefault(min(9, int((t - t_first) / width)), []).append(x)
        window_p99 = [sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 for _, xs in sorted(windows.items())]
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: float("nan"))
        return {"n": n, "joined": joined, "planned": planned,
                "join_s": last_join - min(firsts or [started]) if last_join else float("nan"),
                "plan_after_last_join_s": last_plan - last_join if planned >= n else float("inf"),
                "p50_ms": pct(0.5), "p99_ms": pct(0.99), "heartbeats": len(lat), "lapses": lapses,
                "window_p99_ms": window_p99,
                "late": late,
                "lag_p99_ms": lag[min(len(lag) - 1, int(0.99 * len(lag)))] * 1000 if lag else float("nan"),
                "errors": errors, "error_kinds": kinds, "cpu_steady": cpu_steady, "cpu_join_s": cpu_join,
                "client_cpu": client_cpu, "load": load, "cadence": cadence, "rate": len(lat) / measure,
                "rss_mb": rss, "pinned": bool(server_cpus), "examples": examples[:3]}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        coord.send_signal(signal.SIGTERM)
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000", help="comma-separated sizes; the first is the baseline")
    ap.add_argument("--clients", type=int, default=max(2, min(4, (os.cpu_count() or 2) - 1)),
                    help="client processes simulating the nodes (at least two: one asyncio loop simulating 10,000 "
                         "nodes queues their replies itself, and its queueing would count as the coordinator's)")
    ap.add_argument("--measure", type=float, default=30.0, help="seconds of steady-state heartbeats per size")
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds between the plan reaching every node and the measurement (its delivery to every "
                         "watch is a wave of its own)")
    ap.add_argument("--timeout", type=float, default=600.0, help="most seconds to wait for joins and the plan")
    ap.add_argument("--no-pin", action="store_true", help="let the coordinator and clients share every CPU")
    ap.add_argument("--keep", help="folder to keep each run's state and coordinator log in")
    ap.add_argument("--unary-heartbeats", action="store_true",
                    help="heartbeat with one unary call each (as a coordinator without heartbeat streams is heard) "
                         "instead of on each node's heartbeat stream")
    ap.add_argument("--heartbeat-budget", type=float,
                    help="the coordinator's --heartbeat-budget (heartbeats a second; 0: a fixed cadence at any size); "
                         "default: the coordinator's own")
    args = ap.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="atoll-scale-"))
    print(f"coordinator scale: sizes {sizes}, {args.clients} client processes, {args.measure:g}s of steady "
          f"heartbeats each ({'unary calls' if args.unary_heartbeats else 'one stream per node'}); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; runs in {root}")
    results = []
    for n in sizes:
        r = run_size(n, args.clients, args.measure, args.timeout, not args.no_pin, root / f"n{n}",
                     streams=not args.unary_heartbeats, settle=args.settle, budget=args.heartbeat_budget)
        results.append(r)
        print(f"\n{n:>6} nodes  joined {r['joined']}, planned {r['planned']}  (coordinator "
              f"{'pinned to CPU 0' if r['pinned'] else 'sharing CPUs with the clients'}; load average "
              f"{r['load']:.1f} while measuring)")
        print(f"  join of all nodes           {r['join_s']:8.1f} s   (coordinator CPU during joins {r['cpu_join_s']:.1f} s)")
        print(f"  last join -> plan at all    {r['plan_after_last_join_s']:8.1f} s")
        if r["cadence"]:
            print(f"  heartbeat cadence           {r['cadence'][0]:8.1f} s   (lease {r['cadence'][1]:.1f} s, as the "
                  f"coordinator announced it for this size; {r['rate']:.0f} heartbeats/s)")
        print(f"  heartbeat p50 / p99         {r['p50_ms']:8.1f} / {r['p99_ms']:.1f} ms  ({r['heartbeats']} heartbeats; "
              f"the clients' own loop lag p99 {r['lag_p99_ms']:.1f} ms)")
        print(f"  p99 by tenth of the window  {' '.join(f'{x:.0f}' for x in r['window_p99_ms'])} ms")
        print(f"  false lapses                {r['lapses']:8d}     errors {r['errors']} {r['error_kinds'] or ''}")
        print(f"  lapses after a late beat    {r['late']:8d}     (the simulated node itself sent none within the "
              f"lease: this machine's CPU, not the coordinator)")
        print(f"  coordinator CPU, RSS        {100 * r['cpu_steady']:8.0f} % of a core, {r['rss_mb']:.0f} MB   "
              f"(the simulated nodes: {100 * r['client_cpu']:.0f} % of a core)")
        for e in r["examples"]:
            print(f"  e.g. {e[:300]}")
    base, big = results[0], results[-1]
    if len(results) > 1:
        print(f"\nagainst the baseline ({base['n']} nodes): heartbeat p50 x{big['p50_ms'] / base['p50_ms']:.2f}, "
              f"p99 x{big['p99_ms'] / base['p99_ms']:.2f}; coordinator CPU x{big['cpu_steady'] / max(base['cpu_steady'], 1e-9):.1f} "
              f"for x{big['n'] / base['n']:.0f} nodes; RSS {base['rss_mb']:.0f} -> {big['rss_mb']:.0f} MB")
    targets = {
        "10,000 nodes served": big["n"] >= 10_000 and big["planned"] >= big["n"],
        f"heartbeat p99 < 100 ms (got {big['p99_ms']:.1f})": big["p99_ms"] < 100,
        f"0 false lapses (got {sum(r['lapses'] for r in results)})": all(r["lapses"] == 0 for r in results),
        f"plan within 10 s of the last join (got {big['plan_after_last_join_s']:.1f})":
            big["plan_after_last_join_s"] <= 10,
    }
    missed = [k for k, ok in targets.items() if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
