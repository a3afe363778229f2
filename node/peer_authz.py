"""Who may send a node tensors and fetch its outer state, told by the caller's certificate and the plan.

Over mutual TLS a peer's certificate (signed by the job CA) names its node id. A tensor's meta names its
sender too, and the mailbox checks that name against the plan; these checks bind the two: a tensor whose
meta names another node than the certificate, or that comes from a node the current plan does not put
upstream or downstream of this stage, is refused with `Forbidden` (PERMISSION_DENIED). A relay forwards only
tensors that name the certificate's node, a Connect stream is registered only under the certificate's node,
and FetchOuter serves only members of the plans this node has followed recently. Without TLS (the insecure mode) callers have no
identity and only the mailbox's checks apply.

Stage state (`StateAccess`): HeldState answers only members of recent plans; FetchState serves a member only
layers a recent plan gives it (overlapping its stage), layers it holds copies of (`Plan.checkpoint_copies`), or
the checkpoint file this node asked it to copy (`grant`, made before each Replicate); a Replicate is taken only
from the writer itself (the request's source is the caller's certificate), for layers a recent plan gives it.
Tensors that reach a node over a Connect stream it opened (`check_tunnelled`) pass the same sender and plan
checks as a Transfer: the stream's far end is the node it dialled (its certificate names it), so a tensor
naming another sender is refused unless that end is a relay, which checked the sender's certificate itself.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

from atoll.plan import Plan
from atoll.tls import CertificateError, cert_from_pem, common_name

C = TypeVar("C")
PLANS_KEPT = 4
"""Plans whose members may still fetch outer state: a group that runs on across new epochs fetches under an
older one for a while."""


class Forbidden(PermissionError):
    """The caller is not who the message claims, or the plan gives it no business here."""


_names: OrderedDict[bytes, str] = OrderedDict()
_names_lock = threading.Lock()


def caller_id(cert_pem: bytes | None) -> str | None:
    """The node id in a peer's certificate (TLS has verified it against the job CA), or None without TLS."""
    if cert_pem is None:
        return None
    with _names_lock:
        name = _names.get(cert_pem)
    if name is None:
        try:
            name = common_name(cert_from_pem(cert_pem, "the peer's certificate"))
        except CertificateError as e:
            raise Forbidden(str(e)) from None
        with _names_lock:
            _names[cert_pem] = name
            while len(_names) > 1024:
                _names.popitem(last=False)
    return name


def check_sender(chunks: Iterator[C], caller: str, receiver: object) -> Iterator[C]:
    """`chunks` as they come, refusing (Forbidden) a tensor whose meta names a sender other than `caller`, or
    one of the receiver's plan epoch from a node that is not its upstream or downstream sender."""
    spec = getattr(receiver, "spec", None)
    for chunk in chunks:
        if chunk.HasField("meta"):  # type: ignore[attr-defined]
            meta = chunk.meta  # type: ignore[attr-defined]
            if meta.sender != caller:
                raise Forbidden(f"Transfer: the caller's certificate is node {caller}'s, but the tensor claims to "
                                f"come from {meta.sender[:80]!r}; a node sends only as itself")
            if spec is not None and meta.plan_epoch == spec.plan_epoch:
                senders = set(spec.senders("forward")) | set(spec.senders("backward"))
                if caller not in senders:
                    raise Forbidden(f"Transfer: plan epoch {spec.plan_epoch} puts {caller} neither upstream nor "
                                    f"downstream of pipeline {spec.pipeline} stage {spec.stage}; its senders are "
                                    f"{', '.join(sorted(senders)) or 'none'}")
        yield chunk


def check_dialer(frames: Iterator[C], caller: str) -> Iterator[C]:
    """A Connect stream's frames, refusing (Forbidden) one whose first frame names another node than `caller`:
    tensors relayed to a node go only over a stream that node opened itself."""
    first = True
    for frame in frames:
        if first and frame.node_id != caller:  # type: ignore[attr-defined]
            raise Forbidden(f"Connect: the caller's certificate is node {caller}'s, but the stream names "
                            f"{frame.node_id[:80]!r}; a node opens streams only as itself")  # type: ignore[attr-defined]
        first = False
        yield frame


