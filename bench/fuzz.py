"""Fuzzing both gRPC services: every RPC of the Coordinator and of the Peer service, with requests that are
valid-shaped messages with random field values (integers at their limits, NaN and infinities, odd strings,
nested and repeated fields), random bytes, and truncations of valid messages.

The strategies here (hypothesis) are shared with `tests/test_fuzz.py`, which runs a bounded number of cases
against in-process servers in CI. This benchmark runs `--cases` cases per service against servers in processes
of their own (a real `atoll coordinator --insecure`, and a process serving one node's Peer service) and prints
per service:
- crashes: the server process died or stopped answering its health check;
- hangs: a call that ran into its deadline (the long-lived streams, WatchPlan and Connect, may wait by design);
- wrong codes: INTERNAL or UNKNOWN, which mean the server failed instead of refusing the request;
- RSS growth of the server from after the first tenth of the cases to the end, which includes as many
  unparseable requests without the token after the cases.
The baseline is the same servers answering the same number of valid calls (GetStatus / HeldState).
Targets: 0 crashes, 0 hangs, 0 wrong codes, RSS growth < 10%; it ends with `targets met: N/M`.

Usage: python -m bench.fuzz [--cases 10000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import descriptor as _d
from google.protobuf import message_factory
from hypothesis import strategies as st

from atoll.v1 import atoll_pb2 as pb

TOKEN = "fuzz-token"
KNOWN_NODES = ("n1", "n2", "n3")
LONG_LIVED = {"/atoll.v1.Coordinator/WatchPlan", "/atoll.v1.Coordinator/WatchPlanPacked", "/atoll.v1.Peer/Connect"}
"""Streams that wait for news by design: running into the deadline is their normal end, not a hang."""
WRONG = {"INTERNAL", "UNKNOWN"}
CALL_DEADLINE_S = 10.0
LONG_LIVED_DEADLINE_S = 0.5

U64_EDGES = (0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
_INT_RANGES = {
    _d.FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), _d.FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    _d.FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), _d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    _d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), _d.FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    _d.FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), _d.FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    _d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), _d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(f: _d.FieldDescriptor) -> st.SearchStrategy:
    t = f.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        return st.one_of(st.integers(lo, hi), st.sampled_from([x for x in U64_EDGES if lo <= x <= hi] + [lo]),
                         st.integers(0, 64))
    if t == _d.FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 1e-9, 1e300, float("nan"), float("inf")]))
    if t == _d.FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if t == _d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == _d.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(KNOWN_NODES + ("", TOKEN, "127.0.0.1:1", "cpu", "block", "x" * 5000)),
                         st.text(max_size=40))
    if t == _d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == _d.FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-3, 1000))
    raise TypeError(f"no strategy for field {f.full_name} of type {t}")


def message_strategy(desc: _d.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of type `desc` with a random subset of their fields set to random values."""
    cls = message_factory.GetMessageClass(desc)
    optional: dict[str, st.SearchStrategy] = {}
    for f in desc.fields:
        if f.type == _d.FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                key = _scalar(f.message_type.fields_by_name["key"])
                vf = f.message_type.fields_by_name["value"]
                if vf.type == _d.FieldDescriptor.TYPE_MESSAGE:
                    if depth >= 2:
                        continue
                    value = message_strategy(vf.message_type, depth + 1)
                else:
                    value = _scalar(vf)
                optional[f.name] = st.dictionaries(key, value, max_size=3)
                continue
            if depth >= 2:
                continue
            inner = message_strategy(f.message_type, depth + 1)
        else:
            inner = _scalar(f)
        optional[f.name] = st.lists(inner, max_size=3) if f.is_repeated else inner

    def build(values: dict) -> object:
        msg = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            target = getattr(msg, name) if (f.is_repeated) else None
            if f.type == _d.FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
                value_is_msg = f.message_type.fields_by_name["value"].type == _d.FieldDescriptor.TYPE_MESSAGE
                for k, x in v.items():
                    if value_is_msg:
                        target[k].CopyFrom(x)
                    else:
                        target[k] = x
            elif f.is_repeated:
                if f.type == _d.FieldDescriptor.TYPE_MESSAGE:
                    for x in v:
                        target.add().CopyFrom(x)
                else:
                    target.extend(v)
            elif f.type == _d.FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return st.fixed_dictionaries({}, optional=optional).map(build)


