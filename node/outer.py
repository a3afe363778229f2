"""The outer sync of replica groups (the DiLoCo family, overlapped as Streaming DiLoCo does).

Each replica group trains a whole model replica with ordinary synchronous steps. Every node keeps, for
the parameters of its own layers:
- `anchor`: the outer parameters A, the same in every group;
- `snapshot`: its parameters S at the end of the last round.

At the end of round r (a fixed inner step of its group, the same for every node of the group):
1. with overlap, wait for the exchange of round r - 1 (the only wait on the wide area: a full round late)
   and *rebase*: P <- P + (A' - S), A <- A' (the progress made since the snapshot is kept);
2. snapshot S = P and the pseudo-gradient D = A - S;
3. start the exchange of round r in the background: each parameter has one *responsible* node per group
   (spread over the holders of its layer, so every data-parallel replica carries a share of the bytes);
   it encodes D under the plan's codec (error feedback keeps what a lossy codec drops) into its outbox,
   tells the coordinator it arrived (again with every question: a restarted coordinator hears it anew), and
   once the coordinator decides the round's participants (every group, or those in time by the deadline)
   fetches the same parameters' payloads of every other participant over gRPC (`Peer.FetchOuter`) from any
   node that holds them: the participant's responsible nodes, or the responsible nodes of any other group,
   which fetched them too and serve them on (a relay, when one link is cut). It retries for at most the
   plan's outer deadline (`OuterConfig.deadline`); a contribution out of reach past it is reported, and the
   coordinator decides the round again for everyone without it. No node leaves a contribution out on its
   own. Once the coordinator says the decision is final (every node holds its contributions), the node
   combines them (`combine_weights`: each group's counts once, their sum scaled to the longest participant's
   inner steps, so a slow region does not shrink the fast one's progress) and applies the outer optimizer
   (Nesterov momentum, or plain averaging with lr 1 and no momentum). The new values reach the other holders in the
   group through an all-reduce over the group's own (in-island) process group of the layer segment;
4. without overlap, wait for it at once and rebase.

A tied model's head on a stage without the embedding holds a copy of the embedding's weight (`atoll.node.tied`); a
group that keeps both on one stage has the weight once. The copy's outer state therefore travels under the
embedding's name (`OuterSync(aliases=...)`): its holder fetches every participant's contribution to the embedding,
its own group's included, from the holders of layer 0, and applies the same update to the same anchor, so the copy
stays equal to the embedding in every group however the groups cut the model. It sends nothing for the copy and
leaves it out of its norm and its anchor hashes.

Every node applies the same final decision to the same anchor, so the groups' outer parameters never drift,
including a group that was left out of a round (it still fetches the participants' payloads). Each node
reports a crc32 of its anchor per layer once a round landed (`anchor_hashes`); the coordinator flags any
mismatch.

Rounds by wall-clock time (`atoll.coordinator.pace` says why): a node reports with each arrival the median wall
time of the round's inner steps, its waits on the outer sync left out, and the coordinator's decision of round r
gives each group its inner steps for round r + 2. A node takes that figure from the decision only for a round it
has not started (every node of the group has applied round r's decision by the end of round r + 1, so all of them
switch at the same inner step, as their collectives need), and trains the plan's figure in a round no decision
named. A round's steps are numbered to end at a multiple of the plan's H (`OuterConfig.round_length`): every
group's step counter reads r x H at the end of round r - 1 however many steps it trained, so the job's last step,
its checkpoints and a resume are the same rounds for every group.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import MappingProxyType

import grpc
import torch
import torch.distributed as dist

from atoll.compression import ChunkAssembler, CodecError, CodecSpec, EncodedTensor, ErrorFeedback, encode_tensor
from atoll.compression.wire import chunk_frames, tensor_meta
from atoll.node import faults
from atoll.node.door import tensor_norm
from atoll.plan import Plan
from atoll.rpc import RpcOptions, make_channel, ready_within
from atoll.tls import node_dns_name
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.node.outer")

KEEP_ROUNDS = 4
"""Rounds of payloads a node keeps to serve: a group up to a few rounds late can still fetch them."""
MAX_NAMES_PER_FETCH = 4096
UNREACHABLE_S = 10.0
"""How long a holder that could not be connected to is tried only when no other source is left."""
OUTER_CONNECT_S = 3.0
"""How long a fetch waits for a connection to a holder before it tries the next (a relay): ten round trips of a
300 ms link, TLS included; the transfer itself is bounded by the round's deadline."""
STATE_ROUND_RETRIES = 8
"""Times a joining group fetches again the parts of a group's outer state that came from an older round than
the rest (waits of 0.05 s doubling to 1 s between them, about 4.5 s in all, within the deadline)."""


class OuterSyncError(RuntimeError):
    """An outer exchange could not complete; the message says which round, which peer and why."""


class Unconnected(OuterSyncError):
    """A holder this node could not connect to within the connect bound (`OUTER_CONNECT_S`)."""

    def __init__(self, address: str, message: str):
        super().__init__(message)
        self.address = address


class OutOfReach(OuterSyncError):
    """A participant's contribution could not be fetched from any node holding it within the bound (or its group is
    in no plan any more and nobody serves it): reported to the coordinator, which decides the round again."""


def origin_key(part: Participant) -> str:
    """How a relay names a participant whose payloads it serves on (`OuterFetchRequest.origin`): its since-epoch and
    first node (a node is in one group of an epoch)."""
    return f"{part.since_epoch}/{min(part.nodes)}"


