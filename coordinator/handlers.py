"""What each Coordinator RPC does, as plain functions of (request, state) -> reply.

They validate everything first, raise the domain errors of `atoll.coordinator.errors` for bad or
untimely requests, and never import grpc: `atoll.coordinator.servicer` maps the errors to status codes.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import replace

from atoll.coordinator import validation as v
from atoll.coordinator import claims
from atoll.coordinator.authz import PermissionDenied
from atoll.coordinator.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound,
                                      RateLimited, Unauthenticated, Unavailable)
from atoll.coordinator.history import fill_status as fill_history
from atoll.coordinator.islands import device_class
from atoll.coordinator.membership import RunFailureRecord, join_decision, lease_deadline
from atoll.coordinator import job_control, quarantine
from atoll.coordinator.progress import summarize
from atoll.coordinator.reachability import unreachable_advice
from atoll.coordinator.replication_gaps import stand_in
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.checkpoints import replication
from atoll.coordinator.store import CheckpointRecord, MemberRecord
from atoll.rpc import token_matches
from atoll.serde import (DIRECTION_BY_NAME, codec_id, island_to_proto, link_to_proto, plan_to_proto,
                         profile_from_proto, profile_to_proto, step_metrics_from_proto, step_metrics_to_proto)
from atoll.types import LinkMeasurement
from atoll.v1 import atoll_pb2 as pb

RECENT_STEPS_IN_STATUS = 32
MAX_FAILURE_REASON = 1000
"""Longest reason a failure report may carry."""
STATUS_WINDOW_STEPS = 8
MAX_ANCHOR_HASHES = 8192
"""Most anchor hashes one outer sync carries (one per layer the node holds, for a round or two)."""
MAX_GROUP_NODES = 100_000

log = logging.getLogger("atoll.coordinator")


def check_token(given: str | None, state: CoordinatorState) -> None:
    if not token_matches(given, state.token):
        raise Unauthenticated("missing or wrong job token; pass the job's token (--token, --token-file or "
                              "ATOLL_TOKEN)")


def _check_job(job_id: str, state: CoordinatorState) -> None:
    if job_id and job_id != state.job.id:
        raise FailedPrecondition(f"this coordinator runs job {state.job.id}, not {job_id[:80]!r}; point the node "
                                 f"at that job's coordinator")


def _known(node_id: str, state: CoordinatorState, *, left_too: bool = False, session: str = "",
           quarantined_too: bool = False) -> MemberRecord:
    """The member record of `node_id`, which must be alive (or left, with `left_too`; quarantined, with
    `quarantined_too`), asked by the process that speaks for it now (`session`, `CoordinatorState.check_session`)."""
    v.check_node_id(node_id)
    member = state.store.peek_member(node_id)  # (the store's record, read only: no copy per heartbeat)
    if member is None:
        raise NotFound(f"node {node_id} is not a member of job {state.job.id}; join first")
    if member.state != "alive" and not (left_too and member.state == "left") \
            and not (quarantined_too and member.state == quarantine.QUARANTINED):
        raise NotFound(f"node {node_id} was marked {member.state} ({member.reason}); join again"
                       + (f" (it stays quarantined until `atoll job release {node_id}`)"
                          if member.state == quarantine.QUARANTINED else ""))
    state.check_session(node_id, session)
    return member


def _new_node_id(hostname: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", hostname.split(".")[0]).strip("-")[:40] or "node"
    return f"{stem}-{secrets.token_hex(3)}"


def _job_info(state: CoordinatorState) -> pb.JobInfo:
    return pb.JobInfo(job_id=state.job.id, name=state.job.name, spec_toml=state.spec_toml, run_id=state.run_id)


def handle_join(req: pb.JoinRequest, state: CoordinatorState,
                dial_back: Callable[[str], str | None] | None = None, seen_from: str = "") -> pb.JoinReply:
    """`dial_back(address)` says why the coordinator cannot reach the node's Peer server (None: it can); a node
    that advertises no address (`--no-listen`) or cannot be reached joins as one that accepts no connections.
    `seen_from`: the host the join's connection came from ("": not known)."""
    v.check_join_size(req)
    check_token(req.token, state)
    _check_job(req.job_id, state)
    v.check_profile(req.profile)
    if req.peer_address:
        v.check_address("peer_address", req.peer_address)
    v.check_string("session", req.session, limit=64)
    node_id = req.node_id or _new_node_id(req.profile.hostname)
    v.check_node_id(node_id)
    if req.node_id:
        state.check_session(node_id, req.session, joining=True)
    now = state.clock()
    if req.node_id:
        wait = state.join_limit.take(node_id, now)
        if wait is not None:
            raise RateLimited(f"node {node_id} joined more often than {state.options.joins.burst} times in "
                              f"{state.options.joins.burst * state.options.joins.every_s:.0f}s; it may join again in "
                              f"{wait:.0f}s", retry_after_s=wait)
    existing = state.store.get_member(node_id)
    decision = join_decision(now, existing, hostname=req.profile.hostname, started_unix=state.started_unix,
                             options=state.membership_options(now))
    if decision.kind == "conflict":
        raise AlreadyExists(decision.reason)
    if decision.kind == "update" and existing is not None:
        _refuse_a_copy_elsewhere(state, existing, req, now, seen_from)
    profile = profile_from_proto(req.profile)
    why = dial_back(req.peer_address) if dial_back is not None and req.peer_address else None
    profile.unreachable = profile.unreachable or not req.peer_address or why is not None
    reachability = unreachable_advice(req.peer_address, why or "") if profile.unreachable else \
        f"the coordinator reached this node's peer server at {req.peer_address}"
    # a quarantined node stays quarantined however often it joins (`atoll job release` lets it back)
    kept = quarantine.QUARANTINED if existing is not None and existing.state == quarantine.QUARANTINED else ""
    # the join time is the node process's: an update from the same process (a retried join) keeps it, a new process
    # joining under the id before its lease lapsed (a restart) joined now
    current = state.process_of(node_id) if req.session else None
    new_process = current is not None and current.session != req.session
    state.store.put_member(MemberRecord(
        node_id=node_id, peer_address=req.peer_address, profile=profile, state=kept or "alive",
        joined_unix=existing.joined_unix if existing is not None and decision.kind == "update" and not new_process
        else now,
        last_heartbeat_unix=now, reason=existing.reason if kept else decision.reason))
    state.note_session(node_id, req.session, now, req.peer_address, seen_from)
    if decision.kind != "update" or existing is None or existing.peer_address != req.peer_address \
            or existing.profile.unreachable != profile.unreachable \
            or device_class(existing.profile) != device_class(profile):  # its island and probe class
        state.membership_changed(now)
    cadence = state.cadence.current
    return pb.JoinReply(node_id=node_id, job=_job_info(state), lease_seconds=cadence.lease,
                        heartbeat_interval_seconds=cadence.interval,
                        reachable=not profile.unreachable, reachability=reachability)