def payload_strategy(desc: _d.Descriptor) -> st.SearchStrategy[bytes]:
    """One request on the wire: a valid-shaped message, random bytes, or a valid message cut short."""
    valid = message_strategy(desc).map(lambda m: m.SerializeToString())
    truncated = st.tuples(valid, st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])])
    return st.one_of(valid, valid, st.binary(max_size=256), truncated)


@dataclass(frozen=True)
class Case:
    method: str
    """/package.Service/Method"""
    payloads: tuple[bytes, ...]
    token: bool
    """Whether the call carries the job token."""


def case_strategy(service: str) -> st.SearchStrategy[Case]:
    """A call to any RPC of `service` ("Coordinator" or "Peer"): one request, or 0-3 for a request stream."""
    sdesc = pb.DESCRIPTOR.services_by_name[service]
    options = []
    for m in sdesc.methods:
        path = f"/atoll.v1.{service}/{m.name}"
        one = payload_strategy(m.input_type)
        payloads = st.lists(one, min_size=0, max_size=3) if m.client_streaming else one.map(lambda p: [p])
        options.append(st.builds(Case, st.just(path), payloads.map(tuple), st.sampled_from([True, True, True, False])))
    return st.one_of(options)


def methods(service: str) -> list[_d.MethodDescriptor]:
    return list(pb.DESCRIPTOR.services_by_name[service].methods)


@dataclass
class Outcome:
    code: str
    seconds: float
    hang: bool
    wrong: bool


def call(channel: grpc.Channel, case: Case) -> Outcome:
    """Send `case` as raw bytes and classify the answer."""
    service, name = case.method.rsplit("/", 2)[1:]
    m = pb.DESCRIPTOR.services_by_name[service.split(".")[-1]].methods_by_name[name]
    long_lived = case.method in LONG_LIVED
    deadline = LONG_LIVED_DEADLINE_S if long_lived else CALL_DEADLINE_S
    metadata = (("authorization", f"Bearer {TOKEN}"),) if case.token else ()
    t0 = time.monotonic()
    code = "OK"
    try:
        if m.client_streaming and m.server_streaming:
            for i, _ in enumerate(channel.stream_stream(case.method)(iter(case.payloads), timeout=deadline,
                                                                     metadata=metadata)):
                if i >= 3:
                    break
        elif m.client_streaming:
            channel.stream_unary(case.method)(iter(case.payloads), timeout=deadline, metadata=metadata)
        elif m.server_streaming:
            stream = channel.unary_stream(case.method)(case.payloads[0], timeout=deadline, metadata=metadata)
            for i, _ in enumerate(stream):
                if i >= 3:
                    stream.cancel()
                    break
        else:
            channel.unary_unary(case.method)(case.payloads[0], timeout=deadline, metadata=metadata)
    except grpc.RpcError as e:
        code = e.code().name  # type: ignore[attr-defined]
    seconds = time.monotonic() - t0
    hang = code == "DEADLINE_EXCEEDED" and not long_lived
    return Outcome(code=code, seconds=seconds, hang=hang, wrong=code in WRONG)


# --- the servers under test, each in a process of its own ----------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


PEER_MAIN = """
import sys, time
from pathlib import Path
from atoll.fsutil import atomic_write_text
from atoll.node.peer import PeerServer
s = PeerServer(node_id="n1", listen="127.0.0.1:0", token=sys.argv[2])
atomic_write_text(Path(sys.argv[1]), s.address + "\\n")
while True:
    time.sleep(3600)
"""


