"""`atoll status`: fetch a coordinator's StatusReply and print it as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from atoll.job import resolve_token
from atoll.rpc import RpcOptions, make_channel
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc


def fetch_status(address: str, *, token: str | None, timeout: timedelta = timedelta(seconds=10),
                 rpc: RpcOptions | None = None) -> pb.StatusReply:
    """Ask the coordinator at `address`; raises ConnectionError / PermissionError with what to do."""
    channel = make_channel(address, rpc, token=token)
    try:
        # wait_for_ready: a coordinator that is (re)starting gets the whole timeout to come up
        return pb_grpc.CoordinatorStub(channel).GetStatus(pb.StatusRequest(), timeout=timeout.total_seconds(),
                                                          wait_for_ready=True)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise PermissionError(f"{address}: {e.details()}") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise ConnectionError(f"no coordinator answered at {address} within {timeout.total_seconds():g}s "
                                  f"({code.name}); check --coordinator (and --tls-ca if it serves TLS)") from None
        raise ConnectionError(f"{address}: {code.name}: {e.details()}") from None
    finally:
        channel.close()


def _rate(bps: float) -> str:
    if bps <= 0:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} B/s"


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(s: pb.StatusReply, now: float | None = None) -> str:
    now = time.time() if now is None else now
    out = [f"job {s.job.name} ({s.job.job_id})   plan epoch {s.plan.epoch if s.HasField('plan') else 0}   "
           f"step {s.step}   {s.tokens_per_second:.0f} tokens/s   last checkpoint "
           f"{s.last_checkpoint_step if s.last_checkpoint_step else '-'}"]
    alive = sum(1 for m in s.members if m.state == "alive")
    out.append(f"\nmembers: {alive} alive of {len(s.members)}")
    if s.members:
        rows = [["NODE", "STATE", "DEVICE", "MEMORY", "ADDRESS", "HEARTBEAT"]]
        for m in s.members:
            p = m.profile
            rows.append([m.node_id, m.state, f"{p.device_kind} x{p.device_count} {p.device_name}"[:48],
                         _bytes(p.memory_total_bytes), m.peer_address,
                         f"{max(0.0, now - m.last_heartbeat_unix):.1f}s ago"])
        out += _table(rows)
    out.append(f"\nislands: {len(s.islands)}")
    if s.islands:
        rows = [["ISLAND", "DEVICE", "GPUS", "INNER", "OUTER", "NODES"]]
        for i in s.islands:
            rows.append([i.id, i.device_name[:32], str(i.gpus), _rate(i.inner_bandwidth_bytes_per_s),
                         _rate(i.outer_bandwidth_bytes_per_s), ", ".join(i.node_ids)])
        out += _table(rows)
    if s.HasField("plan"):
        p = s.plan
        pred = p.predicted
        out.append(f"\nplan epoch {p.epoch}: {p.model}, global batch {p.global_batch}, seq {p.seq_len}, resume at "
                   f"step {p.resume_step}; predicted {pred.step_time_seconds:.3f} s/step, "
                   f"{pred.tokens_per_second:.0f} tokens/s" + (f", bottleneck: {pred.bottleneck}" if pred.bottleneck
                                                               else ""))
        for pl in p.pipelines:
            out.append(f"  pipeline {pl.index}: micro-batch {pl.micro_batch} x {pl.num_micro_batches}")
            rows = [["STAGE", "ISLAND", "LAYERS", "DP", "NODES", "SEND", "RENDEZVOUS"]]
            for st in pl.stages:
                send = pb.Codec.Name(st.send.codec).removeprefix("CODEC_").lower() if st.HasField("send") else "-"
                rows.append([str(st.index), st.island, f"[{st.layer_start}, {st.layer_end})", str(st.dp),
                             ", ".join(st.node_ids), send, st.dp_rendezvous])
            out += _table(rows, "    ")
    else:
        out.append("\nno plan yet")
    return "\n".join(out)


def status_json(s: pb.StatusReply) -> str:
    return json.dumps(MessageToDict(s, preserving_proto_field_name=True), indent=2, sort_keys=True)


def run_status_cli(args: argparse.Namespace) -> int:

    token = resolve_token(args.token, args.token_file)
    rpc = RpcOptions(tls_root_ca=Path(args.tls_ca)) if args.tls_ca else None
    reply = fetch_status(args.coordinator, token=token, timeout=timedelta(seconds=args.timeout), rpc=rpc)
    print(status_json(reply) if args.json else format_status(reply))
    return 0