def handle_join_challenge(req: pb.JoinChallengeRequest, state: CoordinatorState) -> pb.JoinChallengeReply:
    """A fresh challenge for the caller's next join (`atoll.coordinator.challenges`)."""
    check_token(req.token, state)
    if req.node_id:
        v.check_node_id(req.node_id)
    return pb.JoinChallengeReply(challenge=state.challenges.issue(state.clock()),
                                 expires_seconds=state.challenges.life_s)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0] if address else ""


def _refuse_a_copy_elsewhere(state: CoordinatorState, existing: MemberRecord, req: pb.JoinRequest, now: float,
                             seen_from: str) -> None:
    """A join under a new session while the node's current process lives on (heard within its lease) at another
    host: a second machine started from a copy of its state dir (a cloned VM keeps the hostname, which
    `join_decision` compares). Refused, so that the copy, not the running node, is the one to stop: taking it for
    a restart would fence the running process out, and two machines restarted by their supervisors would take the
    id from each other for ever. A new session from the same host is a restart; once the lease lapsed, the copy
    may take the id over (the first machine is gone).

    The hosts compared are the two processes' advertised peer addresses; where either advertises none (a
    `--no-listen` node), the hosts their joins' connections came from, of one address family. Two copies behind
    one NAT look alike there, and are taken for a restart. The refusal says when the holder's lease lapses
    (`retry_after_s`): the node tries once more then, so a node restarted from another address (a NAT that gives
    each connection another of several addresses) takes its own place by itself."""
    current = state.process_of(existing.node_id)
    if not (req.session and current is not None and current.session and current.session != req.session):
        return
    there, here = _host(existing.peer_address), _host(req.peer_address)
    if not (there and here):
        there, here = current.seen_from, seen_from
        if (":" in there) != (":" in here):  # IPv4 once, IPv6 the next time: one dual-stack machine may do that
            return
    if not (there and here and there != here):
        return
    deadline = lease_deadline(existing, state.started_unix, state.membership_options(now))
    if now > deadline:
        return
    held = existing.peer_address or f"host {there}"
    this = req.peer_address or f"host {here}"
    raise AlreadyExists(
        f"node id {existing.node_id} is held by a live process at {held} (heard "
        f"{max(0.0, now - existing.last_heartbeat_unix):.0f}s ago), and this one at {this} started "
        f"from a copy of its state dir: give this one a --state-dir of its own to join as a new node. If that "
        f"process is gone, this one may take its place once its lease lapses (in {deadline - now:.0f}s)",
        retry_after_s=deadline - now + 1.0)


