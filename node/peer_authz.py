"""Who may send a node tensors and fetch its outer state, told by the caller's certificate and the plan.

Over mutual TLS a peer's certificate (signed by the job CA) names its node id. A tensor's meta names its
sender too, and the mailbox checks that name against the plan; these checks bind the two: a tensor whose
meta names another node than the certificate, or that comes from a node the current plan does not put
upstream or downstream of this stage, is refused with `Forbidden` (PERMISSION_DENIED). A relay forwards only
tensors that name the certificate's node, a Connect stream is registered only under the certificate's node,
and FetchOuter serves only members of the plans this node has followed recently. Without TLS (the insecure mode) callers have no
identity and only the mailbox's checks apply.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
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