@dataclass
class Server:
    """A server under test, in its own process."""

    service: str
    proc: subprocess.Popen
    address: str
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)

    def alive(self) -> bool:
        """The process runs and answers a valid call within 10 s."""
        if self.proc.poll() is not None:
            return False
        probe = Case(method="/atoll.v1.Coordinator/GetStatus", payloads=(pb.StatusRequest().SerializeToString(),),
                     token=True) if self.service == "Coordinator" else Case(
            method="/atoll.v1.Peer/HeldState", payloads=(pb.HeldStateRequest().SerializeToString(),), token=True)
        return call(self.channel, probe).code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    def rss_mb(self) -> float:
        return _rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_for(path: Path, proc: subprocess.Popen, what: str, log: Path) -> str:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > 120:
            raise RuntimeError(f"the {what} did not start; see {log}")
        time.sleep(0.1)
    return path.read_text().strip()


def start_coordinator(work: Path) -> Server:
    (work / "token").write_text(TOKEN + "\n")
    job = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"
    log = work / "coordinator.log"
    proc = subprocess.Popen([sys.executable, "-m", "atoll", "coordinator", "--job", str(job), "--insecure",
                             "--listen", "127.0.0.1:0", "--state-dir", str(work / "state"),
                             "--token-file", str(work / "token"), "--address-file", str(work / "coordinator.addr")],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    server = Server("Coordinator", proc, _wait_for(work / "coordinator.addr", proc, "coordinator", log))
    join = server.channel.unary_unary("/atoll.v1.Coordinator/Join", request_serializer=pb.JoinRequest.SerializeToString,
                                      response_deserializer=pb.JoinReply.FromString)
    try:
        for i, n in enumerate(KNOWN_NODES):  # members, so calls naming them reach past the membership check
            join(pb.JoinRequest(token=TOKEN, node_id=n, peer_address=f"127.0.0.1:{2000 + i}", profile=pb.NodeProfile(
                hostname=f"h{i}", device_kind="cpu", device_name="cpu", device_count=1, memory_total_bytes=1 << 30,
                cpu_count=1)), timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
    except BaseException:
        server.stop()
        raise
    return server


def start_peer(work: Path) -> Server:
    log = work / "peer.log"
    proc = subprocess.Popen([sys.executable, "-c", PEER_MAIN, str(work / "peer.addr"), TOKEN],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return Server("Peer", proc, _wait_for(work / "peer.addr", proc, "peer server", log))


@dataclass
class Tally:
    cases: int = 0
    hangs: int = 0
    wrong: int = 0
    codes: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    by_method: Counter = field(default_factory=Counter)

    def add(self, case: Case, out: Outcome) -> None:
        self.cases += 1
        self.codes[out.code] += 1
        self.by_method[case.method.rsplit("/", 1)[1]] += 1
        if out.hang or out.wrong:
            self.hangs += out.hang
            self.wrong += out.wrong
            if len(self.examples) < 5:
                self.examples.append(f"{case.method} -> {out.code} after {out.seconds:.1f}s "
                                     f"(payloads {[p[:32].hex() for p in case.payloads]})")


def run_cases(service: str, channel: grpc.Channel, n: int, on_case) -> None:
    """`n` hypothesis-generated cases against `service`, each sent over `channel` and handed to `on_case`."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=n, phases=[Phase.generate], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=case_strategy(service))
    def one(case: Case) -> None:
        on_case(case, call(channel, case))

    one()


def fuzz_service(server: Server, cases: int) -> dict:
    valid = Case(method="/atoll.v1.Coordinator/GetStatus", payloads=(pb.StatusRequest().SerializeToString(),),
                 token=True) if server.service == "Coordinator" else Case(
        method="/atoll.v1.Peer/HeldState", payloads=(pb.HeldStateRequest().SerializeToString(),), token=True)
    # baseline: valid calls, as many as a tenth of the cases
    base_n = max(100, cases // 10)
    call(server.channel, valid)
    rss0, t0 = server.rss_mb(), time.monotonic()
    for _ in range(base_n):
        call(server.channel, valid)
    base = {"calls": base_n, "seconds": time.monotonic() - t0, "rss_growth": server.rss_mb() / rss0 - 1}
    tally = Tally()
    marks: dict[str, float] = {}
    warm = max(1, cases // 10)
    t0 = time.monotonic()

    def on_case(case: Case, out: Outcome) -> None:
        tally.add(case, out)
        if tally.cases == warm:
            marks["rss_warm"] = server.rss_mb()

    run_cases(server.service, server.channel, cases, on_case)
    seconds = time.monotonic() - t0
    # then as many requests that do not parse, without the token (the parse comes first): they must cost nothing
    # that stays (grpc kept ~19 KB of each one it answered INTERNAL)
    first = next(m for m in methods(server.service) if not m.client_streaming)  # read before any check
    garbage = Case(f"/atoll.v1.{server.service}/{first.name}", (b"\xff" * 12,), False)
    rss_garbage0 = server.rss_mb()
    garbage_codes: Counter = Counter(call(server.channel, garbage).code for _ in range(cases))
    crashed = not server.alive()
    rss_end = server.rss_mb() if not crashed else float("nan")
    rss_warm = marks.get("rss_warm", rss_end)
    return {"service": server.service, "tally": tally, "crashes": int(crashed), "seconds": seconds,
            "rss_warm": rss_warm, "rss_end": rss_end, "rss_growth": rss_end / rss_warm - 1, "base": base,
            "garbage": (garbage.method, cases, rss_garbage0, rss_end, garbage_codes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000, help="cases per service")
    ap.add_argument("--services", default="Coordinator,Peer")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="atoll-fuzz-"))
    print(f"fuzzing {args.services} with {args.cases} cases each; servers log to {work}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    results = []
    for service in args.services.split(","):
        server = start_coordinator(work) if service == "Coordinator" else start_peer(work)
        try:
            results.append(fuzz_service(server, args.cases))
        finally:
            server.stop()
    targets: dict[str, bool] = {}
    for r in results:
        t, b = r["tally"], r["base"]
        print(f"\n{r['service']}: {t.cases} cases over {len(t.by_method)} RPCs in {r['seconds']:.0f}s "
              f"({1000 * r['seconds'] / max(t.cases, 1):.1f} ms a case; baseline: {b['calls']} valid calls at "
              f"{1000 * b['seconds'] / b['calls']:.1f} ms)")
        print(f"  crashes {r['crashes']}   hangs {t.hangs}   wrong codes (INTERNAL/UNKNOWN) {t.wrong}")
        print(f"  RSS {r['rss_warm']:.0f} MB after the first tenth -> {r['rss_end']:.0f} MB at the end "
              f"({100 * r['rss_growth']:+.1f}%; baseline valid calls {100 * b['rss_growth']:+.1f}%)")
        method, n, g0, g1, gcodes = r["garbage"]
        print(f"  then {n} unparseable {method.rsplit('/', 1)[1]} requests without the token: RSS {g0:.0f} -> {g1:.0f} MB; "
              + ", ".join(f"{k} {v}" for k, v in gcodes.most_common()))
        print("  codes: " + ", ".join(f"{k} {v}" for k, v in t.codes.most_common()))
        for e in t.examples:
            print(f"  e.g. {e}")
        name = r["service"]
        targets[f"{name}: 0 crashes"] = r["crashes"] == 0
        targets[f"{name}: 0 hangs (got {t.hangs})"] = t.hangs == 0
        wrong = t.wrong + sum(v for k, v in r["garbage"][4].items() if k in WRONG)
        targets[f"{name}: 0 INTERNAL/UNKNOWN (got {wrong})"] = wrong == 0
        targets[f"{name}: RSS growth < 10% (got {100 * r['rss_growth']:.1f}%)"] = r["rss_growth"] < 0.10
    missed = [k for k, ok in targets.items() if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