def handle_heartbeat(req: pb.HeartbeatRequest, state: CoordinatorState) -> pb.HeartbeatReply:
    member = _known(req.node_id, state, session=req.session, quarantined_too=True)
    now = state.clock()
    # an epoch above ours is recorded, not refused: a node that outlived a coordinator's lost state
    # still runs its old plan until the new one arrives
    state.store.heartbeat(req.node_id, now, req.plan_epoch, req.step)
    if member.state == quarantine.QUARANTINED:  # told so, and no probes: it waits for `atoll job release`
        cadence = state.cadence.current
        return pb.HeartbeatReply(lease_seconds=cadence.lease, heartbeat_interval_seconds=cadence.interval,
                                 plan_epoch=state.epoch, target_steps=state.target_steps, coordinator_unix=now,
                                 job_finished=bool(state.control.finished_unix), quarantined=True,
                                 quarantine_reason=member.reason)
    probe_bytes = state.options.probes.probe_bytes
    cadence = state.cadence.current  # (stretched with the membership: the node follows it)
    probes = [pb.ProbeTarget(node_id=m.node_id, address=m.peer_address, probe_bytes=probe_bytes)
              for m in state.assign_probes(req.node_id, now)]
    # a machine probe starts after the next heartbeat of every node of the machine (it hears of it there)
    machine = state.assign_machine_probe(req.node_id, now, lead_s=1.5 * cadence.interval + 1.0)
    if machine is not None:
        m, part = machine
        probes.append(pb.ProbeTarget(node_id=m.node_id, address=m.peer_address, probe_bytes=probe_bytes,
                                     start_unix=part.start_unix, flows=part.flows))
    return pb.HeartbeatReply(
        lease_seconds=cadence.lease, heartbeat_interval_seconds=cadence.interval, plan_epoch=state.epoch,
        probe=probes, job_finished=bool(state.control.finished_unix), target_steps=state.target_steps,
        coordinator_unix=now, prune_checkpoints_before=state.prune_checkpoints_before,
        keep_checkpoint_step=state.keep_checkpoint_step,
        write_checkpoints=req.node_id in state.replication_gaps.stand_ins(state.current_plan()))


def handle_report_probes(req: pb.ProbeReport, state: CoordinatorState) -> pb.Ack:
    _known(req.node_id, state)
    if len(req.links) > v.MAX_LINKS_PER_REPORT:
        raise InvalidArgument(f"{len(req.links)} links in one report; at most {v.MAX_LINKS_PER_REPORT}")
    for i, x in enumerate(req.links):
        v.check_link(i, x, req.node_id)
    now = state.clock()
    # the coordinator's clock dates every measurement, so nodes' clock skew cannot make links look fresh
    links = [LinkMeasurement(src=x.src, dst=x.dst, bandwidth_bytes_per_s=x.bandwidth_bytes_per_s,
                             rtt_seconds=x.rtt_seconds, probe_bytes=x.probe_bytes, measured_unix=now,
                             flows=max(1, x.flows))
             for x in req.links if state.store.get_member(x.dst) is not None]
    state.record_probes(links)
    return pb.Ack(message=f"{len(links)} links recorded")


def handle_report_step(req: pb.StepMetrics, state: CoordinatorState) -> pb.StepAck:
    _check_job(req.job_id, state)
    _known(req.node_id, state, session=req.session)
    if req.plan_epoch > state.epoch:
        raise FailedPrecondition(f"step metrics for plan epoch {req.plan_epoch}, but the newest is {state.epoch}")
    if len(req.links) > 64:
        raise InvalidArgument(f"{len(req.links)} link stats in one step report; at most 64")
    try:
        metrics = step_metrics_from_proto(req)
    except ValueError as e:
        raise InvalidArgument(f"step metrics: {e}") from None
    for name in ("step_seconds", "compute_seconds", "wait_seconds"):
        v.check_seconds(name, getattr(req, name))
    if not req.loss_scale >= 0 or req.loss_scale == float("inf"):  # NaN fails the first test
        raise InvalidArgument(f"loss_scale = {req.loss_scale} must be finite and >= 0 (0: not fp16)")
    _check_step_claims(req, state)
    if metrics.offences:
        for line in quarantine.take_offences(state, metrics):
            log.warning("%s", line)
    state.record_step(metrics)
    for line in quarantine.take_loss_liars(state, state.record_history(metrics)):
        log.warning("%s", line)
    target = state.target_steps
    if req.step >= state.last_step() and not state.control.finished_unix:  # the last step, if others say so too
        # (outer mode: the end of the last round, (target // H) x H - 1, which the target need not be)
        if state.job_complete():  # finished once its final checkpoint is held too
            state.note_trained(state.clock())
    return pb.StepAck(plan_epoch=state.epoch, stop=req.step + 1 >= target, target_steps=target)