class PlanMembers:
    """Node ids of the plans a node followed last (`PLANS_KEPT` of them)."""

    def __init__(self) -> None:
        self._plans: OrderedDict[int, frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, plan: Plan) -> None:
        members = frozenset(n for p in plan.pipelines for stage in p.stages for n in stage.nodes)
        with self._lock:
            self._plans[plan.epoch] = members
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)

    def check(self, caller: str, what: str) -> None:
        with self._lock:
            known = any(caller in m for m in self._plans.values())
            epochs = list(self._plans)
        if not known:
            raise Forbidden(f"{what}: node {caller} is in none of the plans this node followed "
                            f"(epochs {', '.join(map(str, epochs)) or 'none yet'}); only plan members are served")


def check_tunnelled(chunks: Iterator[C], dialled: str | frozenset[str] | None, receiver: object) -> Iterator[C]:
    """Tensors of a call over a Connect stream this node opened to `dialled` (None: to a relay; a set: to a
    neighbour that also relays the others in it), refusing (Forbidden) one that names another sender than
    those, or that the receiver's plan epoch does not put upstream or downstream of its stage."""
    spec = getattr(receiver, "spec", None)
    allowed = frozenset((dialled,)) if isinstance(dialled, str) else dialled
    for chunk in chunks:
        if chunk.HasField("meta"):  # type: ignore[attr-defined]
            meta = chunk.meta  # type: ignore[attr-defined]
            if allowed is not None and meta.sender not in allowed:
                raise Forbidden(f"Transfer over the Connect stream to {', '.join(sorted(allowed))}: the tensor "
                                f"claims to come from {meta.sender[:80]!r}; a node sends only as itself")
            if spec is not None and meta.plan_epoch == spec.plan_epoch:
                senders = set(spec.senders("forward")) | set(spec.senders("backward"))
                if meta.sender not in senders:
                    raise Forbidden(f"Transfer over a Connect stream: plan epoch {spec.plan_epoch} puts "
                                    f"{meta.sender[:80]!r} neither upstream nor downstream of pipeline "
                                    f"{spec.pipeline} stage {spec.stage}; its senders are "
                                    f"{', '.join(sorted(senders)) or 'none'}")
        yield chunk


Layers = tuple[int, int]
GRANT_LIFE = 600.0
"""Seconds a node asked to copy a checkpoint file (`StateAccess.grant`) may fetch it."""
GRANTS_KEPT = 256


def _overlaps(a: Layers, b: Layers) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _within(a: Layers, b: Layers) -> bool:
    return b[0] <= a[0] and a[1] <= b[1]


def _show(ranges: object) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in sorted(ranges)) or "none"  # type: ignore[attr-defined]