def anchor_hashes(anchor: Mapping[str, torch.Tensor], round_: int) -> tuple[tuple[int, int, int], ...]:
    """(round, layer, crc32) of the anchor's tensors of each layer, by name in sorted order (every holder of a layer
    hashes the same bytes); -0.0 hashes as 0.0."""
    crcs: dict[int, int] = {}
    for name in sorted(anchor):
        layer = layer_of(name)
        t = anchor[name].detach()
        t = (t + 0 if t.is_floating_point() else t).cpu().contiguous().reshape(-1)
        crc = zlib.crc32(name.encode("utf-8"), crcs.get(layer, 0))
        crcs[layer] = zlib.crc32(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", crc)
    return tuple((round_, layer, crc) for layer, crc in sorted(crcs.items()))


def layer_of(name: str) -> int:
    """The model layer a parameter belongs to: names look like "layers.<i>.<...>"."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"parameter {name!r} is not named layers.<index>.<...>")
    return int(parts[1])


def group_index(plan: Plan, node_id: str) -> int:
    """The replica group of `plan` that `node_id` trains in."""
    for g, grp in enumerate(plan.groups):
        if any(node_id in st.nodes for p in grp.pipelines for st in plan.pipelines[p].stages):
            return g
    raise OuterSyncError(f"node {node_id} is in no replica group of plan epoch {plan.epoch}")


def group_holders(plan: Plan, group: int) -> dict[int, list[str]]:
    """Layer -> the nodes of replica group `group` that hold it, sorted."""
    holders: dict[int, set[str]] = {}
    for p in plan.groups[group].pipelines:
        for st in plan.pipelines[p].stages:
            for layer in range(*st.layers):
                holders.setdefault(layer, set()).update(st.nodes)
    return {layer: sorted(nodes) for layer, nodes in holders.items()}


def responsible(name: str, holders: Mapping[int, Sequence[str]]) -> str:
    """The node of a group that exchanges parameter `name` (a stable spread over its layer's holders)."""
    nodes = holders[layer_of(name)]
    return nodes[zlib.crc32(name.encode("utf-8")) % len(nodes)]


def _group_in(plan: Plan, part: Participant) -> int | None:
    """The index in `plan` of participant `part`'s replica group (the same since-epoch and nodes), or None."""
    for g, grp in enumerate(plan.groups):
        if (grp.since_epoch or plan.epoch) == part.since_epoch and plan.group_nodes(g) == set(part.nodes):
            return g
    return None


# --- the serving side -----------------------------------------------------------------------------------

class OuterOutbox:
    """Encoded payloads this node serves to other groups: per round its pseudo-gradients ("delta"), and its
    latest outer state ("state": anchor and momentum) for a group that rejoins. Thread-safe."""

    def __init__(self, *, job_id: str, epoch: int, node_id: str):
        self.job_id, self.epoch, self.node_id = job_id, epoch, node_id
        self._cond = threading.Condition()
        self._rounds: dict[int, dict[str, EncodedTensor]] = {}
        self._relays: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        """round -> origin_key -> the other participants' payloads this node fetched (decoded), served on."""
        self._state: tuple[int, dict[str, torch.Tensor]] | None = None
        self._closed = False

    def put_round(self, round_: int, payloads: dict[str, EncodedTensor]) -> None:
        with self._cond:
            self._rounds[round_] = payloads
            for old in [r for r in self._rounds if r <= round_ - KEEP_ROUNDS]:
                del self._rounds[old]
            self._cond.notify_all()

    def put_relay(self, round_: int, origin: str, tensors: dict[str, torch.Tensor]) -> None:
        """Another participant's payloads of `round_` this node fetched: served on to a node that cannot reach it."""
        with self._cond:
            self._relays.setdefault(round_, {})[origin] = tensors
            for old in [r for r in self._relays if r <= round_ - KEEP_ROUNDS]:
                del self._relays[old]

    def put_state(self, round_: int, tensors: dict[str, torch.Tensor]) -> None:
        """The outer state as of the start of `round_` (tensors are kept by reference: pass copies)."""
        with self._cond:
            self._state = (round_, tensors)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def frames(self, request: pb.OuterFetchRequest, wait: float) -> Iterator[bytes]:
        """The chunks of the requested tensors. Raises LookupError (not here yet: retry), KeyError (never
        here: a wrong name or a round long gone) or ValueError (a malformed request)."""
        if request.job_id != self.job_id:
            raise ValueError(f"this node trains job {self.job_id}, not {request.job_id[:80]!r}")
        if request.plan_epoch != self.epoch:
            raise LookupError(f"node {self.node_id} runs epoch {self.epoch} of its group, asked for "
                              f"{request.plan_epoch}; retry after the plan settles")
        if not 0 < len(request.names) <= MAX_NAMES_PER_FETCH:
            raise ValueError(f"ask for 1-{MAX_NAMES_PER_FETCH} parameters, got {len(request.names)}")
        if request.kind == "delta" and request.origin:
            if len(request.origin) > 200:
                raise ValueError(f"origin {request.origin[:40]!r}... is too long to name a participant")
            with self._cond:
                held = self._relays.get(request.round, {}).get(request.origin)
            if held is None:
                raise LookupError(f"node {self.node_id} holds no payloads of {request.origin} for round "
                                  f"{request.round} (yet)")
            encoded = []
            for name in request.names:
                if name not in held:
                    raise KeyError(f"node {self.node_id} did not fetch {name!r} of {request.origin} in round "
                                   f"{request.round}")
                # what the participant's codec decoded to, bit for bit (identity keeps every bit)
                encoded.append((name, encode_tensor(held[name], CodecSpec("identity"))))
        elif request.kind == "delta":
            deadline = time.monotonic() + wait
            with self._cond:
                while request.round not in self._rounds and not self._closed:
                    if request.round < min(self._rounds, default=request.round + 1):
                        raise KeyError(f"round {request.round} is no longer kept by {self.node_id}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LookupError(f"round {request.round} is not ready on {self.node_id} yet")
                    self._cond.wait(min(left, 1.0))
                payloads = self._rounds.get(request.round)
            if payloads is None:
                raise LookupError(f"node {self.node_id} is closing")
            encoded = []
            for name in request.names:
                if name not in payloads:
                    raise KeyError(f"node {self.node_id} does not exchange {name!r} in round {request.round}")
                encoded.append((name, payloads[name]))
        elif request.kind == "state":
            with self._cond:
                state = self._state
            if state is None:
                raise LookupError(f"node {self.node_id} holds no outer state yet")
            round_, tensors = state
            encoded = []
            for name in request.names:
                if name not in tensors:
                    if name.startswith("momentum/"):
                        continue  # none yet (no round exchanged, or no momentum): the fetcher starts it at zero
                    raise KeyError(f"node {self.node_id} holds no outer state for {name!r}")
                encoded.append((name, encode_tensor(tensors[name], CodecSpec("identity"))))
            request = pb.OuterFetchRequest(round=round_)
        else:
            raise ValueError(f"kind must be 'delta' or 'state', got {request.kind[:40]!r}")

        def gen() -> Iterator[bytes]:
            for name, enc in encoded:
                meta = tensor_meta(enc, {"job_id": self.job_id, "plan_epoch": self.epoch, "step": request.round,
                                         "direction": "outer", "name": name, "sender": self.node_id})
                yield from chunk_frames(meta, enc.payload)
        return gen()


class FetchChannels:
    """Channels to the peers a node fetches outer-sync payloads from, kept from round to round: a fetch over a warm
    channel pays no TCP and TLS handshake (two round trips on a wide-area link, and the handshake's CPU on a slow
    node) and no channel set-up. A channel a fetch failed on is dropped (the next fetch connects afresh) and closed
    once no fetch uses it: the holders of a contribution are fetched from at once, often over one channel, and
    closing it under the others failed their transfers too. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple, grpc.Channel] = {}
        self._users: dict[int, int] = {}  # id(channel) -> fetches using it

    def acquire(self, key: tuple, make: Callable[[], grpc.Channel]) -> grpc.Channel:
        with self._lock:
            channel = self._open.get(key)
            if channel is None:
                channel = self._open[key] = make()
            self._users[id(channel)] = self._users.get(id(channel), 0) + 1
            return channel

    def release(self, key: tuple, channel: grpc.Channel, *, failed: bool = False) -> None:
        """A fetch is done with `channel`; `failed`: it failed on it, so no later fetch takes it."""
        with self._lock:
            if failed and self._open.get(key) is channel:
                del self._open[key]
            left = self._users[id(channel)] = self._users.get(id(channel), 1) - 1
            close = left <= 0 and self._open.get(key) is not channel
            if left <= 0:
                del self._users[id(channel)]
        if close:
            channel.close()

    def close(self) -> None:
        """Close every kept channel (the node's outer sync ends: no fetch runs)."""
        with self._lock:
            channels, self._open = list(self._open.values()), {}
        for channel in channels:
            channel.close()


def fetch_outer(address: str, request: pb.OuterFetchRequest, *, token: str | None, rpc: RpcOptions,
                timeout: timedelta, latency: timedelta = timedelta(0), node: str | None = None,
                connect_timeout: timedelta | None = None, channels: FetchChannels | None = None
                ) -> tuple[dict[str, torch.Tensor], int, int]:
    """The tensors a peer serves for `request`: ({name: tensor}, the round they belong to, wire bytes).
    With mutual TLS and `node`, the server's certificate must be that node's. With `connect_timeout`, a peer not
    connected (TCP and TLS) within it raises OuterSyncError at once: a cut link drops packets without an answer,
    and the stream's own timeout (the whole transfer's) would hold the fetch that long before a relay is tried.
    With `channels`, the channel is taken from (and left in) them, and dropped if the fetch fails; else it is made
    for this fetch and closed after it."""
    server_name = node_dns_name(node) if node else None
    key = (address, server_name, token)
    if channels is not None:
        channel = channels.acquire(key, lambda: make_channel(address, rpc, token=token, server_name=server_name))
    else:
        channel = make_channel(address, rpc, token=token, server_name=server_name)
    ok = False
    try:
        if connect_timeout is not None:
            if not ready_within(channel, connect_timeout.total_seconds()):
                raise Unconnected(address, f"no connection to {address} within {connect_timeout.total_seconds():g}s "
                                           f"(the link may be down)")
        stream = pb_grpc.PeerStub(channel).FetchOuter(request, timeout=timeout.total_seconds())
        if latency > timedelta(0):
            time.sleep(latency.total_seconds())  # emulated wide-area latency (a testbed knob; 0 in production)
        assembler = ChunkAssembler()
        out: dict[str, torch.Tensor] = {}
        round_, nbytes = request.round, 0
        for chunk in stream:
            done = assembler.feed(chunk)
            if done is not None:
                out[done.meta.name] = done.tensor
                round_ = done.meta.step
                nbytes += done.wire_bytes
        assembler.finish()
        ok = True
    finally:
        if channels is None:
            channel.close()
        else:
            channels.release(key, channel, failed=not ok)
    missing = set(request.names) - set(out)
    if missing:
        raise OuterSyncError(f"{address} answered without {len(missing)} of the parameters asked for "
                             f"(e.g. {sorted(missing)[0]!r})")
    return out, round_, nbytes


# --- the training side ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Participant:
    group: int
    tokens: int
    since_epoch: int
    nodes: tuple[str, ...]


def same_group(a: Participant, b: Participant) -> bool:
    """Whether two participants are one replica group (the same since-epoch and nodes; indices may differ)."""
    return a.since_epoch == b.since_epoch and set(a.nodes) == set(b.nodes)


@dataclass(frozen=True, kw_only=True)
class RoundDecision:
    round: int
    participants: tuple[Participant, ...]
    version: int = 1
    """The coordinator's version of the decision: one more for each re-decision."""
    final: bool = True
    """Every node that must apply it holds its contributions: apply it."""
    checkpointer: Participant | None = None
    """The group that writes the job's checkpoints (None: the coordinator did not say)."""
    inner_steps: tuple[tuple[str, int, int], ...] = ()
    """(group name, since-epoch, inner steps) of each group in round `steps_round` (empty: the plan's)."""
    steps_round: int = 0


@dataclass(frozen=True, kw_only=True)
class RoundReport:
    """What a node tells the coordinator with every question about a round (each repeats the whole report, so a
    restarted coordinator hears it again)."""

    round: int
    tokens: int
    previous: RoundStats
    fetched_version: int = 0
    """The decision version whose every contribution this node holds (0: none yet)."""
    unreachable: tuple[Participant, ...] = ()
    """Participants of decision `version` whose contribution stayed out of this node's reach past the bound."""
    version: int = 0
    hashes: tuple[tuple[int, int, int], ...] = ()
    """(round, layer, crc32) of this node's anchor after the last round it landed (`anchor_hashes`)."""
    step_seconds: float = 0.0
    """Median wall time of the round's inner steps on this node, its waits on the outer sync left out (0: none
    timed)."""
    round_steps: int = 0
    """Inner steps that median is over."""
    norm: float | None = None
    """The L2 norm of the contribution this node serves for its group this round (what the others decode): the
    coordinator leaves a group whose contribution is not finite, or far above the others', out of the round."""
    hold_s: float = 0.0
    """A long poll: the coordinator may hold the question this long while its answer stays the same (0: answer
    at once)."""


@dataclass(frozen=True)
class Held:
    """What `Arrive` answers for a question the coordinator held (`RoundReport.hold_s`): ask again at once."""

    decision: RoundDecision | None
    """The round's decision as it stands (None: undecided)."""


Arrive = Callable[[RoundReport], "RoundDecision | Held | None"]
"""The node's report -> the round's decision as it stands (`Held` around it when the coordinator held the question),
or None while undecided or the coordinator is away."""

HOLD_S = 1.0
"""How long a node lets the coordinator hold its question about a round while it fetches nothing (a long poll: it
hears of the decision, and of its finality, as they happen instead of at its next poll)."""


@dataclass
class RoundStats:
    """What one exchange cost (reported with the next arrival, shown by `atoll status`)."""

    round: int = -1
    inner_step: int = 0
    """Inner steps the group had trained when the round began."""
    wire_bytes: int = 0
    seconds: float = 0.0
    late_seconds: float = 0.0
    participants: int = 0


@dataclass(kw_only=True)
class OuterConfig:
    """How this node syncs its layers with the other replica groups."""

    job_id: str
    node_id: str
    group: int
    """This node's replica group (index into plan.groups)."""
    inner_steps: int
    """Inner steps of this group in the round in progress: the plan's, or the coordinator's for a later round
    (`OuterSync` sets it at each round's start)."""
    codec: CodecSpec
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True
    overlap: bool = True
    apply_after: int = 0
    """With overlap: apply round r's average after this many inner steps of round r + 1 (waiting for it if it
    has not landed); 0 applies it at the end of round r + 1. Every node of a group applies it at the same step."""
    deadline: timedelta = timedelta(seconds=60)
    """The plan's outer deadline. It bounds the fetch of each contribution: retried from every node holding it for at
    most this long, then reported out of reach (the coordinator decides the round again without it)."""
    token: str | None = None
    rpc: RpcOptions = field(default_factory=RpcOptions)
    latency_to: Callable[[str], timedelta] = lambda node: timedelta(0)
    """One-way latency added before fetching from a node (an emulation knob for testbeds)."""
    round_length: int = 0
    """The plan's H: a round's steps are numbered to end at a multiple of it (`OuterSync.next_step`); no group
    trains more a round (0: `inner_steps`)."""


def combine_weights(tokens: Sequence[float]) -> list[float]:
    """The weight of each contribution (its group trained `tokens` this round) in the round's update: each group's
    pseudo-gradient counts once, and their sum is scaled to the longest participant's inner steps, so the update
    moves as far as the group that trained most moved alone:
    `update = (max_g s_g / sum_g s_g) x sum_g D_g` (s_g: group g's steps, in proportion to its tokens: every group
    trains the plan's batch a step).

    A weighted mean by tokens, `sum_g s_g D_g / sum_g s_g`, shrinks the update on uneven regions: early in training
    a group's D grows about linearly with its steps, so groups of 10, 5 and 2 steps a round moved the anchor 7.6
    steps' worth (129/17), less than the fastest region alone moves, and outer mode lost to its best region. Equal
    groups get the plain mean either way; one participant gets its own D (nothing is extrapolated). Empty where no
    group trained a token."""
    steps = [max(0.0, float(t)) for t in tokens]
    total = sum(steps)
    if total <= 0:
        return []
    scale = max(steps) / total
    return [scale if s > 0 else 0.0 for s in steps]


@dataclass
class _Result:
    round: int
    anchor: dict[str, torch.Tensor]
    stats: RoundStats
    decision: RoundDecision | None = None


class OuterSync:
    """The outer state of this node's layers and the exchange of each round (see the module docstring)."""

    aliases: Mapping[str, str] = MappingProxyType({})  # (`__init__` sets this node's)

    def __init__(self, config: OuterConfig, plan: Plan, params: Mapping[str, torch.nn.Parameter], *,
                 outbox: OuterOutbox, arrive: Arrive, segment_groups: Sequence[tuple[list[str], dist.ProcessGroup]] = (),
                 timeout: timedelta = timedelta(seconds=120), plan_source: Callable[[], Plan] | None = None,
                 stop: threading.Event | None = None, aliases: Mapping[str, str] | None = None):
        self.cfg, self.plan = config, plan
        self.aliases = dict(aliases or {})
        """Parameter -> the name its outer state travels under: a tied head's copy of the embedding weight (the
        embedding's name; see the module docstring). Its contributions are fetched under that name from the holders
        of that name's layer, its own group's included."""
        self.stop = stop
        """Set when the run ends (a newer plan that does not keep this group): a wait for an exchange gives up at
        once instead of running out its deadline (the exchange may wait on a group that is gone)."""
        self.plan_source = plan_source
        """The newest plan this node has adopted (read from the exchange thread): a round may be decided under a
        plan newer than `self.plan`, whose groups are then found there."""
        self.params = dict(params)
        self.outbox, self.arrive = outbox, arrive
        self.segment_groups = list(segment_groups)
        """(parameter names, process group of the other holders in this group) per shared layer segment."""
        self.timeout = timeout
        self.holders = {g: group_holders(plan, g) for g in range(len(plan.groups))}
        mine = self.holders[config.group]
        self.mine = sorted(n for n in self.params if responsible(n, mine) == config.node_id)
        """The parameters this node exchanges for its group."""
        self.anchor = {n: p.detach().clone() for n, p in self.params.items()}
        self.snapshot: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self.feedback = ErrorFeedback(config.codec) if config.codec.codec != "identity" else None
        self.round = 0
        """The next round to end."""
        self.tokens_in_round = 0
        self.steps_in_round = 0
        self.inner_steps_done = 0
        self.planned_steps = config.inner_steps
        """The plan's inner steps a round for this group: trained in a round no decision named."""
        self.round_length = config.round_length or config.inner_steps
        self._assigned: dict[int, int] = {}
        """round -> the inner steps the coordinator's decision gave this group for it (a round not started yet)."""
        self._clock: float | None = None
        """When the runner's previous inner step was counted (`after_step` returned): the next one is timed from it."""
        self._step_times: list[float] = []
        """Wall times of this round's inner steps, waits on the outer sync left out."""
        self.last = RoundStats()
        self.checkpointer: Participant | None = None
        """The checkpoint-writing group named by the last decision this node applied (None: none applied yet)."""
        self.writers: dict[int, Participant] = {}
        """Round -> the checkpoint-writing group its decision named (the newest rounds landed)."""
        self.taking_part: dict[int, tuple[Participant, ...]] = {}
        """Round -> the groups its decision averaged (the newest rounds landed)."""
        self._hashes: tuple[tuple[int, int, int], ...] = ()
        """This node's anchor hashes after the last round it landed, sent with its next arrival."""
        self._pending: Future[_Result] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atoll-outer")
        self._fetch_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="atoll-outer-fetch")
        self._holder_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="atoll-outer-holder")
        """The holders of one contribution are fetched from at once (a thread each, past the first)."""
        self._channels = FetchChannels()
        self._unreachable: dict[str, float] = {}
        """Address -> until when (time.monotonic) it is tried last: a connection to it failed (`Unconnected`)."""
        self.outbox.put_state(self.round, self._state_tensors())

    def _wire(self, name: str) -> str:
        """The name parameter `name`'s contributions and outer state travel under (its own, or an alias's)."""
        return self.aliases.get(name, name)

    # --- called by the runner between steps ----------------------------------------------------------

    def after_step(self, tokens: int) -> bool:
        """Count one inner step; at the round's end run the round-end procedure. True when a round ended."""
        now = time.perf_counter()
        if self._clock is not None:  # (the run's first step is not timed: it warms up)
            self._step_times.append(now - self._clock)
        try:
            self.tokens_in_round += tokens
            self.steps_in_round += 1
            self.inner_steps_done += 1
            if self.steps_in_round < self.cfg.inner_steps:
                if (self._pending is not None and self.cfg.overlap
                        and 0 < self.cfg.apply_after <= self.steps_in_round):
                    self._land()  # the previous round's average, applied as soon as it is due (less staleness)
                return False
            self.end_round()
            return True
        finally:
            self._clock = time.perf_counter()  # (the time spent here, on the outer sync, is not a step's)

    def next_step(self) -> int:
        """The number of the next inner step to train: a round's steps end at a multiple of `round_length`, so round r
        of n steps trains steps r x H + (H - n) ... (r + 1) x H - 1 (H = `round_length`)."""
        h = self.round_length
        return self.round * h + h - min(self.cfg.inner_steps, h) + self.steps_in_round

    def schedule_step(self) -> int:
        """Where the next inner step sits on the learning-rate schedule: the round's steps spread evenly over its H, so
        a group that trains fewer steps a round moves along the schedule as fast as the others, round for round."""
        h = self.round_length
        return self.round * h + self.steps_in_round * h // max(1, min(self.cfg.inner_steps, h))

    def count_late(self, tokens: int) -> bool:
        """Count an inner step a run ended on (superseded after its optimizer stepped), without ending a round or
        applying an exchange; False where the step ends the round (it is then not counted)."""
        if self.steps_in_round + 1 >= self.cfg.inner_steps:
            return False
        self.tokens_in_round += tokens
        self.steps_in_round += 1
        self.inner_steps_done += 1
        return True

    def end_round(self) -> None:
        if self.cfg.overlap and self._pending is not None:
            self._land()
        with torch.no_grad():
            self.snapshot = {n: p.detach().clone() for n, p in self.params.items()}
        # an alias (a tied copy) sends nothing: its contributions are the original's, fetched in `_exchange`
        deltas = {n: self.anchor[n] - self.snapshot[n] for n in self.mine if n not in self.aliases}
        fault = faults.injected()  # test-only (`atoll.node.faults`): None unless ATOLL_FAULT says otherwise
        if fault is not None:
            deltas = fault.poison(self.round * self.round_length, deltas)  # the round's first step
        round_, tokens = self.round, self.tokens_in_round
        pace = (statistics.median(self._step_times), len(self._step_times)) if self._step_times else (0.0, 0)
        self._step_times = []
        self.last.inner_step = self.inner_steps_done
        self.round += 1
        self.tokens_in_round = self.steps_in_round = 0
        self._pending = self._pool.submit(self._exchange, round_, tokens, deltas, self.last, self._hashes, pace)
        if not self.cfg.overlap:
            self._land()
        self._start_round()

    def _start_round(self) -> None:
        """The inner steps of the round now starting: the coordinator's figure for it (a decision of two rounds before,
        landed by now on every node of the group), else the plan's."""
        steps = self._assigned.pop(self.round, self.planned_steps)
        for old in [r for r in self._assigned if r < self.round]:
            del self._assigned[old]
        if steps != self.cfg.inner_steps:
            log.info("outer round %d: %d inner steps (%d the round before)", self.round, steps, self.cfg.inner_steps)
        self.cfg.inner_steps = steps

    def refresh(self, plan: Plan) -> None:
        """Follow a newer plan this run adopted (other groups may have been replanned): their holders and
        addresses. This node's own group, layers and holders are unchanged by construction."""
        if plan is self.plan:
            return
        self.plan = plan
        self.cfg.group = group_index(plan, self.cfg.node_id)
        self.holders = {g: group_holders(plan, g) for g in range(len(plan.groups))}

    def finish(self) -> None:
        """Land an exchange still in flight (at the end of training or before a checkpoint)."""
        if self._pending is not None:
            self._land()

    def close(self) -> None:
        self.outbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._holder_pool.shutdown(wait=False, cancel_futures=True)
        self._channels.close()

    def _land(self) -> None:
        assert self._pending is not None
        t0 = time.perf_counter()
        try:
            result = self._wait_pending(self._pending, self.timeout.total_seconds() + self.cfg.deadline.total_seconds())
        finally:
            self._pending = None
        result.stats.late_seconds = time.perf_counter() - t0
        with torch.no_grad():
            for n, p in self.params.items():
                p.add_(result.anchor[n] - self.snapshot[n])
        self.anchor = result.anchor
        self.last = result.stats
        if result.decision is not None:
            self.taking_part[result.round] = result.decision.participants
            if result.decision.checkpointer is not None:
                self.checkpointer = self.writers[result.round] = result.decision.checkpointer
            for kept in (self.taking_part, self.writers):  # the newest rounds only
                for old in [r for r in kept if r < result.round - 8]:
                    del kept[old]
        if result.decision is not None:
            self._take_steps(result.decision)
        # a tied copy is left out: a group that keeps the embedding with the head has no copy to hash in the head's
        # layer (the copy follows the embedding's anchor, hashed with layer 0)
        self._hashes = anchor_hashes({n: t for n, t in self.anchor.items() if n not in self.aliases}, result.round)
        self.outbox.put_state(self.round, self._state_tensors())
        if result.stats.late_seconds > 0.05:
            log.info("outer round %d landed %.2fs late (the exchange outlasted a round)", result.round,
                     result.stats.late_seconds)

    def _take_steps(self, decision: RoundDecision) -> None:
        """Keep this group's inner steps for the round a decision names, if this node has not started that round
        (`self.round` is the round in progress); a figure for a round already started is never taken."""
        if decision.steps_round <= self.round:
            return
        plan = self.plan
        group = plan.groups[self.cfg.group]
        since = group.since_epoch or plan.epoch
        steps = next((k for name, epoch, k in decision.inner_steps if name == group.name and epoch == since), None)
        if steps is not None and steps >= 1:
            self._assigned[decision.steps_round] = min(steps, self.round_length)

    def _wait_pending(self, pending: Future[_Result], seconds: float) -> _Result:
        """The exchange's result, waiting at most `seconds`; OuterSyncError once the run is stopped."""
        if self.stop is None:
            return pending.result(timeout=seconds)
        end = time.monotonic() + seconds
        while True:
            try:
                return pending.result(timeout=min(0.25, max(0.0, end - time.monotonic())))
            except FutureTimeout:
                self._check_stop()
                if time.monotonic() >= end:
                    raise

    # --- the exchange (background thread) ------------------------------------------------------------

    def _exchange(self, round_: int, tokens: int, deltas: dict[str, torch.Tensor], previous: RoundStats,
                  hashes: tuple[tuple[int, int, int], ...] = (), pace: tuple[float, int] = (0.0, 0)) -> _Result:
        t0 = time.perf_counter()
        encoded: dict[str, EncodedTensor] = {}
        own: dict[str, torch.Tensor] = {}
        from atoll.compression import get_codec

        for n, d in deltas.items():  # each with what the others will see of it
            if self.feedback is not None:
                encoded[n], own[n] = self.feedback.encode_decoded(n, d)
            else:
                enc = encoded[n] = encode_tensor(d, self.cfg.codec)
                own[n] = get_codec(enc.spec).decode(enc.payload, enc.shape, enc.dtype)
        self.outbox.put_round(round_, encoded)
        plan = self.plan  # one snapshot: the runner may swap in a newer plan meanwhile
        own_since = plan.groups[group_index(plan, self.cfg.node_id)].since_epoch or plan.epoch

        def is_own(part: Participant) -> bool:
            # this node's group by identity, not index: the round may have been decided under another plan
            return self.cfg.node_id in part.nodes and part.since_epoch == own_since

        decision, fetched, nbytes = self._settle(
            RoundReport(round=round_, tokens=tokens, previous=previous, hashes=hashes, step_seconds=pace[0],
                        round_steps=pace[1], norm=math.sqrt(sum(tensor_norm(t) ** 2 for t in own.values()))), is_own)
        stats = RoundStats(round=round_, participants=len(decision.participants), inner_step=previous.inner_step)
        aliased = [n for n in self.mine if n in self.aliases]
        if aliased:  # a tied copy: this group's contribution to the original, from its holders in this group
            for p in decision.participants:
                if is_own(p):
                    got, own_bytes = self._fetch_contribution(p, round_, only=aliased)
                    own = {**own, **got}
                    nbytes += own_bytes
        # the final decision's set, in its order (every node sums in the same order: the same bits everywhere)
        contributions = [(float(p.tokens), own if is_own(p) else fetched[origin_key(p)])
                         for p in decision.participants]
        others = sum(1 for p in decision.participants if not is_own(p))
        stats.wire_bytes = nbytes + sum(memoryview(e.payload).nbytes for e in encoded.values()) * others
        weights = combine_weights([w for w, _ in contributions])
        new_values: dict[str, torch.Tensor] = {}
        for n in self.mine:
            if not weights:  # nobody's contribution (every participant out of reach): the anchor stays
                new_values[n] = self.anchor[n].clone()
                continue
            update = mean = sum(w * c[self._wire(n)].float() for w, (_, c) in zip(weights, contributions))
            if self.cfg.momentum > 0:
                m = self.momentum.get(n)
                m = mean.clone() if m is None else m.mul_(self.cfg.momentum).add_(mean)
                self.momentum[n] = m
                update = mean + self.cfg.momentum * m if self.cfg.nesterov else m
            new_values[n] = self.anchor[n] - self.cfg.lr * update.to(self.anchor[n].dtype)
        anchor = self._share(new_values)
        stats.seconds = time.perf_counter() - t0
        return _Result(round=round_, anchor=anchor, stats=stats, decision=decision)

    def _settle(self, report: RoundReport, is_own: Callable[[Participant], bool]
                ) -> tuple[RoundDecision, dict[str, dict[str, torch.Tensor]], int]:
        """Ask the coordinator about the round until its decision is final, fetching each version's contributions
        and reporting those out of reach: (the final decision, origin_key -> the contribution, wire bytes). It keeps
        asking while it fetches: a contribution a newer version leaves out (its holder died) is given up at once."""
        round_ = report.round
        deadline = time.monotonic() + self.timeout.total_seconds() + self.cfg.deadline.total_seconds()
        fetched: dict[str, dict[str, torch.Tensor]] = {}
        inflight: dict[str, tuple[Participant, Future, threading.Event, float]] = {}
        """origin_key -> (participant, its fetch, set to give it up, when it started)."""
        failed: dict[str, Participant] = {}
        """Participants of decision version `failed_version` out of this node's reach past the bound."""
        failed_version = 0
        nbytes = 0
        wait = 0.02  # a round is usually decided within a round trip of the last group's arrival: ask often
        try:
            while True:
                answer = self.arrive(replace(report, hold_s=0.0 if inflight else HOLD_S))
                held = isinstance(answer, Held)
                decision = answer.decision if isinstance(answer, Held) else answer
                if decision is not None and report.fetched_version != decision.version:
                    if decision.version != failed_version:
                        failed, failed_version = {}, decision.version
                    wanted = {origin_key(p): p for p in decision.participants
                              if not is_own(p) and origin_key(p) not in fetched}
                    for key in [k for k in inflight if k not in wanted]:
                        inflight.pop(key)[2].set()  # left out meanwhile: nobody applies it
                    for key, part in wanted.items():
                        if key not in inflight and key not in failed:
                            stop = threading.Event()
                            inflight[key] = (part, self._fetch_pool.submit(self._fetch_contribution, part, round_,
                                                                           stop), stop, time.monotonic())
                    for key, (part, fut, stop, started) in list(inflight.items()):
                        late = time.monotonic() > started + self.cfg.deadline.total_seconds() + 30.0
                        if not fut.done() and not late:
                            continue
                        del inflight[key]
                        try:
                            if not fut.done():
                                raise FutureTimeout(f"the fetch of group {part.group}'s contribution to round "
                                                    f"{round_} did not end within its bound")
                            tensors, got = fut.result()
                        except (OutOfReach, FutureTimeout) as e:
                            stop.set()
                            log.warning("outer round %d: %s; reported to the coordinator, which decides the round "
                                        "again", round_, e)
                            failed[key] = part
                            continue
                        fetched[key] = tensors
                        self.outbox.put_relay(round_, key, tensors)
                        nbytes += got
                    if inflight:  # still fetching: ask again soon (a newer version may leave some out)
                        self._check_stop()
                        futures_wait([f for _, f, _, _ in inflight.values()], timeout=0.2,
                                     return_when=FIRST_COMPLETED)
                        continue
                    out_of_reach = [p for k, p in failed.items() if k not in fetched]
                    if decision.final:
                        if out_of_reach:
                            raise OuterSyncError(
                                f"outer round {round_} is final, but this node could reach no node holding the "
                                f"contribution of group(s) {', '.join(str(p.group) for p in out_of_reach)}; its "
                                f"group takes the outer state afresh from a live group after the replan")
                        return decision, fetched, nbytes
                    report = replace(report, fetched_version=0 if out_of_reach else decision.version,
                                     version=decision.version, unreachable=tuple(out_of_reach))
                    wait = 0.02
                    continue  # tell the coordinator at once
                if decision is not None and decision.final:
                    return decision, fetched, nbytes
                if time.monotonic() > deadline:
                    what = "decide" if decision is None else f"make final its decision (version {decision.version}) of"
                    raise OuterSyncError(f"the coordinator did not {what} outer round {round_} in time")
                self._check_stop()
                if not held:  # (a held question waited already)
                    time.sleep(wait)
                    wait = min(wait * 1.5, 0.2)
        finally:
            for _, _, stop, _ in inflight.values():
                stop.set()

    def _find_group(self, part: Participant) -> tuple[Plan, int] | None:
        """The plan (newest adopted first) that has participant `part`'s group, and its index there; None: none."""
        plans = [self.plan_source(), self.plan] if self.plan_source is not None else [self.plan]
        for plan in plans:
            g = _group_in(plan, part)
            if g is not None:
                return plan, g
        return None

    def _sources(self, part: Participant, names: Sequence[str] | None = None
                 ) -> list[tuple[str, dict[str, list[str]], Mapping[str, str], int, str]]:
        """Where this node's parameters of `part`'s contribution (`names`, else all it exchanges) can be fetched, in
        order: the participant's own responsible nodes, then those of each other group of the newest plan (they
        fetched them too, and serve them on). Each: (what, node -> names as they travel, addresses, the epoch to
        name, origin)."""
        wanted = sorted({self._wire(n) for n in (self.mine if names is None else names)})

        def by_node(holders: Mapping[int, Sequence[str]]) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for n in wanted:
                out.setdefault(responsible(n, holders), []).append(n)
            return out

        out = []
        found = self._find_group(part)
        if found is not None:
            plan, g = found
            out.append((f"group {part.group}", by_node(group_holders(plan, g)), plan.node_addresses,
                        part.since_epoch, ""))
        plan = self.plan_source() if self.plan_source is not None else self.plan
        for q, grp in enumerate(plan.groups):
            nodes = plan.group_nodes(q)
            if self.cfg.node_id in nodes or ((grp.since_epoch or plan.epoch) == part.since_epoch
                                             and nodes == set(part.nodes)):
                continue
            out.append((f"group {q} (a relay)", by_node(group_holders(plan, q)), plan.node_addresses,
                        grp.since_epoch or plan.epoch, origin_key(part)))
        return out

    def _gone(self, part: Participant) -> bool:
        """The newest adopted plan is at least as new as `part`'s group, yet has it no more: it was replanned away
        and will serve nothing again (relays may still hold its payloads)."""
        if self.plan_source is None:
            return False
        newest = self.plan_source()
        return newest.epoch >= part.since_epoch and _group_in(newest, part) is None

    def _fetch_contribution(self, part: Participant, round_: int, given_up: threading.Event | None = None,
                            only: Sequence[str] | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """This node's parameters (`only` these, else all it exchanges) of `part`'s contribution to `round_`, keyed by
        the names they travel under, from any node holding them, retried for at most `OuterConfig.deadline` (the
        bound); OutOfReach past it, or once `given_up` is set."""
        bound = self.cfg.deadline.total_seconds()
        deadline = time.monotonic() + bound
        wait = 0.1
        tried: list[str] = []
        while True:
            sources = self._sources(part, only)
            now = time.monotonic()
            # a holder this node could not connect to lately (the link may be down) is tried only when no other source
            # is left: each try of it costs the connect bound, while a relay that has not fetched the contribution yet
            # is asked again within a fraction of a second
            reachable = [x for x in sources if not any(self._unreachable.get(x[2].get(n, ""), 0.0) > now
                                                       for n in x[1])]
            for what, by_node, addresses, epoch, origin in (reachable or sources):
                left = deadline - time.monotonic()
                if left <= 0 or (given_up is not None and given_up.is_set()):
                    break
                def one(node: str, names: list[str], epoch: int = epoch, origin: str = origin, addresses=addresses,
                        left: float = left) -> tuple[dict[str, torch.Tensor], int]:
                    address = addresses.get(node)
                    if address is None:
                        raise OuterSyncError(f"the plan has no address for node {node}")
                    tensors, _, got = fetch_outer(
                        address, pb.OuterFetchRequest(job_id=self.cfg.job_id, plan_epoch=epoch, round=round_,
                                                      kind="delta", names=names, sender=self.cfg.node_id,
                                                      origin=origin),
                        token=self.cfg.token, rpc=self.cfg.rpc, timeout=timedelta(seconds=max(0.5, left)),
                        latency=self.cfg.latency_to(node), node=node,
                        connect_timeout=timedelta(seconds=min(max(0.5, left), OUTER_CONNECT_S)),
                        channels=self._channels)
                    return tensors, got

                try:
                    out: dict[str, torch.Tensor] = {}
                    nbytes = 0
                    holders = list(by_node.items())
                    # every holder at once (each holds its part; on a wide-area link each fetch is a round trip)
                    others = [self._holder_pool.submit(one, n, names) for n, names in holders[1:]]
                    parts: list[tuple[dict[str, torch.Tensor], int]] = []
                    try:
                        if holders:
                            parts.append(one(*holders[0]))
                    finally:
                        futures_wait(others)  # (each ends within its own timeout)
                    parts += [f.result() for f in others]
                    for tensors, got in parts:
                        out.update(tensors)
                        nbytes += got
                    if tried:
                        log.info("outer round %d: group %d's contribution fetched from %s after %d failed tries",
                                 round_, part.group, what, len(tried))
                    return out, nbytes
                except (grpc.RpcError, CodecError, OuterSyncError) as e:
                    if isinstance(e, Unconnected):
                        self._unreachable[e.address] = time.monotonic() + UNREACHABLE_S
                    # a node killed mid-answer ends its stream in any of these ways (UNAVAILABLE, INTERNAL,
                    # CANCELLED, a truncated tensor, parameters missing); a relay that has not fetched it yet
                    # answers UNAVAILABLE or NOT_FOUND: every source is tried in turn until the bound
                    why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                    tried.append(f"{what}: {why}")
            if given_up is not None and given_up.is_set():
                raise OutOfReach(f"the contribution of group {part.group} to round {round_} was left out of the "
                                 f"round's decision while this node fetched it")
            if self._gone(part) or time.monotonic() + wait > deadline:
                gone = " (its group is in no plan any more)" if self._gone(part) else ""
                raise OutOfReach(f"the contribution of group {part.group} ({', '.join(part.nodes)}){gone} to round "
                                 f"{round_} could not be fetched from any of its holders within {bound:.0f}s "
                                 f"({len(tried)} tries; the last: {tried[-1] if tried else 'no holder known'})")
            self._check_stop()
            time.sleep(wait)
            wait = min(2 * wait, 1.0)

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise OuterSyncError("the run was stopped while an outer exchange was in flight")

    def _share(self, new_values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new anchor of every parameter: this node's own results, and the other holders' through an
        all-reduce per shared layer segment. Each value has one contributor and zeros beside it, so every holder
        gets the responsible node's bits exactly (x + 0 is x; a difference added back to the old anchor is not
        always): the anchor hashes of all holders agree."""
        anchor = {n: t.clone() for n, t in self.anchor.items()}
        anchor.update(new_values)
        for names, group in self.segment_groups:
            flat = torch.cat([new_values[n].reshape(-1) if n in new_values
                              else torch.zeros_like(self.anchor[n]).reshape(-1) for n in names])
            group.allreduce([flat]).wait(self.timeout)
            offset = 0
            for n in names:
                k = self.anchor[n].numel()
                if n not in new_values:
                    anchor[n] = flat[offset:offset + k].view_as(self.anchor[n]).clone()
                offset += k
        return anchor

    # --- state -----------------------------------------------------------------------------------------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"anchor/{n}": t.clone() for n, t in self.anchor.items()}
        out.update({f"momentum/{n}": t.clone() for n, t in self.momentum.items()})
        return out

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the round, the anchor and this node's momentum (call after `finish`)."""
        return {"round": self.round, "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()}}

    def load_state_dict(self, state: Mapping, *, params_too: bool = False) -> None:
        """Restore the outer state (of a checkpoint, or fetched from a live group); with `params_too` the
        parameters start from the anchor (a group that rejoins)."""
        self.round = int(state["round"])
        saved, moments = state["anchor"], state.get("momentum", {})

        def pick(held: Mapping[str, torch.Tensor], n: str) -> torch.Tensor | None:
            # a tied copy takes the original's state where it is there (a cut that kept the embedding with the head
            # saved no copy), else its own
            return held.get(self._wire(n), held.get(n))

        for n in self.anchor:
            t = pick(saved, n)
            if t is not None:
                self.anchor[n] = t.clone().to(self.anchor[n].dtype)
        self.momentum = {n: t.clone() for n in self.mine if (t := pick(moments, n)) is not None}
        if params_too:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self.anchor[n])
        self.outbox.put_state(self.round, self._state_tensors())

    @property
    def landed(self) -> bool:
        """No exchange is in flight: every ended round's outer update is applied to the parameters."""
        return self._pending is None

    def fetch_state(self, groups: Sequence[int], epochs: Mapping[int, int], *, params_too: bool = True) -> int:
        """Take the outer state (anchor and momentum of this node's parameters) from a live group; start the
        parameters from it (unless not `params_too`); return the round it belongs to. Tries the groups in order.

        A group's nodes apply each round on their own, a step or so apart (the first stage finishes its inner
        steps before the last), so the parts fetched from its nodes may come from two rounds: the parts of the
        older round are fetched again, a moment later, until every part is of one round or the deadline
        passes (`STATE_ROUND_RETRIES`)."""
        last: Exception | None = None
        for g in groups:
            holders = self.holders[g]
            by_node: dict[str, list[str]] = {}
            for n in sorted({self._wire(n) for n in self.params}):  # a tied copy's state: the original's
                by_node.setdefault(responsible(n, holders), []).append(n)
            try:
                parts: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
                give_up = time.monotonic() + self.cfg.deadline.total_seconds()
                for attempt in range(STATE_ROUND_RETRIES + 1):
                    newest = max((r for r, _ in parts.values()), default=-1)
                    for node, names in by_node.items():
                        if node in parts and parts[node][0] == newest:
                            continue  # already of the newest round seen
                        # the momentum too: every group applies the same outer update to the same anchor, so a
                        # group that starts its momentum afresh would step its anchor away from the others'
                        wanted = [f"anchor/{n}" for n in names] + (
                            [f"momentum/{n}" for n in names] if self.cfg.momentum > 0 else [])
                        tensors, r, _ = fetch_outer(self.plan.node_addresses[node], pb.OuterFetchRequest(
                            job_id=self.cfg.job_id, plan_epoch=epochs[g], kind="state", names=wanted,
                            sender=self.cfg.node_id), token=self.cfg.token, rpc=self.cfg.rpc,
                            timeout=self.cfg.deadline, node=node)
                        parts[node] = (r, tensors)
                    rounds = sorted({r for r, _ in parts.values()})
                    if len(rounds) == 1:
                        break
                    if attempt == STATE_ROUND_RETRIES or time.monotonic() >= give_up:
                        raise OuterSyncError(f"group {g}'s nodes hold outer state of rounds "
                                             f"{' and '.join(map(str, rounds))}; retry once it lands")
                    time.sleep(min(0.05 * 2 ** attempt, 1.0, max(0.0, give_up - time.monotonic())))
                round_ = next(iter(parts.values()))[0]
                fetched = {k: t for _, tensors in parts.values() for k, t in tensors.items()}
                anchor = {k[len("anchor/"):]: t for k, t in fetched.items() if k.startswith("anchor/")}
                momentum = {k[len("momentum/"):]: t for k, t in fetched.items() if k.startswith("momentum/")}
                self.load_state_dict({"round": round_, "anchor": anchor, "momentum": momentum},
                                     params_too=params_too)
                log.info("took the outer state of round %d from group %d", round_, g)
                return round_
            except (grpc.RpcError, OuterSyncError, KeyError) as e:
                last = e
                log.warning("could not take the outer state from group %d: %s", g, e)
        raise OuterSyncError(f"no live group gave its outer state: {last}")


# --- checkpoints ----------------------------------------------------------------------------------------

def _outer_file(root, step: int, layers: tuple[int, int]):
    from atoll.node.checkpoint import step_dir

    return step_dir(root, step) / f"outer-{layers[0]:04d}-{layers[1]:04d}.pt"


def save_outer_state(state: Mapping, root, step: int, layers: tuple[int, int]) -> None:
    """Write the outer state of a slice beside its checkpoint of `step` (atomically)."""
    import os
    import tempfile

    path = _outer_file(root, step, layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".outer-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp) if os.path.exists(tmp) else None
        raise


def load_outer_state(root, step: int, layers: tuple[int, int]) -> dict | None:
    """The outer state saved with the checkpoint of `step` for parameters of `layers` (merged over the files
    of whatever cut wrote it), or None when that checkpoint has none."""
    from atoll.node.checkpoint import step_dir

    folder = step_dir(root, step)
    found = None
    for f in sorted(folder.glob("outer-*.pt")) if folder.is_dir() else []:
        a, b = (int(x) for x in f.stem.split("-")[1:3])
        if a < layers[1] and layers[0] < b:
            state = torch.load(f, map_location="cpu", weights_only=True)
            if found is None:
                found = {"round": state["round"], "anchor": {}, "momentum": {}}
            found["anchor"].update(state["anchor"])
            found["momentum"].update(state.get("momentum", {}))
    return found