def _check_step_claims(req: pb.StepMetrics, state: CoordinatorState) -> None:
    """A step report's claims against the plan of its epoch (`atoll.coordinator.claims`): a loss only from the
    pipeline's last stage, a step in line with its peers' (a loss within `LOSS_STEP_WINDOW` of them). Before the
    first plan there is nothing to check against."""
    if state.current_plan() is None:
        return
    plan = state.plan_of(req.plan_epoch) if req.plan_epoch else None
    if plan is None:
        raise FailedPrecondition(f"step metrics for plan epoch {req.plan_epoch}, which never ran; the plans run so far "
                                 f"are 1-{state.epoch}")
    if req.has_loss or req.has_val_loss:
        why = claims.loss_refusal(plan, req.node_id, req.pipeline)
        if why:
            raise PermissionDenied(f"ReportStep: {why}; the report is refused")
    # a loss is the last of a step's work: an honest one is never far ahead of its peers' steps
    why = state.step_refusal(plan, req.node_id, req.step,
                             claims.LOSS_STEP_WINDOW if req.has_loss or req.has_val_loss else claims.STEP_WINDOW)
    if why:
        # the newest plan's report may be early (its peers' reports held back): the node keeps it and retries; an
        # older plan's peers have moved on, and will not catch up
        if plan.epoch == state.epoch:
            raise Unavailable(f"ReportStep of node {req.node_id}: {why}")
        raise FailedPrecondition(f"ReportStep of node {req.node_id}, plan epoch {plan.epoch}: {why}")


def handle_report_checkpoint(req: pb.CheckpointReport, state: CoordinatorState) -> pb.Ack:
    _check_job(req.job_id, state)
    # a node that left still holds its files: the checkpoint a leaving node writes of its live state (nobody
    # took it), and copies reported after it left, count for the restart of the job
    _known(req.node_id, state, left_too=True, session=req.session)
    if req.plan_epoch > state.epoch or req.plan_epoch == 0:
        raise FailedPrecondition(f"checkpoint for plan epoch {req.plan_epoch}; the plans run so far are 1-{state.epoch}")
    layers = state.job.model_spec.num_layers
    if not 0 <= req.layer_start < req.layer_end <= layers:
        raise InvalidArgument(f"checkpoint layers [{req.layer_start}, {req.layer_end}) are outside the model's "
                              f"{layers} layers")
    v.check_string("path", req.path, limit=4096)
    v.check_string("not_written", req.not_written, limit=1024)
    layers_of = (req.layer_start, req.layer_end)
    if req.not_written:  # the writer's disk is full (or denied it): no file, another node of the stage writes
        if state.replication_gaps.not_written(req.node_id, layers_of, req.step, req.not_written):
            who = stand_in(state.current_plan(), req.node_id, layers_of)
            log.warning("node %s could not write its checkpoint of step %d (layers [%d, %d)): %s; the stage is "
                        "under-replicated, %s", req.node_id, req.step, *layers_of, req.not_written,
                        f"{who} is asked to write it" if who else "and no other node of the plan holds it whole")
        return pb.Ack(message=f"checkpoint of step {req.step} recorded as not written; the stage is under-replicated")
    if req.copy_of:
        _check_copy(req, state)
    if state.replication_gaps.written(req.node_id, layers_of) is not None:
        log.info("node %s writes its checkpoints of layers [%d, %d) again (step %d): the stage is replicated",
                 req.node_id, *layers_of, req.step)
    state.store.add_checkpoint(CheckpointRecord(
        step=req.step, plan_epoch=req.plan_epoch, node_id=req.node_id, layer_start=req.layer_start,
        layer_end=req.layer_end, path=req.path, bytes=req.bytes, data_position=req.data_position,
        reported_unix=state.clock()))
    if req.checksum and not req.copy_of:
        state.checkpoint_checksums[(req.step, req.node_id, req.layer_start, req.layer_end)] = req.checksum
    done = state.complete_checkpoint_steps()
    state.note_complete_checkpoints(done)
    state.try_finish(state.clock())  # the final checkpoint of a trained job finishes it
    complete = bool(done) and done[-1] == req.step
    # replication progress: how many nodes hold each layer range of this step (the writer and its copies)
    copies = replication(state.store.list_checkpoints(), req.step)
    held = ", ".join(f"[{a}, {b}) on {n}" for (a, b), n in copies.items())
    return pb.Ack(message=f"checkpoint of step {req.step} {'complete' if complete else 'recorded'}; copies: {held} "
                          f"(wanted {1 + state.job.checkpoint.replicas} each)")


