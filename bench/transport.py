"""Peer transport benchmark: the gRPC path against a raw TCP socket, then over a shaped link.

    python -m bench.transport            (or python bench/transport.py, from any folder; the shaped part needs
                                          root)

1. Loopback, 1/4/16/64 MiB float32 tensors: `GrpcTransport` (identity codec, chunked, checksummed,
   acknowledged per tensor) against a raw TCP socket carrying the same bytes with a one-byte
   acknowledgement per tensor. Sender and receiver are separate processes in both cases. A bare gRPC
   stream of the same bytes (no protobuf, codec or checks) shows how much of the gap is gRPC's own.
2. Two network namespaces joined by a veth pair shaped to 100 Mbit/s with tc tbf: achieved bytes/s of
   the identity codec against the shaped rate, and tensors/s with identity, int8 and int4.

3. The door's check of a received tensor (`atoll.node.door.tensor_norm`, one reduction): its time against the
   codec's decode of the same tensor (identity, int8) and against a stage's forward and backward of the
   micro-batch, for the tiny job's activations and a 125M-class layer's (`python -m bench.transport --door`
   runs only this part; on a GPU when one is there).

Targets: gRPC >= 50% of raw TCP at 16 MiB; >= 85% of the shaped rate; int8 >= 3.5x the tensors/s of
identity on the shaped link; the door's check at most 3% of a step's compute. Ends with `targets met: N/M`.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/transport.py): `bench` imports from the checkout
    sys.path.insert(0, str(ROOT))
MiB = 1 << 20


# --- the worker processes: one sends, one receives; commands arrive as JSON lines on stdin ------------------

def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _transport(role: str, server, peer: str, epoch: int, codec: str, shape: tuple[int, ...]):
    from atoll.compression import CodecSpec
    from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef

    other = PeerRef(node_id="recv" if role == "send" else "send", address=peer)
    return GrpcTransport(GrpcTransportConfig(
        job_id="bench", node_id=server.node_id, plan_epoch=epoch, stage=0 if role == "send" else 1,
        upstream=None if role == "send" else other, downstream=other if role == "send" else None,
        token="bench", shape=shape, forward_codec=CodecSpec(codec), backward_codec=CodecSpec(codec),
        max_in_flight_bytes=128 * MiB, max_tensor_bytes=64 * MiB, max_buffered_bytes=512 * MiB,
        call_timeout=timedelta(seconds=120), delivery_timeout=timedelta(seconds=120)), server)


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("the sender closed the socket mid-tensor")
        got += n


BARE_METHOD = "/atoll.bench.Bare/Push"


def _bare_receiver(host: str, count: int) -> None:
    """A gRPC server that joins the raw chunks of each call into a fresh tensor: gRPC without our layers."""
    import threading

    import grpc
    import torch

    from atoll.rpc import RpcOptions, make_server

    calls, done, cpu = [0], threading.Event(), [0.0]

    def push(chunks, context):
        if calls[0] == 1:
            cpu[0] = time.process_time()
        torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.float32)
        calls[0] += 1
        if calls[0] == count + 1:
            cpu[0] = time.process_time() - cpu[0]
            done.set()
        return b"k"

    handler = grpc.method_handlers_generic_handler(
        "atoll.bench.Bare", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server = make_server(f"{host}:0", [lambda s: s.add_generic_rpc_handlers((handler,))], RpcOptions())
    _say({"address": server.address})
    done.wait(300)
    server.stop()
    _say({"cpu_seconds": cpu[0]})


def _bare_sender(address: str, nbytes: int, count: int) -> None:
    import torch

    from atoll.rpc import RpcOptions, make_channel

    data = memoryview(torch.randn(nbytes // 4).numpy()).cast("B")
    chunk = 1 * MiB
    channel = make_channel(address, RpcOptions())
    push = channel.stream_unary(BARE_METHOD)

    def one() -> None:
        if push((bytes(data[o:o + chunk]) for o in range(0, nbytes, chunk)), timeout=120) != b"k":
            raise ConnectionError("the receiver did not acknowledge")

    one()
    t0, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        one()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
    channel.close()
    _say({"seconds": seconds, "bytes_wire": count * nbytes, "bytes_raw": count * nbytes, "cpu_seconds": cpu})


def _worker(role: str, host: str) -> None:
    import torch

    from atoll.node.peer import PeerServer
    from atoll.node.transport import TensorKey

    server = PeerServer(node_id=role, listen=f"{host}:0", token="bench")
    _say({"address": server.address})
    peer = json.loads(sys.stdin.readline())["peer"]
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        count, nbytes = cmd["count"], cmd["nbytes"]
        shape = (nbytes // 4 // 1024, 1024)
        if cmd["op"] == "grpc":
            t = _transport(role, server, peer, cmd["epoch"], cmd["codec"], shape)
            keys = [TensorKey(0, i, "forward") for i in range(count + 1)]  # the first one warms up
            if role == "recv":
                _say({"ready": True})
                t.recv(keys[0], timedelta(seconds=120))
                cpu = time.process_time()
                for k in keys[1:]:
                    t.recv(k, timedelta(seconds=120))
                cpu = time.process_time() - cpu
                t.close()
                _say({"cpu_seconds": cpu})
            else:
                x = torch.randn(shape)
                t.send(keys[0], x)
                t.flush(timedelta(seconds=120))
                t.link_stats()
                t0, cpu = time.perf_counter(), time.process_time()
                for k in keys[1:]:
                    t.send(k, x)
                t.flush(timedelta(seconds=300))
                seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
                stats = t.link_stats()[0]
                t.close()
                _say({"seconds": seconds, "bytes_wire": stats.bytes_wire, "bytes_raw": stats.bytes_raw,
                      "cpu_seconds": cpu})
        elif cmd["op"] == "bare":
            if role == "recv":
                _bare_receiver(host, count)
            else:
                _bare_sender(cmd["address"], nbytes, count)
        elif cmd["op"] == "tcp":
            if role == "recv":
                with socket.create_server((host, 0)) as ls:
                    _say({"port": ls.getsockname()[1]})
                    conn, _ = ls.accept()
                    with conn:
                        for i in range(count + 1):
                            if i == 1:
                                cpu = time.process_time()
                            head = bytearray(8)
                            _recv_exact(conn, memoryview(head))
                            # a fresh buffer per tensor, as the receiver hands each tensor on to the stage
                            buf = bytearray(struct.unpack("<Q", head)[0])
                            _recv_exact(conn, memoryview(buf))
                            torch.frombuffer(buf, dtype=torch.float32)
                            conn.sendall(b"k")
                _say({"cpu_seconds": time.process_time() - cpu})
            else:
                payload = torch.randn(shape).numpy().tobytes()
                with socket.create_connection((cmd["host"], cmd["port"]), timeout=120) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    head = struct.pack("<Q", len(payload))

                    def one() -> None:
                        s.sendall(head)
                        s.sendall(payload)
                        if s.recv(1) != b"k":
                            raise ConnectionError("the receiver did not acknowledge")

                    one()
                    t0, cpu = time.perf_counter(), time.process_time()
                    for _ in range(count):
                        one()
                    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
                _say({"seconds": seconds, "bytes_wire": count * nbytes, "bytes_raw": count * nbytes,
                      "cpu_seconds": cpu})
    server.stop()


# --- the orchestration --------------------------------------------------------------------------------------

class _Proc:
    """A worker process; `popen` may start it inside a namespace (`Namespace.popen`)."""

    def __init__(self, argv: Sequence[str], popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.p = popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def tell(self, obj: dict) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def hear(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"worker {self.p.pid} said nothing for {timeout:.0f}s")
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.p.pid} exited with {self.p.wait(10)}")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.tell({"op": "quit"})
                self.p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(10)


class _Pair:
    """A receiving and a sending worker, introduced to each other."""

    def __init__(self, recv: _Proc, send: _Proc, recv_host: str):
        self.recv_host, self.recv, self.send = recv_host, recv, send
        r, s = self.recv.hear(60)["address"], self.send.hear(60)["address"]
        self.recv.tell({"peer": s})
        self.send.tell({"peer": r})
        self.epoch = 0

    def grpc(self, codec: str, nbytes: int, count: int) -> dict:
        self.epoch += 1
        cmd = {"op": "grpc", "codec": codec, "nbytes": nbytes, "count": count, "epoch": self.epoch}
        self.recv.tell(cmd)
        self.recv.hear()
        self.send.tell(cmd)
        result = self.send.hear()
        result["recv_cpu_seconds"] = self.recv.hear()["cpu_seconds"]
        return result

    def tcp(self, nbytes: int, count: int) -> dict:
        cmd = {"op": "tcp", "nbytes": nbytes, "count": count}
        self.recv.tell(cmd)
        port = self.recv.hear()["port"]
        self.send.tell({**cmd, "host": self.recv_host, "port": port})
        result = self.send.hear()
        result["recv_cpu_seconds"] = self.recv.hear()["cpu_seconds"]
        return result

    def bare(self, nbytes: int, count: int) -> dict:
        cmd = {"op": "bare", "nbytes": nbytes, "count": count}
        self.recv.tell(cmd)
        address = self.recv.hear()["address"]
        self.send.tell({**cmd, "address": address})
        result = self.send.hear()
        result["recv_cpu_seconds"] = self.recv.hear()["cpu_seconds"]
        return result

    def close(self) -> None:
        self.send.close()
        self.recv.close()


def _worker_argv(role: str, host: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--host", host]


def _rate(r: dict) -> float:
    return r["bytes_raw"] / r["seconds"]


def _cpu(r: dict) -> str:
    gib = r["bytes_raw"] / (1 << 30)
    return f"{r['cpu_seconds'] / gib:.2f} + {r['recv_cpu_seconds'] / gib:.2f}"


def loopback(sizes_mib: Sequence[int], target_bytes: int, rounds: int) -> list[tuple[int, dict, dict, dict]]:
    """(size MiB, best raw TCP, bare gRPC and GrpcTransport runs) per size; the paths alternate."""
    pair = _Pair(_Proc(_worker_argv("recv", "127.0.0.1")), _Proc(_worker_argv("send", "127.0.0.1")), "127.0.0.1")
    rows = []
    try:
        for mib in sizes_mib:
            count = max(3, target_bytes // (mib * MiB))
            tcp, bare, grpc_ = [], [], []
            for _ in range(rounds):
                tcp.append(pair.tcp(mib * MiB, count))
                bare.append(pair.bare(mib * MiB, count))
                grpc_.append(pair.grpc("identity", mib * MiB, count))
            rows.append((mib, max(tcp, key=_rate), max(bare, key=_rate), max(grpc_, key=_rate)))
    finally:
        pair.close()
    return rows


def shaped(rate_bits_per_s: float, tensor_mib: int, seconds: float) -> tuple[dict, dict[str, dict]]:
    """Over a tbf-shaped veth link: the raw TCP run and the gRPC run of each codec."""
    from bench.netns import shaped_link

    with shaped_link(rate_bits_per_s=rate_bits_per_s) as link:
        pair = _Pair(_Proc(_worker_argv("recv", link.b.ip), link.b.popen),
                     _Proc(_worker_argv("send", link.a.ip), link.a.popen), link.b.ip)
        try:
            per_identity = tensor_mib * MiB / (rate_bits_per_s / 8)
            count = max(3, int(seconds / per_identity))
            tcp = pair.tcp(tensor_mib * MiB, count)
            runs = {c: pair.grpc(c, tensor_mib * MiB, count * k) for c, k in (("identity", 1), ("int8", 4),
                                                                              ("int4", 7))}
        finally:
            pair.close()
    return tcp, runs


def _best(fn: Callable[[], object], sync: Callable[[], None], repeat: int) -> float:
    """The fastest of `repeat` timed calls of `fn` (seconds), after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def door_cost(device: str | None = None, repeat: int = 5) -> list[tuple[str, dict[str, float]]]:
    """Per case (the tiny job's stage, a 125M-class layer): seconds of the door's check of one received activation,
    of decoding it (identity, int8), and of the forward and backward of one micro-batch through the stage (the whole
    tiny stage; one 125M block, the smallest stage of that model). A stage takes in two tensors per micro-batch (an
    activation and a gradient), so the check's share of a step is 2 x check / (forward + backward)."""
    import torch

    from atoll.compression import CodecSpec, encode_tensor, get_codec
    from atoll.models import preset
    from atoll.node.door import tensor_norm
    from atoll.node.model import build_slice

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = []
    for name, model, rows, layers in (("tiny job, half the model", preset("tiny"), 4, (0, 3)),
                                      ("125M-class layer", preset("125m"), 4, (1, 2))):
        x = torch.randn(rows, model.seq_len, model.d_model, device=dev)
        row: dict[str, float] = {"check": _best(lambda: tensor_norm(x), sync, repeat)}
        for codec in ("identity", "int8"):
            enc = encode_tensor(x.cpu(), CodecSpec(codec=codec))
            c = get_codec(enc.spec)
            row[f"decode {codec}"] = _best(lambda: c.decode(enc.payload, enc.shape, enc.dtype).to(dev), sync, repeat)
        module = build_slice(model, *layers, device=dev)
        if module.is_first:
            inp = torch.randint(0, model.vocab_size, (rows, model.seq_len), device=dev)
        else:
            inp = x.clone().requires_grad_(True)

        def fb() -> None:
            module(inp).float().sum().backward()

        row["forward+backward"] = _best(fb, sync, max(2, repeat // 2))
        out.append((name, row))
    return out


def print_door_cost(device: str | None = None) -> list[tuple[str, bool]]:
    """Print `door_cost`'s table; the targets (the check at most 3% of a step's compute)."""
    rows = door_cost(device)
    print("The door's check of a received tensor (one fp32 norm): against its decode and a stage's compute")
    print(f"{'case':>26} | {'check':>9} | {'decode id':>9} | {'decode int8':>11} | {'of int8 decode':>14} | "
          f"{'fwd+bwd':>9} | {'of a step':>9}")
    print("-" * 104)
    targets = []
    for name, r in rows:
        share = 2 * r["check"] / r["forward+backward"]
        print(f"{name:>26} | {r['check'] * 1e3:>7.3f}ms | {r['decode identity'] * 1e3:>7.3f}ms | "
              f"{r['decode int8'] * 1e3:>9.3f}ms | {r['check'] / r['decode int8']:>14.1%} | "
              f"{r['forward+backward'] * 1e3:>7.1f}ms | {share:>9.2%}")
        targets.append((f"door check <= 3% of a step, {name} (got {share:.2%})", share <= 0.03))
    return targets


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4,16,64", help="loopback tensor sizes in MiB")
    ap.add_argument("--loopback-mib", type=int, default=128, help="MiB sent per size, path and round on loopback")
    ap.add_argument("--rounds", type=int, default=3, help="loopback runs per size and path; the best counts")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="rate of the shaped link, Mbit/s")
    ap.add_argument("--shaped-tensor-mib", type=int, default=4)
    ap.add_argument("--shaped-seconds", type=float, default=3.0, help="rough duration of the identity run")
    ap.add_argument("--worker", choices=("send", "recv"), help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--door", action="store_true", help="measure only the door's check of received tensors")
    ap.add_argument("--device", default=None, help="device of the door's check (default: cuda when present)")
    args = ap.parse_args(argv)
    if args.rate_mbit < 1:
        ap.error(f"--rate-mbit must be at least 1, got {args.rate_mbit:g}")
    if args.worker:
        _worker(args.worker, args.host)
        return 0
    if args.door:
        return _report(print_door_cost(args.device))

    targets: list[tuple[str, bool]] = []
    sizes = [int(s) for s in args.sizes.split(",")]
    print("Loopback, separate sender and receiver processes, one acknowledgement per tensor, a fresh receive")
    print("buffer per tensor. raw TCP: a socket with a length header. bare gRPC: the same bytes as 1 MiB messages")
    print("of one stream call, no protobuf, codec or checks. GrpcTransport: identity codec, chunked, CRC-32,")
    print(f"validated, mailbox. Best of {args.rounds} alternating runs; CPU: seconds per GiB, sender + receiver.")
    print(f"{'size':>8} | {'raw TCP MB/s':>12} | {'bare gRPC':>9} | {'transport':>9} | {'transport/TCP':>13} | "
          f"{'TCP CPU':>11} | {'bare CPU':>11} | {'transport CPU':>13}")
    print("-" * 106)
    for mib, tcp_run, bare_run, grpc_run in loopback(sizes, args.loopback_mib * MiB, args.rounds):
        tcp, bare, grpc_ = _rate(tcp_run), _rate(bare_run), _rate(grpc_run)
        print(f"{mib:>5} MiB | {tcp / 1e6:>12.1f} | {bare / 1e6:>9.1f} | {grpc_ / 1e6:>9.1f} | {grpc_ / tcp:>13.0%} | "
              f"{_cpu(tcp_run):>11} | {_cpu(bare_run):>11} | {_cpu(grpc_run):>13}")
        if mib == 16:
            targets.append((f"transport >= 50% of raw TCP at 16 MiB (got {grpc_ / tcp:.0%}; bare gRPC "
                            f"{bare / tcp:.0%})", grpc_ >= 0.5 * tcp))
    print()

    from bench.netns import netns_unavailable
    reason = netns_unavailable()
    rate = args.rate_mbit * 1e6
    if reason:
        print(f"Shaped link: not measured ({reason})")
        targets.append((f"identity achieves >= 85% of the shaped rate (not measured: {reason})", False))
        targets.append((f"int8 >= 3.5x the tensors/s of identity (not measured: {reason})", False))
    else:
        tcp, runs = shaped(rate, args.shaped_tensor_mib, args.shaped_seconds)
        shaped_bytes = rate / 8
        print(f"Shaped link: veth between two namespaces, tc tbf {args.rate_mbit:g} Mbit/s "
              f"({shaped_bytes / 1e6:.2f} MB/s), {args.shaped_tensor_mib} MiB float32 tensors")
        print(f"{'path':>14} | {'tensors':>7} | {'wire MB/s':>9} | {'of shaped':>9} | {'tensors/s':>9} | "
              f"{'vs identity':>11}")
        print("-" * 74)
        tcp_wire = tcp["bytes_wire"] / tcp["seconds"]
        print(f"{'raw TCP':>14} | {tcp['bytes_raw'] // (args.shaped_tensor_mib * MiB):>7} | "
              f"{tcp_wire / 1e6:>9.2f} | {tcp_wire / shaped_bytes:>8.0%} | "
              f"{tcp['bytes_raw'] / (args.shaped_tensor_mib * MiB) / tcp['seconds']:>9.2f} | {'':>11}")
        tps = {}
        for codec, r in runs.items():
            n = r["bytes_raw"] // (args.shaped_tensor_mib * MiB)
            tps[codec] = n / r["seconds"]
            wire = r["bytes_wire"] / r["seconds"]
            print(f"{'gRPC ' + codec:>14} | {n:>7} | {wire / 1e6:>9.2f} | {wire / shaped_bytes:>8.0%} | "
                  f"{tps[codec]:>9.2f} | {tps[codec] / tps['identity']:>10.2f}x")
        achieved = runs["identity"]["bytes_wire"] / runs["identity"]["seconds"]
        targets.append((f"identity achieves >= 85% of the shaped rate (got {achieved / shaped_bytes:.0%})",
                        achieved >= 0.85 * shaped_bytes))
        ratio = tps["int8"] / tps["identity"]
        targets.append((f"int8 >= 3.5x the tensors/s of identity (got {ratio:.2f}x)", ratio >= 3.5))
    print()
    targets += print_door_cost(args.device)
    return _report(targets)


def _report(targets: list[tuple[str, bool]]) -> int:
    print()
    for name, ok in targets:
        print(f"  [{'x' if ok else ' '}] {name}")
    met = sum(ok for _, ok in targets)
    missed = [name for name, ok in targets if not ok]
    print(f"targets met: {met}/{len(targets)}" + (f" (missed: {'; '.join(missed)})" if missed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
