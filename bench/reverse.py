"""Reverse streams and relays: what a node behind NAT costs its links.

    python -m bench.reverse              (or python bench/reverse.py, from any folder)

One stage sends float32 activations to the next over loopback, through the real `GrpcTransport`, three ways:
the baseline, where the receiver accepts connections and the sender dials its Peer server; reverse, where the
receiver accepts none (`listen=None`) and the sender's tensors travel over the Connect stream the receiver
opened (`atoll.node.reverse`); relay, where neither accepts connections and a third node forwards every tensor.
Sender, receiver and relay run in this one process (threads), so all three paths share its interpreter; the
paths alternate round by round and the best round of each counts, so load drift weighs on all of them.

Targets: reverse >= 60% of the baseline's bytes/s at 4 MiB tensors; relay (two hops, each chunk re-framed by
the relay) >= 30%. Ends with `targets met: N/M`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a path (python bench/reverse.py): `bench` imports from the checkout
    sys.path.insert(0, str(ROOT))
MiB = 1 << 20
PATHS = ("dial", "reverse", "relay")


def _pair(stack: ExitStack, path: str, shape: tuple[int, ...], count: int):
    """Sender and receiver transports of stages 0 and 1 connected along `path`."""
    from atoll.compression import CodecSpec
    from atoll.node.grpc_transport import GrpcTransport, GrpcTransportConfig, PeerRef
    from atoll.node.peer import PeerServer

    listen = {"dial": ("127.0.0.1:0", "127.0.0.1:0"), "reverse": ("127.0.0.1:0", None), "relay": (None, None)}[path]
    servers = [stack.enter_context(PeerServer(node_id=f"n{i}", listen=listen[i], token="t")) for i in range(2)]
    relay = stack.enter_context(PeerServer(node_id="r", listen="127.0.0.1:0", token="t")) if path == "relay" else None

    def ref(i: int) -> PeerRef:
        if servers[i].listening:
            return PeerRef(node_id=f"n{i}", address=servers[i].address)
        if servers[1 - i].listening:
            return PeerRef(node_id=f"n{i}", address="", route="reverse")
        assert relay is not None
        return PeerRef(node_id=f"n{i}", address="", route="relay", relay=relay.address)

    identity = CodecSpec("identity")
    ts = [GrpcTransport(GrpcTransportConfig(
        job_id="bench", node_id=f"n{i}", plan_epoch=1, stage=i, upstream=ref(0) if i == 1 else None,
        downstream=ref(1) if i == 0 else None, token="t", shape=shape, micro_batches=count, step_window=10**6,
        forward_codec=identity, backward_codec=identity, accepts_connections=servers[i].listening),
        servers[i]) for i in range(2)]
    for t in ts:
        stack.callback(t.close)
        if t.dialer is not None and not t.dialer.wait_connected(30):
            raise RuntimeError(f"{path}: the Connect streams did not open within 30 s")
    return ts


def measure(path: str, tensor_mib: int, total_mib: int) -> float:
    """Bytes/s of `total_mib` MiB sent from stage 0 to stage 1 in tensors of `tensor_mib` MiB along `path`."""
    import torch

    from atoll.node.transport import TensorKey

    count = max(1, total_mib // tensor_mib)
    shape = (tensor_mib * MiB // 4 // 1024, 1024)
    x = torch.randn(shape)
    with ExitStack() as stack:
        sender, receiver = _pair(stack, path, shape, count)
        wait = timedelta(seconds=120)
        sender.send(TensorKey(0, 0, "forward"), x)  # warm-up: channels, streams and the mailbox
        receiver.recv(TensorKey(0, 0, "forward"), wait)
        start = time.perf_counter()
        for mb in range(count):
            sender.send(TensorKey(1, mb, "forward"), x)
        for mb in range(count):
            receiver.recv(TensorKey(1, mb, "forward"), wait)
        sender.flush(wait)
        return count * tensor_mib * MiB / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor-mib", type=int, default=4, help="size of each tensor")
    ap.add_argument("--total-mib", type=int, default=256, help="MiB sent per path and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each path's best counts")
    args = ap.parse_args(argv)
    best = {p: 0.0 for p in PATHS}
    for r in range(args.rounds):
        for p in PATHS:
            got = measure(p, args.tensor_mib, args.total_mib)
            best[p] = max(best[p], got)
            print(f"round {r + 1}: {p:8s} {got / MiB:8.1f} MiB/s", flush=True)
    base = best["dial"]
    print(f"\n{args.tensor_mib} MiB tensors, best of {args.rounds} rounds of {args.total_mib} MiB:")
    for p in PATHS:
        print(f"  {p:8s} {best[p] / MiB:8.1f} MiB/s  {best[p] / base:6.1%} of the baseline (dial)")
    targets = [("reverse >= 60% of dial", best["reverse"] >= 0.6 * base),
               ("relay >= 30% of dial", best["relay"] >= 0.3 * base)]
    missed = [name for name, ok in targets if not ok]
    print(f"targets met: {len(targets) - len(missed)}/{len(targets)}" + (f" (missed: {'; '.join(missed)})"
                                                                          if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