def _check_copy(req: pb.CheckpointReport, state: CoordinatorState) -> None:
    """A copy is recorded only as what its writer wrote: the writer's own record of the same step and layers, with
    the same size and CRC-32. (The holder reports it under its own certificate, after its fetch checked every
    chunk's CRC against the writer's file.)"""
    own = [r for r in state.store.list_checkpoints() if r.step == req.step and r.node_id == req.copy_of
           and (r.layer_start, r.layer_end) == (req.layer_start, req.layer_end)]
    if not own:  # the writer's report may still be on its way (it queues it as it hands out copies)
        raise Unavailable(f"ReportCheckpoint: no record yet of node {req.copy_of[:80]}'s checkpoint of step {req.step} "
                          f"(layers [{req.layer_start}, {req.layer_end})) that this is a copy of; retry")
    crc = state.checkpoint_checksums.get((req.step, req.copy_of, req.layer_start, req.layer_end))
    if own[-1].bytes != req.bytes or (crc is not None and req.checksum and crc != req.checksum):
        raise FailedPrecondition(
            f"ReportCheckpoint: the copy on {req.node_id} of node {req.copy_of[:80]}'s checkpoint of step {req.step} "
            f"is {req.bytes} bytes, CRC-32 {req.checksum:08x}; the writer's file is {own[-1].bytes} bytes"
            + (f", CRC-32 {crc:08x}" if crc is not None else "") + ": it is not recorded; take the copy again")