class StateAccess:
    """Who may ask this node for stage state (HeldState, FetchState) and push it copies to take (Replicate),
    told by the plans it followed last (`PLANS_KEPT`) and the copies it asked others to take.

    A node may hear of a new plan a moment after its members call it, so a check that fails waits (at most
    the `wait` it is given) for a newer plan before it refuses. A node that left the job (`hand_over`) hears
    of no more plans, while the next plan's nodes (idle ones and new joiners among them), whose names and
    layers it cannot know, ask for its live state: it then answers HeldState and serves its live state to any
    node of the job (TLS has checked the certificate); its checkpoint files stay under the rules.
    """

    def __init__(self) -> None:
        self._stages: OrderedDict[int, dict[str, frozenset[Layers]]] = OrderedDict()
        self._copies: OrderedDict[int, dict[str, frozenset[Layers]]] = OrderedDict()
        self._grants: OrderedDict[tuple[str, int, Layers], float] = OrderedDict()
        self._handing_over = False
        self._cond = threading.Condition()

    def note(self, plan: Plan) -> None:
        stages: dict[str, set[Layers]] = {}
        for p in plan.pipelines:
            for stage in p.stages:
                for n in stage.nodes:
                    stages.setdefault(n, set()).add(tuple(stage.layers))  # type: ignore[arg-type]
        copies: dict[str, set[Layers]] = {}
        for c in plan.checkpoint_copies:
            copies.setdefault(c.node_id, set()).add(tuple(c.layers))  # type: ignore[arg-type]
        with self._cond:
            self._stages[plan.epoch] = {n: frozenset(r) for n, r in stages.items()}
            self._copies[plan.epoch] = {n: frozenset(r) for n, r in copies.items()}
            for kept in (self._stages, self._copies):
                while len(kept) > PLANS_KEPT:
                    kept.popitem(last=False)
            self._cond.notify_all()

    def hand_over(self) -> None:
        """This node left the job and follows no more plans; its live state goes to the next plan's nodes."""
        with self._cond:
            self._handing_over = True

    def grant(self, node_id: str, step: int, layers: Layers) -> None:
        """This node asks `node_id` to copy its checkpoint file of `layers` at `step`: let it fetch that file."""
        with self._cond:
            self._grants[(node_id, step, layers)] = time.monotonic() + GRANT_LIFE
            self._grants.move_to_end((node_id, step, layers))
            while len(self._grants) > GRANTS_KEPT:
                self._grants.popitem(last=False)

    def _member(self, caller: str, what: str) -> str | None:
        """Why `caller` is refused as no member of the recent plans, or None (lock held)."""
        if any(caller in plan for plan in self._stages.values()):
            return None
        epochs = ", ".join(map(str, self._stages)) or "none yet"
        return (f"{what}: node {caller} is in none of the plans this node followed (epochs {epochs}); only plan "
                f"members are served")

    def _layers(self, caller: str) -> tuple[set[Layers], set[Layers]]:
        """(stage layers, copies) recent plans give `caller` (lock held)."""
        return ({r for plan in self._stages.values() for r in plan.get(caller, ())},
                {r for plan in self._copies.values() for r in plan.get(caller, ())})

    def _await(self, wait: float, refusal: Callable[[], str | None]) -> None:
        """Return once `refusal()` (evaluated under the lock) says None; raise Forbidden with its last word when
        `wait` seconds pass first."""
        deadline = time.monotonic() + max(0.0, wait)
        with self._cond:
            while True:
                why = refusal()
                if why is None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Forbidden(why)
                self._cond.wait(min(left, 0.5))

    def check_held(self, caller: str, request: object, wait: float) -> None:
        sender = request.sender  # type: ignore[attr-defined]
        if sender != caller:
            raise Forbidden(f"HeldState: the caller's certificate is node {caller}'s, but the request names "
                            f"{sender[:80]!r}")
        self._await(wait, lambda: None if self._handing_over else self._member(caller, "HeldState"))

    def check_fetch(self, caller: str, request: object, wait: float) -> None:
        sender = request.sender  # type: ignore[attr-defined]
        if sender != caller:
            raise Forbidden(f"FetchState: the caller's certificate is node {caller}'s, but the request names "
                            f"{sender[:80]!r}")
        layers: Layers = (request.layer_start, request.layer_end)  # type: ignore[attr-defined]
        step, kind = int(request.step), request.kind  # type: ignore[attr-defined]

        def refusal() -> str | None:
            until = self._grants.get((caller, step, layers))
            if kind == "checkpoint" and until is not None and until > time.monotonic():
                return None  # a copy this node asked it to take
            if kind == "live" and self._handing_over:
                return None
            not_member = self._member(caller, "FetchState")
            if not_member is not None:
                return not_member
            stages, copies = self._layers(caller)
            if any(_overlaps(layers, r) for r in stages | copies):
                return None
            return (f"FetchState: node {caller} asks for layers [{layers[0]}, {layers[1]}), but the plans this node "
                    f"followed give it layers {_show(stages)} and copies of {_show(copies)}; a node fetches only "
                    f"the state of its own layers")

        self._await(wait, refusal)

    def check_replicate(self, caller: str, request: object, wait: float) -> None:
        source = request.source  # type: ignore[attr-defined]
        if source != caller:
            raise Forbidden(f"Replicate: the caller's certificate is node {caller}'s, but the request names the "
                            f"writer {source[:80]!r}; only the writer asks for copies of its checkpoint")
        layers: Layers = (request.layer_start, request.layer_end)  # type: ignore[attr-defined]

        def refusal() -> str | None:
            not_member = self._member(caller, "Replicate")
            if not_member is not None:
                return not_member
            stages, _ = self._layers(caller)
            if any(_within(layers, r) for r in stages):
                return None
            return (f"Replicate: node {caller} asks for a copy of layers [{layers[0]}, {layers[1]}), but the plans "
                    f"this node followed give it layers {_show(stages)}; a node replicates only its own stage's "
                    f"checkpoint")

        self._await(wait, refusal)
