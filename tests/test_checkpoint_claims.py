"""Checkpoint records checked against what their holder can serve, and a stage whose writer cannot write (a full disk)
recorded as under-replicated with another node of the stage asked to write it, through the plain handlers."""

from __future__ import annotations

from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.authz import PermissionDenied, PlanLookup, check_checkpoint
from atoll.coordinator.errors import FailedPrecondition, Unavailable
from atoll.coordinator.replication_gaps import stand_in
from atoll.node.checkpoint import file_crc32, prune_own
from atoll.node.state_transfer import checkpoint_file
from atoll.v1 import atoll_pb2 as pb
from test_claims import planned  # noqa: F401 - the fixture

__all__ = ["planned"]


def _ckpt(state, node: str, step: int, layers: tuple[int, int], **kw) -> pb.CheckpointReport:
    return pb.CheckpointReport(job_id=state.job.id, node_id=node, plan_epoch=state.epoch, step=step,
                               layer_start=layers[0], layer_end=layers[1], path="/x", **kw)


def _report(state, req: pb.CheckpointReport, caller: str) -> pb.Ack:
    """The servicer's order: authorisation under the caller's certificate, then the handler."""
    check_checkpoint(req, state, PlanLookup(), reporter=caller)
    return h.handle_report_checkpoint(req, state)


def test_a_copy_reported_by_its_writer_for_another_node_is_refused(planned) -> None:  # noqa: F811
    """The finding: a node recorded a copy on another node, which that node could not serve (the index trusted the
    writer's word); the copy's holder reports it itself now."""
    state, first, _ = planned
    own = _ckpt(state, first, 20, (0, 2), bytes=100, checksum=0xABCD)
    _report(state, own, first)
    with pytest.raises(PermissionDenied, match="reported by the node that holds it"):
        _report(state, _ckpt(state, "n1", 20, (0, 2), bytes=100, copy_of=first), first)
    assert {r.node_id for r in state.store.list_checkpoints()} == {first}


def test_a_copy_is_recorded_only_as_what_its_writer_wrote(planned) -> None:  # noqa: F811
    state, first, last = planned
    copy = _ckpt(state, last[0], 20, (0, 2), bytes=100, checksum=0xABCD, copy_of=first)
    with pytest.raises(Unavailable, match="no record yet"):  # the writer's own report is still on its way
        _report(state, copy, last[0])
    _report(state, _ckpt(state, first, 20, (0, 2), bytes=100, checksum=0xABCD), first)
    for wrong in (dict(bytes=99, checksum=0xABCD), dict(bytes=100, checksum=0x1234)):
        bad = _ckpt(state, last[0], 20, (0, 2), copy_of=first, **wrong)
        with pytest.raises(FailedPrecondition, match="not recorded; take the copy again"):
            _report(state, bad, last[0])
    assert {r.node_id for r in state.store.list_checkpoints()} == {first}
    _report(state, copy, last[0])
    assert {r.node_id for r in state.store.list_checkpoints()} == {first, last[0]}
    # a copy of layers its named writer does not hold
    with pytest.raises(PermissionDenied, match="holds layers"):
        _report(state, _ckpt(state, last[1], 20, (2, state.job.model_spec.num_layers), bytes=100, copy_of=first),
                last[1])


def test_a_writer_that_cannot_write_makes_the_stage_under_replicated_and_another_node_writes(planned) -> None:  # noqa: F811
    """Issue item 4, a node's full disk: the coordinator records the stage as under-replicated (status), asks
    another node of the stage to write its checkpoints (heartbeat), and the gap closes once the writer writes again."""
    state, _, last = planned
    n = state.job.model_spec.num_layers
    writer, other = last
    assert stand_in(state.current_plan(), writer, (2, n)) == other
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id=other), state).write_checkpoints
    ack = _report(state, _ckpt(state, writer, 25, (2, n), not_written="[Errno 28] No space left on device"), writer)
    assert "under-replicated" in ack.message
    assert not any(r.step == 25 for r in state.store.list_checkpoints())  # nothing recorded as held
    status = h.handle_status(pb.StatusRequest(), state)
    assert len(status.under_replicated) == 1
    line = status.under_replicated[0]
    assert writer in line and "No space left" in line and f"{other} writes them instead" in line
    assert h.handle_heartbeat(pb.HeartbeatRequest(node_id=other), state).write_checkpoints
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id=writer), state).write_checkpoints
    _report(state, _ckpt(state, other, 50, (2, n), bytes=10), other)  # the stand-in writes: still a gap
    assert h.handle_status(pb.StatusRequest(), state).under_replicated
    _report(state, _ckpt(state, writer, 75, (2, n), bytes=10), writer)  # the writer's disk has room again
    assert not h.handle_status(pb.StatusRequest(), state).under_replicated
    assert not h.handle_heartbeat(pb.HeartbeatRequest(node_id=other), state).write_checkpoints


def test_a_stage_with_no_other_whole_holder_has_no_stand_in(planned) -> None:  # noqa: F811
    state, first, _ = planned
    _report(state, _ckpt(state, first, 25, (0, 2), not_written="disk full"), first)
    line = h.handle_status(pb.StatusRequest(), state).under_replicated[0]
    assert "no other node of the plan holds them whole" in line
    plan = state.current_plan()
    plan.pipelines[0].stages[1].zero = 1  # sharded optimizer states: no replica holds the stage whole
    assert stand_in(plan, "n1", (2, state.job.model_spec.num_layers)) is None


def test_a_full_disk_prunes_only_this_stages_older_files(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        for layers in ((0, 2), (2, 4)):
            f = checkpoint_file(tmp_path, step, layers)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"x" * step)
    assert prune_own(tmp_path, (0, 2), keep={10}) == [20]
    assert [s for s in (10, 20, 30) if checkpoint_file(tmp_path, s, (0, 2)).is_file()] == [10, 30]
    assert all(checkpoint_file(tmp_path, s, (2, 4)).is_file() for s in (10, 20, 30))  # another stage's files stay
    assert file_crc32(checkpoint_file(tmp_path, 30, (0, 2))) == __import__("zlib").crc32(b"x" * 30)