def handle_outer_sync(req: pb.OuterSyncRequest, state: CoordinatorState) -> pb.OuterSyncReply:
    """A node's arrival at (or question about) an outer round, repeated with every question (so a restarted
    coordinator hears it again), with what the node holds of the decision, the participants out of its reach and
    its anchor hashes; the reply says whether the round is decided, and whether the decision is final."""
    from atoll.coordinator.outer import GroupInfo, Participant

    _check_job(req.job_id, state)
    _known(req.node_id, state, session=req.session)
    plan = state.current_plan()
    if plan is None or plan.mode != "outer" or plan.outer is None:
        raise FailedPrecondition("the current plan has no replica groups; wait for the next plan")
    if req.plan_epoch > plan.epoch:
        raise FailedPrecondition(f"outer sync for plan epoch {req.plan_epoch}, but the newest is {plan.epoch}")
    groups = [GroupInfo(index=i, name=g.name, since_epoch=g.since_epoch or plan.epoch,
                        nodes=frozenset(plan.group_nodes(i)), inner_steps=g.inner_steps)
              for i, g in enumerate(plan.groups)]
    group = req.group
    if req.plan_epoch < plan.epoch:
        # a node that has not adopted the newest plan yet names its group by its own plan's index, which the
        # newest plan may have moved (a kept group is listed first): its group is the one holding it, when that
        # group ran unchanged since before the node's plan (otherwise it was replanned and the node's run ends)
        mine = next((g for g in groups if req.node_id in g.nodes), None)
        if mine is not None and mine.since_epoch <= max(1, req.plan_epoch):
            group = mine.index
    if group >= len(plan.groups):
        raise InvalidArgument(f"group {group} does not exist; the plan has {len(plan.groups)}")
    if req.node_id not in groups[group].nodes:
        raise FailedPrecondition(f"node {req.node_id} is not in group {group} ({plan.groups[group].name}) "
                                 f"of plan epoch {plan.epoch}; wait for the next plan")
    if req.round > 1 << 40 or req.tokens > 1 << 62 or req.inner_step > 1 << 40 or req.round_steps > 1 << 30:
        raise InvalidArgument("round, tokens, inner_step or round_steps out of range")
    if req.contribution_norm < 0:  # (not finite is allowed: it is what gets a contribution left out)
        raise InvalidArgument(f"contribution_norm = {req.contribution_norm} must be >= 0 (or not finite)")
    for name in ("sync_seconds", "late_seconds", "step_seconds", "hold_seconds"):
        v.check_seconds(name, getattr(req, name))
    if len(req.unreachable) > len(plan.groups) or len(req.anchor_hashes) > MAX_ANCHOR_HASHES:
        raise InvalidArgument(f"{len(req.unreachable)} unreachable participants and {len(req.anchor_hashes)} anchor "
                              f"hashes in one outer sync; at most {len(plan.groups)} and {MAX_ANCHOR_HASHES}")
    if any(h.round > req.round for h in req.anchor_hashes):
        raise InvalidArgument(f"an anchor hash of a round after round {req.round}, which the node is at")
    if any(len(x.node_ids) > MAX_GROUP_NODES for x in req.unreachable):
        raise InvalidArgument(f"an unreachable participant of more than {MAX_GROUP_NODES} nodes")
    deadline = plan.outer.deadline_s or 60.0
    stats = {"bytes": req.sync_bytes, "seconds": req.sync_seconds, "late": req.late_seconds}
    unreachable = [Participant(group=x.group, tokens=x.tokens, since_epoch=x.since_epoch, nodes=tuple(x.node_ids))
                   for x in req.unreachable]
    def alive(n: str) -> bool:
        return (m := state.store.peek_member(n)) is not None and m.state == "alive"

    d = state.outer.arrive(state.clock(), round_=req.round, node=req.node_id if req.arrived else "",
                           group=group, tokens=req.tokens, inner_step=req.inner_step, groups=groups,
                           deadline_s=deadline, stats=stats if req.arrived else None, epoch=plan.epoch,
                           fetched_version=req.fetched_version, unreachable=unreachable, version=req.version,
                           fetch_bound_s=plan.outer.fetch_bound_s, h=plan.outer.inner_steps,
                           step_seconds=req.step_seconds if req.arrived else 0.0, round_steps=req.round_steps,
                           norm=req.contribution_norm if req.arrived and req.has_contribution_norm else None,
                           alive=alive)
    # a long poll: asked again (a question, registering nothing) as arrivals and reports come, until the answer
    # changes or the hold ends, so a node learns of a decision, and of its finality, without polling for it
    d, held = state.outer.hold(
        lambda: state.outer.arrive(state.clock(), round_=req.round, node="", group=group, tokens=req.tokens,
                                   inner_step=req.inner_step, groups=groups, deadline_s=deadline, epoch=plan.epoch,
                                   fetch_bound_s=plan.outer.fetch_bound_s, h=plan.outer.inner_steps, alive=alive),
        d, req.hold_seconds, known=max(req.fetched_version, req.version))
    if req.anchor_hashes:
        for line in state.outer.report_hashes(req.node_id, plan.groups[group].name,
                                              [(h.round, h.layer, h.crc32) for h in req.anchor_hashes]):
            log.error("%s: the replica groups' outer parameters have drifted apart; the job goes on, but its groups "
                      "no longer train one model (report it with the nodes' logs)", line)

    def part(x) -> pb.OuterParticipant:
        return pb.OuterParticipant(group=x.group, tokens=x.tokens, since_epoch=x.since_epoch, node_ids=list(x.nodes))
    reply = pb.OuterSyncReply(
        decided=d.decided, wait_seconds=d.wait_seconds, latest_round=max(state.outer.latest_decided, 0),
        participants=[part(x) for x in d.participants], version=d.version, final=d.final, held=held)
    if d.checkpointer is not None:
        reply.checkpointer.CopyFrom(part(d.checkpointer))
    if d.inner_steps:
        reply.steps_round = d.steps_round
        reply.inner_steps.extend(pb.OuterGroupSteps(group=g.name, since_epoch=g.since_epoch, inner_steps=g.steps,
                                                    step_seconds=g.step_s) for g in d.inner_steps)
    return reply


def handle_report_failure(req: pb.RunFailure, state: CoordinatorState) -> pb.Ack:
    """A node's run of a plan failed while the node lives: recorded, and the coordinator's loop replans.

    A failure of an older epoch is acknowledged and ignored (a newer plan already replaced it).
    """
    _check_job(req.job_id, state)
    _known(req.node_id, state, session=req.session)
    v.check_string("reason", req.reason, required=True, limit=MAX_FAILURE_REASON)
    epoch = state.epoch
    if req.plan_epoch == 0 or req.plan_epoch > epoch:
        raise FailedPrecondition(f"failure of plan epoch {req.plan_epoch}; the plans run so far are 1-{epoch}")
    if req.step > state.target_steps:
        raise InvalidArgument(f"failure at step {req.step}, past the job's {state.target_steps} steps")
    wait = state.failure_limit.take(req.node_id, state.clock())
    if wait is not None:
        log.error("node %s reports failures faster than its rate allows (each makes a new plan): refused for %.0fs",
                    req.node_id, wait)
        raise RateLimited(f"node {req.node_id} reported more than {state.options.failure_reports.burst} failures "
                          f"within {state.options.failure_reports.every_s:.0f}s; it may report again in {wait:.0f}s",
                          retry_after_s=wait)
    if req.lost_checkpoint_step:  # whatever the epoch: the files are gone either way
        dropped = state.store.drop_checkpoints(req.lost_checkpoint_step, req.node_id)
        if dropped:
            log.warning("node %s lost its files of the checkpoint of step %d (%s): %d index record(s) dropped; the "
                        "next plan resumes from a step held whole", req.node_id, req.lost_checkpoint_step,
                        req.reason[:200], dropped)
    if req.plan_epoch < epoch:
        return pb.Ack(message=f"plan epoch {req.plan_epoch} is already replaced by epoch {epoch}; ignored")
    recorded = state.record_failure(RunFailureRecord(epoch=req.plan_epoch, node_id=req.node_id, step=req.step,
                                                     reason=req.reason, reported_unix=state.clock()))
    return pb.Ack(message=f"failure of plan epoch {req.plan_epoch} {'recorded' if recorded else 'already known'}")


