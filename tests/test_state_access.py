"""The stage-state rules of a node's Peer server (`StateAccess`), as pure checks on plans and requests."""

from __future__ import annotations

import threading
import time

import pytest

from atoll.node.peer_authz import Forbidden, StateAccess
from atoll.plan import CheckpointCopy, PipelinePlan, Plan, StagePlan
from atoll.v1 import atoll_pb2 as pb


def _plan(epoch: int, cut: int, copies: tuple = ()) -> Plan:
    return Plan(model="m", global_batch=8, seq_len=16, epoch=epoch, job_id="j", resume_step=0,
                pipelines=[PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
                    StagePlan(island="i0", layers=(0, cut), nodes=["a"]),
                    StagePlan(island="i0", layers=(cut, 8), nodes=["b"])])],
                node_addresses={"a": "h:1", "b": "h:2"}, checkpoint_copies=list(copies))


def _fetch(sender: str, layers: tuple[int, int], kind: str = "checkpoint", step: int = 10) -> pb.StateFetchRequest:
    return pb.StateFetchRequest(job_id="j", kind=kind, step=step, layer_start=layers[0], layer_end=layers[1],
                                sender=sender)


def test_fetches_are_for_the_askers_own_layers_copies_or_granted_files() -> None:
    access = StateAccess()
    access.note(_plan(1, 4, [CheckpointCopy(node_id="a", layers=(4, 8), address="h:1")]))
    access.check_fetch("a", _fetch("a", (0, 4)), wait=0)  # its stage
    access.check_fetch("b", _fetch("b", (2, 6)), wait=0)  # overlapping its stage (a holder's whole range)
    access.check_fetch("a", _fetch("a", (4, 8)), wait=0)  # a copy the plan says it keeps
    with pytest.raises(Forbidden, match="fetches only the state of its own layers"):
        access.check_fetch("b", _fetch("b", (0, 4)), wait=0)
    with pytest.raises(Forbidden, match="none of the plans"):
        access.check_fetch("x", _fetch("x", (0, 4)), wait=0)
    with pytest.raises(Forbidden, match="request names 'a'"):
        access.check_fetch("b", _fetch("a", (0, 4)), wait=0)
    access.grant("b", 10, (0, 4))  # this node asked b to copy its file of step 10
    access.check_fetch("b", _fetch("b", (0, 4)), wait=0)
    with pytest.raises(Forbidden):  # the grant is for that file only
        access.check_fetch("b", _fetch("b", (0, 4), step=11), wait=0)
    with pytest.raises(Forbidden):
        access.check_fetch("b", _fetch("b", (0, 4), kind="live"), wait=0)


def test_replicate_only_from_the_writer_for_its_own_stage() -> None:
    access = StateAccess()
    access.note(_plan(1, 4))

    def request(source: str, layers: tuple[int, int]) -> pb.ReplicateRequest:
        return pb.ReplicateRequest(job_id="j", step=10, layer_start=layers[0], layer_end=layers[1], source=source,
                                   source_address="h:1", plan_epoch=1)

    access.check_replicate("a", request("a", (0, 4)), wait=0)
    with pytest.raises(Forbidden, match="only the writer"):
        access.check_replicate("b", request("a", (0, 4)), wait=0)
    with pytest.raises(Forbidden, match="only its own stage"):
        access.check_replicate("a", request("a", (0, 6)), wait=0)


def test_a_check_waits_for_the_plan_that_allows_it_then_refuses() -> None:
    """A member may call a moment before this node hears of the plan that gives it the layers."""
    access = StateAccess()
    access.note(_plan(1, 4))
    later = threading.Timer(0.3, lambda: access.note(_plan(2, 2)))  # b now runs layers [2, 8)
    later.start()
    started = time.monotonic()
    access.check_fetch("b", _fetch("b", (0, 4)), wait=5.0)
    assert time.monotonic() - started < 3.0
    later.join()
    started = time.monotonic()
    with pytest.raises(Forbidden):
        access.check_held("x", pb.HeldStateRequest(job_id="j", plan_epoch=3, sender="x"), wait=0.3)
    assert time.monotonic() - started >= 0.3


def test_a_node_that_left_hands_its_live_state_to_the_next_plans_nodes() -> None:
    """A node that left hears of no more plans: the next plan's nodes (an idle one, here x), on layers it
    cannot know, take its live state; its checkpoint files stay under the rules."""
    access = StateAccess()
    access.note(_plan(1, 4))
    with pytest.raises(Forbidden):
        access.check_fetch("a", _fetch("a", (4, 8), kind="live"), wait=0)
    with pytest.raises(Forbidden, match="none of the plans"):
        access.check_held("x", pb.HeldStateRequest(job_id="j", plan_epoch=2, sender="x"), wait=0)
    access.hand_over()
    access.check_fetch("a", _fetch("a", (4, 8), kind="live"), wait=0)
    access.check_fetch("x", _fetch("x", (4, 8), kind="live"), wait=0)
    access.check_held("x", pb.HeldStateRequest(job_id="j", plan_epoch=2, sender="x"), wait=0)
    with pytest.raises(Forbidden):
        access.check_fetch("a", _fetch("a", (4, 8)), wait=0)
    with pytest.raises(Forbidden, match="request names 'a'"):
        access.check_fetch("x", _fetch("a", (4, 8), kind="live"), wait=0)
