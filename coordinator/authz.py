"""Who may make which Coordinator call: a node speaks only as itself, and reports only what its plan gives it.

Plain functions of (method, request, caller, state), called by the servicer before each handler; they raise
`PermissionDenied` (PERMISSION_DENIED on the wire) with a message that says what the caller may do instead.

- A bootstrap caller (a certificate derived from the job token) may only join and read the status. Its join
  must carry a signing request, and may not claim the id of a live node whose certificate was issued for
  another key.
- Every join under mutual TLS carries a fresh challenge in its signing request (`atoll.coordinator.challenges`),
  taken once: a replayed join is refused.
- A node caller (a certificate of the job CA) may make every call, for its own node id only.
- A checkpoint report comes from the node that holds the file: its own checkpoint, of layers of a stage it holds
  in the plan of the report's epoch, or a copy it took of a writer's, of layers the writer holds there (the
  handler checks the copy against the writer's own record); and a step between that plan's resume step and the
  job's last step.
- A plaintext caller (the insecure mode) cannot be told apart from any other: only the checkpoint rule holds.
"""

from __future__ import annotations

import threading

from atoll.coordinator.ca import Caller, JobAuthority
from atoll.coordinator.errors import CoordinatorError, FailedPrecondition, InvalidArgument
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.validation import check_join_size
from atoll.plan import Plan
from atoll.tls import CertificateError, csr_challenge, parse_csr
from atoll.v1 import atoll_pb2 as pb

BOOTSTRAP_METHODS = frozenset({"Join", "JoinChallenge", "GetStatus", "ControlJob"})
"""What a caller holding only the job token may do: join (and ask for its challenge), and what an operator does
(status, job control)."""
ANY_NODE_METHODS = frozenset({"GetStatus"})
"""Calls about the job rather than one node: any node may make them."""


class PermissionDenied(CoordinatorError):
    """The caller is not who the request claims, or asks for what its plan does not give it."""


def authorize(method: str, request: object, caller: Caller, state: CoordinatorState,
              authority: JobAuthority | None, plans: PlanLookup | None = None) -> None:
    """Raise PermissionDenied unless `caller` may make `method` with `request`."""
    if caller.kind == "bootstrap":
        if method not in BOOTSTRAP_METHODS:
            raise PermissionDenied(f"{method} needs the node's own certificate, which its join brings; the job token "
                                   f"alone may only join, read the status and stop or extend the job")
        if method == "Join":
            _check_join(request, caller, state, authority)  # type: ignore[arg-type]
        return
    if caller.kind == "node" and method not in ANY_NODE_METHODS and method != "ReportCheckpoint" \
            and not (method == "JoinChallenge" and not getattr(request, "node_id", "")):
        claimed = getattr(request, "node_id", "")
        if claimed != caller.node_id:
            raise PermissionDenied(f"{method}: the caller's certificate is node {caller.node_id}'s; it cannot speak "
                                   f"for {claimed[:80] or 'no node'!r}")
        if method == "Join":
            _check_join(request, caller, state, authority)  # type: ignore[arg-type]
    if method == "ReportCheckpoint":
        check_checkpoint(request, state, plans or PlanLookup(),  # type: ignore[arg-type]
                         reporter=caller.node_id if caller.kind == "node" else None)


def _check_join(req: pb.JoinRequest, caller: Caller, state: CoordinatorState, authority: JobAuthority | None) -> None:
    check_join_size(req)  # before its signing request is parsed
    if authority is None:
        return
    if not req.csr_pem:
        raise InvalidArgument("this coordinator signs each node a certificate at its join, and the join carries no "
                              "signing request (csr_pem): update atoll on the node")
    try:
        key = authority.csr_key_id(req.csr_pem)
        challenge = csr_challenge(parse_csr(req.csr_pem))
    except CertificateError as e:
        raise InvalidArgument(f"Join: {e}") from None
    # (not for the holder of the id's certificate, which may change keys, nor a new id the coordinator picks)
    if caller.kind != "node" and req.node_id:
        bound = authority.bindings.get(req.node_id)
        member = state.store.get_member(req.node_id)
        if bound is not None and bound != key and member is not None and member.state == "alive":
            raise PermissionDenied(f"node id {req.node_id} is held by a live node with another key; a second process "
                                   f"cannot take it over. Start this one with a state dir of its own (--state-dir)")
    if not challenge:
        raise FailedPrecondition("this coordinator binds every join to a fresh challenge (JoinChallenge), and this "
                                 "join's signing request carries none: upgrade atoll on the node")
    if not state.challenges.take(challenge, state.clock()):
        raise PermissionDenied("the join's challenge is unknown, used or expired: a join is taken once, so a replayed "
                               "one is refused; join again with a fresh challenge")


class PlanLookup:
    """The plan of an epoch: the current one from the state, an earlier one from the plan history (cached)."""

    def __init__(self, keep: int = 8):
        self._cache: dict[int, Plan] = {}
        self._keep = keep
        self._lock = threading.Lock()

    def get(self, state: CoordinatorState, epoch: int) -> Plan | None:
        current = state.current_plan()
        if current is not None and current.epoch == epoch:
            return current
        with self._lock:
            if epoch in self._cache:
                return self._cache[epoch]
        found = next((p.plan for p in state.store.plan_history() if p.plan.epoch == epoch), None)
        if found is not None:
            with self._lock:
                self._cache[epoch] = found
                while len(self._cache) > self._keep:
                    self._cache.pop(min(self._cache))
        return found


def check_checkpoint(req: pb.CheckpointReport, state: CoordinatorState, plans: PlanLookup,
                     reporter: str | None = None) -> None:
    """The reporter (`reporter`: a node's certificate) must be the node the report names, the holder of the file;
    the file's writer (the holder, or `copy_of` for a copy) must hold the reported layers in the plan of the
    report's epoch."""
    if reporter is not None and req.node_id != reporter:
        raise PermissionDenied(f"ReportCheckpoint: node {reporter} reports a file on node {req.node_id[:80]!r}; a "
                               f"checkpoint file, or a copy of one, is reported by the node that holds it")
    plan = plans.get(state, req.plan_epoch) if req.plan_epoch else None
    if plan is None:
        return  # the handler refuses an epoch that never was, with the epochs that were
    who = req.copy_of or req.node_id  # a copy is checked against the stage of the node that wrote it
    held = [tuple(stage.layers) for p in plan.pipelines for stage in p.stages if who in stage.nodes]
    if not any(a <= req.layer_start and req.layer_end <= b for a, b in held):
        raise PermissionDenied(
            f"ReportCheckpoint: node {who} holds layers {', '.join(f'[{a}, {b})' for a, b in held) or 'none'} "
            f"in plan epoch {plan.epoch}, not [{req.layer_start}, {req.layer_end})")
    last = state.target_steps  # the spec's steps, or as `atoll job stop/extend` changed them
    if not plan.resume_step <= req.step <= last:
        raise PermissionDenied(f"ReportCheckpoint: step {req.step} is outside plan epoch {plan.epoch}'s steps "
                               f"({plan.resume_step}-{last})")


def issue_certificate(req: pb.JoinRequest, reply: pb.JoinReply, authority: JobAuthority | None) -> pb.JoinReply:
    """After a join: sign the node's certificate for the id it was given, and hand it the job CA."""
    if authority is not None and req.csr_pem:
        reply.certificate_pem = authority.issue(reply.node_id, req.csr_pem)
        reply.ca_pem = authority.ca.cert_pem
    return reply