def handle_leave(req: pb.LeaveRequest, state: CoordinatorState) -> pb.Ack:
    _known(req.node_id, state, session=req.session)
    v.check_string("reason", req.reason)
    state.store.set_member_state(req.node_id, "left", req.reason or "left")
    state.membership_changed(state.clock())
    return pb.Ack(message=f"node {req.node_id} left")


def open_watch(req: pb.WatchPlanRequest, state: CoordinatorState) -> int:
    """Check a plan watch; the epoch the watcher already has. An empty node id (a status tool) needs no membership."""
    if req.node_id:  # (a quarantined node's watch stays open: it waits for its release in no plan)
        _known(req.node_id, state, session=req.session, quarantined_too=True)
    return req.known_epoch


def watch_plan(req: pb.WatchPlanRequest, state: CoordinatorState, active: Callable[[], bool],
               poll_seconds: float = 1.0) -> Iterator[pb.Plan]:
    """Plans newer than `known_epoch`, as they are published, while `active()` holds, blocking this thread.

    The server serves watches with `atoll.coordinator.watches`, on its event loop; this is the threaded form.
    """
    known = open_watch(req, state)
    while active() and not state.closed:
        plan = state.wait_for_plan(known, poll_seconds, req.node_id)
        if plan is not None:
            if req.node_id:  # a newer process of the node may have joined since the watch opened
                state.check_session(req.node_id, req.session)
            known = plan.epoch
            yield plan_to_proto(plan)


