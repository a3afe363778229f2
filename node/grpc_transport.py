"""The pipeline `Transport` over gRPC: one stage replica's links to its upstream and downstream peers.

Sending goes through a `PeerLink` per neighbour (codec choice, chunked Transfer calls, backpressure,
retries, measurement; see `atoll.node.peer_link`). Receiving: a `Mailbox` attached to the node's
`PeerServer` validates and buffers what the neighbours send; `recv` waits on it.

Next to a stage of another width a replica has several neighbours on that side (`RowPeer`s), each
training a range of rows of every micro-batch: `send` splits a tensor by row ranges, one slice per
neighbour, and `recv` assembles the micro-batch's tensor from every neighbour's slice in row order, so the
stage sees one (rows, seq, d) tensor either way. Every replica trains the mean loss over its own rows, so
an activation-gradient from a downstream replica of n' rows is scaled by n' / n on its way into a replica
of n rows: the gradients upstream of the boundary are then those of the receiver's own mean, as with
equal widths (where the scale is 1 and nothing is copied).

A neighbour stage may split its replicas into `Lanes`: micro-batch i is trained there only by lane i % L,
so this replica exchanges micro-batch i with that lane's replica(s) (a `PeerRef` or `RowPeer`s, as a plain
side): `send` and `recv` pick the routes of `key.micro_batch`'s lane. Each neighbour of every lane has its
own link, and the mailbox takes from a lane's sender only the micro-batches of that lane.

The caller must not modify a tensor in place after `send` until `flush` (as with isend).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from atoll.compression import CodecSpec, PolicyConfig
from atoll.node.door import Door, tensor_norm
from atoll.node.mailbox import Mailbox, MailboxClosed, ReceiveSpec
from atoll.node.peer import PeerServer
from atoll.node.peer_link import PeerLink
from atoll.node.reverse import RELAY_TARGET, DialerConfig, ReverseDialer
from atoll.node.transport import TensorKey, Transport, TransportError
from atoll.rpc import RpcOptions
from atoll.serde import codec_id
from atoll.types import LinkStats


@dataclass(frozen=True, kw_only=True)
class PeerRef:
    """A neighbour: its node id, the address of its Peer server and any emulated latency to it."""

    node_id: str
    address: str
    added_latency: timedelta = timedelta(0)
    """Emulation knob for testbeds (`atoll.node.wan`): each tensor sent to this peer is held this long
    before it goes on the wire, as a wide-area link's one-way latency would delay it; other tensors and
    links go on meanwhile. Zero (the default) outside testbeds."""
    route: str = "dial"
    """How tensors reach it: "dial" (its Peer server at `address`), "reverse" (it accepts no connections:
    over the Connect stream it opened to this node), "relay" (neither end accepts connections: a Transfer to
    the node at `relay`, which forwards it over the Connect stream this peer opened there)."""
    relay: str = ""
    """HOST:PORT of the relaying node (route "relay")."""
    relay_node: str = ""
    """Node id of the relaying node (route "relay"): the server at `relay` must hold its certificate (empty:
    any node's of the job)."""

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("PeerRef.node_id must not be empty")
        if self.route not in ("dial", "reverse", "relay"):
            raise ValueError(f"PeerRef.route must be dial, reverse or relay, got {self.route!r}")
        if self.route == "dial" and ":" not in self.address:
            raise ValueError(f"PeerRef.address must be HOST:PORT, got {self.address!r}")
        if self.route == "relay" and ":" not in self.relay:
            raise ValueError(f"PeerRef.relay must be the relaying node's HOST:PORT, got {self.relay!r}")
        if self.added_latency < timedelta(0):
            raise ValueError(f"PeerRef.added_latency must be >= 0, got {self.added_latency}")


@dataclass(frozen=True, kw_only=True)
class RowPeer:
    """A neighbour replica that trains rows [first, last) of every micro-batch: this replica exchanges with
    it the overlap of their rows (a neighbour stage of another width)."""

    peer: PeerRef
    rows: tuple[int, int]
    """The neighbour's whole share: rows [first, last) of every pipeline micro-batch."""

    def __post_init__(self) -> None:
        if not 0 <= self.rows[0] < self.rows[1]:
            raise ValueError(f"RowPeer {self.peer.node_id}: rows must be [first, last) with 0 <= first < last, "
                             f"got {self.rows}")


@dataclass(frozen=True)
class Lanes:
    """A neighbour stage whose replicas form lanes: micro-batch i is exchanged with `by_lane[i % len(by_lane)]`
    (each entry a PeerRef or a tuple of RowPeer, as a plain side is)."""

    by_lane: tuple[PeerRef | tuple[RowPeer, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.by_lane, tuple) or not self.by_lane:
            raise ValueError(f"Lanes needs a tuple of at least one lane, got {self.by_lane!r}")
        for lane, entry in enumerate(self.by_lane):
            if not isinstance(entry, PeerRef) and not (
                    isinstance(entry, tuple) and entry and all(isinstance(p, RowPeer) for p in entry)):
                raise ValueError(f"lane {lane} must be a PeerRef or a non-empty tuple of RowPeer, got {entry!r}")
        ids = [p.node_id for lane in range(len(self.by_lane)) for p in self.peers(lane)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a node appears in two lanes (or twice in one): {ids}; each replica of the "
                             f"neighbour stage trains one lane's micro-batches")

    def peers(self, lane: int) -> tuple[PeerRef, ...]:
        """The neighbours of `lane`, in row order."""
        entry = self.by_lane[lane]
        return (entry,) if isinstance(entry, PeerRef) else tuple(p.peer for p in entry)


Neighbours = PeerRef | tuple[RowPeer, ...] | Lanes | None
"""One side of a replica: one peer that carries all its rows, the row peers that share them, lanes of
either (one per micro-batch index modulo their number), or none."""


@dataclass(frozen=True)
class _Route:
    """What one neighbour carries of this replica's tensors."""

    peer: PeerRef
    lo: int
    hi: int
    """Rows [lo, hi) of this replica's tensor (from its own first row)."""
    whole: bool
    """The neighbour carries the whole tensor: nothing is sliced or assembled."""
    grad_scale: float
    """Factor on activation-gradients received from this neighbour: its rows / this replica's rows."""


@dataclass(frozen=True, kw_only=True)
class GrpcTransportConfig:
    """One stage replica's place in the plan and how its links behave."""

    job_id: str
    """Job id every tensor carries."""
    node_id: str
    """This node's id (the sender of every tensor)."""
    plan_epoch: int
    """Plan epoch; tensors of any other epoch are refused."""
    pipeline: int = 0
    """Pipeline index in the plan."""
    stage: int
    """Stage index in the pipeline."""
    replica: int = 0
    """Data-parallel rank of this node within its stage."""
    upstream: Neighbours
    """The previous stage's replica(s) this one exchanges with: a `PeerRef` that carries all of this
    replica's rows, or the `RowPeer`s whose rows overlap this replica's, in row order, or `Lanes` of
    either (micro-batch i goes to lane i % L); None on the first stage."""
    downstream: Neighbours
    """The next stage's replica(s), as `upstream`; None on the last stage."""
    shape: tuple[int, ...] | None
    """Shape of this replica's activations (and gradients) crossing the stage boundaries; None: not checked
    (only with `PeerRef` neighbours)."""
    rows: tuple[int, int] | None = None
    """This replica's rows [first, last) of every micro-batch; needed with `RowPeer` neighbours, whose rows
    must together cover it (and then `shape[0]` is last - first)."""
    dtype: torch.dtype = torch.float32
    """Dtype of activations and gradients."""
    micro_batches: int | None = None
    """Micro-batches per step, to refuse out-of-range indices; None: not checked."""
    token: str | None = None
    """Job token sent with every call."""
    rpc: RpcOptions = field(default_factory=RpcOptions)
    """Channel settings (message size, keepalive, TLS)."""
    forward_codec: CodecSpec | None = None
    """Codec of activations sent downstream; None lets the link policy choose per tensor."""
    backward_codec: CodecSpec | None = None
    """Codec of gradients sent upstream; None lets the link policy choose per tensor."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Link policy settings, used for directions without a fixed codec."""
    initial_bandwidth_bytes_per_s: float | None = None
    """Link bandwidth (from the probe or the plan) until transfers measure it; None: no estimate, so the
    policy starts with the least lossy codec."""
    latency: timedelta = timedelta(0)
    """One-way latency of the links (from the probe), for the policy's predictions."""
    overlap: timedelta | None = None
    """Compute time a transfer should hide under (the stage's time per micro-batch, from the plan): the
    policy picks the least lossy codec that fits in it. Required when a direction has no fixed codec."""
    chunk_bytes: int = 1024 * 1024
    """Payload bytes per chunk message."""
    parallel_calls: int = 2
    """Tensors a link works on at once. One streams its chunks at a time (so transfers measure the link);
    the others encode, or wait for the receiver to check and decode what they sent."""
    max_in_flight_bytes: int = 256 * 1024 * 1024
    """Raw bytes queued or being sent per link before `send` blocks."""
    call_timeout: timedelta = timedelta(seconds=60)
    """Deadline of one Transfer call (one tensor)."""
    send_timeout: timedelta = timedelta(seconds=120)
    """How long `send` may wait for room on a full link before failing."""
    delivery_timeout: timedelta = timedelta(seconds=120)
    """How long one tensor may be retried (peer unreachable, busy, not started) before the link fails."""
    retry_initial: timedelta = timedelta(milliseconds=50)
    """First backoff after a transient failure; doubled after each further one."""
    retry_max: timedelta = timedelta(seconds=2)
    """Longest backoff between retries."""
    step_window: int = 2
    """Steps a neighbour may run ahead of this stage."""
    max_tensor_bytes: int = 256 * 1024 * 1024
    """Largest tensor accepted from a neighbour (decoded, and on the wire)."""
    max_buffered_bytes: int = 1024 * 1024 * 1024
    """Bytes the mailbox may hold (waiting tensors and tensors being received)."""
    accept_codecs: frozenset[str] | None = None
    """Codec names accepted from the neighbours (e.g. the job's fixed codec); None accepts every codec."""
    accepts_connections: bool = True
    """False for a node behind NAT or a firewall: it opens a Connect stream to each neighbour it can dial (and
    to the relay of each it cannot), and receives its tensors over them (`atoll.node.reverse`)."""

    def __post_init__(self) -> None:
        if self.upstream == () or self.downstream == ():
            raise ValueError("give None, not an empty tuple, for a side without neighbours")
        if self.upstream is None and self.downstream is None:
            raise ValueError("a transport needs an upstream or a downstream peer; a one-stage pipeline needs none")
        for side in ("upstream", "downstream"):
            self._check_side(side, getattr(self, side))
        ids = [r.peer.node_id for side in ("upstream", "downstream") for r in self.all_routes(side)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a neighbour appears twice among this replica's peers: {ids}")
        if self.stage < 0 or self.pipeline < 0 or self.replica < 0 or self.plan_epoch < 0:
            raise ValueError("stage, pipeline, replica and plan_epoch must be >= 0")
        if (self.stage == 0) != (self.upstream is None):
            raise ValueError(f"stage {self.stage}: only stage 0 has no upstream peer")
        if self.chunk_bytes < 1024 or self.chunk_bytes > self.rpc.max_message_bytes - 4096:
            raise ValueError(f"chunk_bytes must be in [1024, rpc.max_message_bytes - 4096 = "
                             f"{self.rpc.max_message_bytes - 4096}], got {self.chunk_bytes}")
        if (self.forward_codec is None or self.backward_codec is None) and self.overlap is None:
            raise ValueError("a direction without a fixed codec is chosen by the link policy, which needs `overlap` "
                             "(the stage's compute time per micro-batch); set it, or fix forward_codec and "
                             "backward_codec")
        if self.overlap is not None and self.overlap < timedelta(0):
            raise ValueError(f"overlap must be >= 0, got {self.overlap}")
        for name in self.accept_codecs or ():
            codec_id(name)  # raises on an unknown name
        if self.parallel_calls < 1:
            raise ValueError(f"parallel_calls must be at least 1, got {self.parallel_calls}")
        if self.max_in_flight_bytes < 1:
            raise ValueError(f"max_in_flight_bytes must be positive, got {self.max_in_flight_bytes}")
        if self.initial_bandwidth_bytes_per_s is not None and self.initial_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"initial_bandwidth_bytes_per_s must be positive or None, "
                             f"got {self.initial_bandwidth_bytes_per_s}")
        for name in ("call_timeout", "send_timeout", "delivery_timeout", "retry_initial", "retry_max"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def _check_side(self, side: str, peers: Neighbours) -> None:
        if isinstance(peers, Lanes):  # each lane is checked as a plain side (Lanes checked their types)
            for lane, entry in enumerate(peers.by_lane):
                self._check_side(f"{side} lane {lane}", entry)
            return
        if peers is None or isinstance(peers, PeerRef):
            return
        if not isinstance(peers, tuple) or not all(isinstance(p, RowPeer) for p in peers):
            raise ValueError(f"{side} must be a PeerRef, a tuple of RowPeer, Lanes or None, got {peers!r}")
        if self.rows is None or self.shape is None or not self.shape:
            raise ValueError(f"{side} neighbours given as RowPeer need this replica's `rows` and `shape`")
        a, b = self.rows
        if not 0 <= a < b or self.shape[0] != b - a:
            raise ValueError(f"rows must be [first, last) with 0 <= first < last and shape[0] = last - first; "
                             f"got rows {self.rows} and shape {self.shape}")
        spans = [p.rows for p in peers]
        adjacent = all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        if not adjacent or spans[0][0] > a or spans[-1][1] < b or spans[0][1] <= a or spans[-1][0] >= b:
            raise ValueError(f"the {side} neighbours' rows {spans} must be consecutive, in row order, and "
                             f"overlap and together cover this replica's rows {self.rows}")

    def lanes(self, side: str) -> int:
        """Lanes of the neighbours on `side`: 1 for a plain side (or none)."""
        peers: Neighbours = getattr(self, side)
        return len(peers.by_lane) if isinstance(peers, Lanes) else 1

    def routes(self, side: str, micro_batch: int | None = None) -> tuple[_Route, ...]:
        """What each neighbour on `side` ("upstream" or "downstream") carries of this replica's tensors of
        `micro_batch`: on a side of L `Lanes`, the routes of lane micro_batch % L (so `micro_batch` is then
        required, unless L is 1); a plain side ignores it."""
        peers: Neighbours = getattr(self, side)
        if isinstance(peers, Lanes):
            if micro_batch is None and len(peers.by_lane) > 1:
                raise ValueError(f"the {side} neighbours form {len(peers.by_lane)} lanes; give the micro-batch "
                                 f"whose lane's routes to use (or use all_routes for every lane's)")
            return self._routes_of(peers.by_lane[(micro_batch or 0) % len(peers.by_lane)])
        return self._routes_of(peers)

    def all_routes(self, side: str) -> tuple[_Route, ...]:
        """The routes of every neighbour on `side` over all its lanes (lane by lane; each neighbour once)."""
        peers: Neighbours = getattr(self, side)
        if isinstance(peers, Lanes):
            return tuple(r for entry in peers.by_lane for r in self._routes_of(entry))
        return self._routes_of(peers)

    def _routes_of(self, peers: PeerRef | tuple[RowPeer, ...] | None) -> tuple[_Route, ...]:
        if peers is None:
            return ()
        if isinstance(peers, PeerRef):
            n = self.shape[0] if self.shape else 0
            return (_Route(peer=peers, lo=0, hi=n, whole=True, grad_scale=1.0),)
        assert self.rows is not None
        a, b = self.rows
        return tuple(_Route(peer=p.peer, lo=max(a, p.rows[0]) - a, hi=min(b, p.rows[1]) - a,
                            whole=len(peers) == 1 and p.rows == self.rows,
                            grad_scale=(p.rows[1] - p.rows[0]) / (b - a)) for p in peers)

    def receive_spec(self) -> ReceiveSpec:
        up, down = self.all_routes("upstream"), self.all_routes("downstream")

        def senders(routes: tuple[_Route, ...]) -> str | tuple[str, ...] | None:
            if not routes:
                return None
            return routes[0].peer.node_id if len(routes) == 1 else tuple(r.peer.node_id for r in routes)

        return ReceiveSpec(
            job_id=self.job_id, plan_epoch=self.plan_epoch, pipeline=self.pipeline, stage=self.stage,
            upstream=senders(up), downstream=senders(down),
            sender_rows=tuple((r.peer.node_id, r.hi - r.lo) for r in up + down if not r.whole),
            sender_lanes=tuple((p.node_id, lane, len(peers.by_lane))
                               for peers in (self.upstream, self.downstream)
                               if isinstance(peers, Lanes) and len(peers.by_lane) > 1
                               for lane in range(len(peers.by_lane)) for p in peers.peers(lane)),
            shape=self.shape, dtype=self.dtype, micro_batches=self.micro_batches, step_window=self.step_window,
            max_tensor_bytes=self.max_tensor_bytes, max_buffered_bytes=self.max_buffered_bytes,
            codecs=None if self.accept_codecs is None else frozenset(codec_id(c) for c in self.accept_codecs))


class GrpcTransport(Transport):
    """`Transport` for one stage replica over gRPC; receives through `server`, which the node owns."""

    def __init__(self, config: GrpcTransportConfig, server: PeerServer, door: Door | None = None):
        self.config = config
        self._server = server
        self.door = door
        """Checks every tensor received (`atoll.node.door`): its norm is taken as it is decoded, and judged as the
        stage takes it; None: nothing is checked."""
        self.mailbox = Mailbox(config.receive_spec(), max_chunk_bytes=config.rpc.max_message_bytes,
                               measure=tensor_norm if door is not None else None)
        # one link per neighbour (of every lane): activations go downstream, gradients upstream
        self._links_of: dict[str, dict[str, PeerLink]] = {
            side: {r.peer.node_id: PeerLink(config, r.peer, direction, server.reverse)
                   for r in config.all_routes(side)}
            for side, direction in (("downstream", "forward"), ("upstream", "backward"))}
        # per side, per lane (one on a plain side): each neighbour's route and the link that sends to it
        self._sides: dict[str, tuple[tuple[tuple[_Route, PeerLink], ...], ...]] = {
            side: tuple(tuple((r, links[r.peer.node_id]) for r in config.routes(side, lane))
                        for lane in range(config.lanes(side)))
            for side, links in self._links_of.items()}
        self._closed = False
        server.attach(self.mailbox)
        self.dialer: ReverseDialer | None = None
        if not config.accepts_connections:
            targets, names, senders = {}, {}, {}
            routes = config.all_routes("upstream") + config.all_routes("downstream")
            for r in routes:
                if r.peer.route == "dial":
                    targets[r.peer.node_id] = r.peer.address
                elif r.peer.route != "relay":
                    raise ValueError(f"{r.peer.node_id} and this node both accept no connections; the plan must "
                                     f"name a relay for their link")
            by_address = {a: t for t, a in targets.items()}
            for r in routes:
                if r.peer.route != "relay":
                    continue
                # a relay that is also a neighbour gets one stream, carrying its own tensors and those it relays
                # (the relay's server keys streams by the dialing node's id, so a second one would replace the first)
                mine = r.peer.relay_node if r.peer.relay_node in targets else by_address.get(r.peer.relay)
                if mine is not None:
                    senders.setdefault(mine, {mine}).add(r.peer.node_id)
                    continue
                targets[f"{RELAY_TARGET}{r.peer.relay}"] = r.peer.relay
                if r.peer.relay_node:
                    names[f"{RELAY_TARGET}{r.peer.relay}"] = r.peer.relay_node
            self.dialer = ReverseDialer(DialerConfig(node_id=config.node_id, token=config.token, rpc=config.rpc),
                                        targets, lambda: server.receiver, names=names,
                                        senders={t: frozenset(s) for t, s in senders.items()})

    @property
    def _links(self) -> list[PeerLink]:
        return [link for links in self._links_of.values() for link in links.values()]

    def _side(self, key: TensorKey, verb: str) -> tuple[tuple[_Route, PeerLink], ...]:
        """The routes and links `key` goes over: those of its micro-batch's lane on the side it crosses."""
        # forward tensors are sent downstream and received from upstream; backward ones the other way
        direction = key.direction
        where = ("downstream" if direction == "forward" else "upstream") if verb == "send" else \
            ("upstream" if direction == "forward" else "downstream")
        lanes = self._sides[where]
        side = lanes[key.micro_batch % len(lanes)]
        if not side:
            raise TransportError(f"stage {self.config.stage} has no {where} peer to {verb} {direction} tensors")
        return side

    def send(self, key: TensorKey, tensor: torch.Tensor) -> None:
        if self._closed:
            raise TransportError(f"{key}: the transport is closed")
        side = self._side(key, "send")
        rows = self.config.shape[0] if self.config.shape else None
        if rows is not None and not side[0][0].whole and tensor.shape[0] != rows:
            raise TransportError(f"{key}: the tensor has {tensor.shape[0]} rows; this replica trains {rows}")
        self.mailbox.advance(key.step)
        for route, link in side:
            link.enqueue(key, tensor if route.whole else tensor[route.lo:route.hi])

    def recv(self, key: TensorKey, timeout: timedelta) -> torch.Tensor:
        side = self._side(key, "receive")
        for _, link in side:  # a failed send to a neighbour means it is gone: fail now rather than time out
            link.raise_error()
        self.mailbox.advance(key.step)
        deadline = time.monotonic() + timeout.total_seconds()
        if len(side) == 1:  # one neighbour carries every row of this replica: its tensor is the whole
            route = side[0][0]
            part = self._take(key, route, deadline)
            if key.direction == "backward" and route.grad_scale != 1.0:
                part.mul_(route.grad_scale)  # the mailbox holds no reference to a taken tensor
            return part
        assert self.config.shape is not None  # RowPeer neighbours need it (checked by the config)
        out = torch.empty(self.config.shape, dtype=self.config.dtype)
        for route, _ in side:  # in row order; each slice was checked for its shape on arrival
            part = self._take(key, route, deadline)
            if key.direction == "backward" and route.grad_scale != 1.0:
                torch.mul(part, route.grad_scale, out=out[route.lo:route.hi])
            else:
                out[route.lo:route.hi].copy_(part)
        return out

    def _take(self, key: TensorKey, route: _Route, deadline: float) -> torch.Tensor:
        peer = route.peer.node_id
        try:
            tensor, norm = self.mailbox.take_measured(key, max(0.0, deadline - time.monotonic()), sender=peer)
            return tensor if self.door is None else self.door.admit(key, peer, tensor, norm)
        except TimeoutError as e:
            raise TransportError(f"from {peer}: {e}") from None
        except MailboxClosed as e:
            raise TransportError(str(e)) from None

    def flush(self, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        for link in self._links:
            link.flush(deadline)

    def link_stats(self) -> list[LinkStats]:
        """Traffic sent on each link since the last call (for the step's metrics)."""
        return [link.take_stats() for link in self._links]

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop receiving and sending; tensors not yet delivered are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.detach(self.mailbox)
        self.mailbox.close()
        if self.dialer is not None:
            self.dialer.close()
        for link in self._links:
            link.close(timeout.total_seconds())

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