def handle_status(req: pb.StatusRequest, state: CoordinatorState) -> pb.StatusReply:
    plan = state.current_plan()
    members = state.store.list_members()
    # enough reports for the summary's steps from every node, however many there are
    recent = state.store.recent_steps(max(RECENT_STEPS_IN_STATUS * 8, len(members) * (STATUS_WINDOW_STEPS + 1)))
    progress = summarize(recent, plan.epoch if plan is not None else 0, window=STATUS_WINDOW_STEPS)
    # the loss shown is the newest the history recorded, the vote of the last stages' replicas (one report is one
    # replica's claim, which a broken or lying replica could set); the newest report's only before any vote
    voted = next((p for p in reversed(state.store.history(newest=8)) if p.count), None)
    if voted is not None and voted.loss is not None:
        progress = replace(progress, loss=voted.loss, loss_step=voted.last)
    done = state.complete_checkpoint_steps()
    reply = pb.StatusReply(
        job=_job_info(state), waiting=state.waiting_reason,
        members=[pb.Member(node_id=m.node_id, peer_address=m.peer_address, profile=profile_to_proto(m.profile),
                           state=m.state, last_heartbeat_unix=m.last_heartbeat_unix, joined_unix=m.joined_unix)
                 for m in members],
        islands=[island_to_proto(i) for i in state.store.get_islands()],
        links=[link_to_proto(x) for x in state.store.list_links()],
        recent_steps=[step_metrics_to_proto(s) for s in recent[-RECENT_STEPS_IN_STATUS:]],
        step=progress.step, tokens_per_second=progress.tokens_per_second,
        last_checkpoint_step=done[-1] if done else 0,
        has_loss=progress.loss is not None, loss=progress.loss or 0.0, loss_step=progress.loss_step,
        measured_step_seconds=progress.measured_step_seconds, measured_steps=progress.measured_steps,
        stage_usage=[pb.StageUsage(node_id=u.node_id, pipeline=u.pipeline, stage=u.stage, steps=u.steps,
                                   step_seconds=u.step_seconds, compute_seconds=u.compute_seconds,
                                   wait_seconds=u.wait_seconds, utilisation=u.utilisation,
                                   peak_memory_bytes=u.peak_memory_bytes)
                     for u in progress.stages],
        link_usage=[pb.LinkUsage(src=x.src, dst=x.dst, direction=DIRECTION_BY_NAME.get(x.direction, 0),
                                 pipeline=x.pipeline, stage=x.stage, steps=x.steps, codec=codec_id(x.codec),
                                 bytes_raw=x.bytes_raw, bytes_wire=x.bytes_wire, seconds=x.seconds,
                                 achieved_bytes_per_s=x.achieved_bytes_per_s,
                                 estimate_bytes_per_s=x.estimate_bytes_per_s)
                    for x in progress.links])
    if plan is not None:
        reply.plan.CopyFrom(plan_to_proto(plan))
    fill_history(reply, state.store.history(), req.history_points)
    if plan is not None and plan.mode == "outer":
        from atoll.coordinator.outer import GroupProgress

        # every planned group in the plan's order, also one that has not arrived at a round yet, then those it no
        # longer plans; each by its name, as the progress is kept (a replan may reorder the groups). Copies, as
        # nodes' arrivals change the progress while this reads it
        outer = dict(state.outer.progress)
        names = [g.name for g in plan.groups]
        total = sum(g.tokens for g in outer.values())
        for name in names + sorted(set(outer) - set(names)):
            g = outer.get(name) or GroupProgress(name=name)
            reply.group_usage.add(
                group=names.index(name) if name in names else 0, name=name, planned=name in names,
                inner_step=g.inner_step, tokens=g.tokens, round=g.round, rounds_in=g.rounds_in,
                rounds_missed=g.rounds_missed,
                sync_bytes=float(sum(list(g.sync_bytes.values()))),  # summed over the group's nodes
                sync_seconds=max(list(g.sync_seconds.values()), default=0.0),  # its slowest node
                late_seconds=max(list(g.late_seconds.values()), default=0.0),
                steps_per_round=g.steps_per_round(plan.global_batch * plan.seq_len),
                wait_seconds_per_round=g.wait_per_round(), token_share=g.tokens / total if total else 0.0,
                step_seconds=g.step_s, assigned_steps=g.assigned_steps,
                round_target_seconds=state.outer.target_s)
    reply.final_checkpoint_step = state.final_checkpoint_step()
    reply.anchor_mismatches = state.outer.anchor_mismatches
    reply.anchor_mismatch = state.outer.last_mismatch
    reply.outer_exclusions, reply.outer_exclusion = state.outer.exclusions, state.outer.last_exclusion
    reply.under_replicated.extend(state.replication_gaps.lines(state.current_plan()))
    reply.network_fit.extend(state.network_fit_lines())
    backup = state.newest_backup()
    if backup is not None:
        reply.newest_backup_path, reply.newest_backup_unix = backup
    reply.job_state = job_control.job_state(state.control)
    reply.finished_unix = state.control.finished_unix
    reply.stopped_unix = state.control.stopped_unix
    reply.target_steps = state.target_steps
    reply.offenders.extend(quarantine.offenders(state))
    return reply


def handle_control_job(req: pb.JobControlRequest, state: CoordinatorState) -> pb.JobControlReply:
    """`atoll job stop` / `atoll job extend --steps N`: change the step the running job ends at; `atoll job
    quarantine` lists the quarantined nodes and `atoll job release NODE` lets one back."""
    _check_job(req.job_id, state)
    recent = state.store.recent_steps(1)
    newest = recent[-1].step if recent else None
    if req.action == "viewer-token":
        token = state.viewer_token()
        if not token:
            raise FailedPrecondition("this coordinator keeps no viewer token: ask the `atoll coordinator` process")
        return pb.JobControlReply(target_steps=state.target_steps, step=newest or 0, viewer_token=token,
                                  message="viewer token of the dashboard (read-only; it cannot join the job)")
    if req.action in ("quarantine", "release"):
        listed = [o for o in quarantine.offenders(state) if o.quarantined]
        if req.action == "quarantine":
            how = f"{len(listed)} node(s) quarantined" if listed else "no node is quarantined"
            return pb.JobControlReply(target_steps=state.target_steps, step=newest or 0, message=how,
                                      quarantined=listed)
        v.check_node_id(req.node_id)
        how = quarantine.release(state, req.node_id)
        log.info("%s", how)
        return pb.JobControlReply(target_steps=state.target_steps, step=newest or 0, message=how)
    try:
        if req.action == "stop":
            control, how = job_control.stop(state.control, spec_steps=state.job.train.steps, newest_step=newest,
                                            now=state.clock())
        elif req.action == "extend":
            control, how = job_control.extend(state.control, req.steps, spec_steps=state.job.train.steps,
                                              newest_step=newest)
        else:
            raise InvalidArgument(f"job control action must be 'stop', 'extend', 'quarantine', 'release' or "
                                  f"'viewer-token', got "
                                  f"{req.action[:40]!r}")
    except job_control.ControlRefused as e:
        raise FailedPrecondition(str(e)) from None
    state.set_control(control)
    return pb.JobControlReply(target_steps=state.target_steps, step=newest or 0, message=how)
