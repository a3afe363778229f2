"""The coordinator's outer rounds: one decision per round, decided again for everyone when a contribution stays out
of a node's reach, applied once final; arrivals and decisions that outlive a coordinator restart; anchor hashes
whose mismatch the log and `atoll status` flag."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.pace import PaceOptions
from atoll.coordinator.outer import (FINAL_AFTER_BOUNDS, GroupInfo, OuterRounds, Participant, decision_final,
                                     decision_from_json, decision_to_json, lost_contributions, redecide,
                                     round_decision, RoundArrivals, writer_of)
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.status import format_status
from atoll.coordinator.store import MemberRecord, MemoryStore, SqliteStore
from atoll.job import JobSpec
from atoll.plan import OuterPlan, PipelinePlan, Plan, ReplicaGroup, StagePlan
from atoll.types import NodeProfile
from atoll.v1 import atoll_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
GROUPS = [GroupInfo(index=0, name="lab-a", nodes=frozenset({"a0", "a1"}), since_epoch=1),
          GroupInfo(index=1, name="lab-b", nodes=frozenset({"b0"}), since_epoch=1)]
DEADLINE = 10.0


def _arrive(rounds: OuterRounds, now: float, node: str, round_: int = 3, **kw):
    group = 0 if node.startswith("a") else 1
    return rounds.arrive(now, round_=round_, node=node, group=group, tokens=100 * (group + 1), inner_step=0,
                         groups=GROUPS, deadline_s=DEADLINE, epoch=1, **kw)


def test_a_restarted_coordinator_resumes_the_round_from_its_store(tmp_path: Path) -> None:
    """A coordinator killed mid-round kept the arrivals it had heard: restarted on its store, it decides the round
    with them as soon as the last group arrives (before, arrivals lived in memory, nodes told them once, and the
    round waited out every node's deadline). A decided round's decision, and its finality, survive too."""
    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=0.0)
    assert not _arrive(rounds, 0.0, "a0").decided
    assert not _arrive(rounds, 0.5, "a1").decided  # lab-a complete, waiting for lab-b
    store.close()  # killed

    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=100.0)  # restarted long after the deadline: it counts from the restart
    d = _arrive(rounds, 100.0, "b0")
    assert d.decided and d.version == 1 and [p.group for p in d.participants] == [0, 1], d.reason
    assert d.checkpointer is not None and set(d.checkpointer.nodes) == {"a0", "a1"}
    assert not d.final  # the nodes hold no contributions yet
    for n in ("a0", "a1", "b0"):
        d = _arrive(rounds, 101.0, n, fetched_version=1)
    assert d.final
    store.close()

    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=200.0)
    again = rounds.arrive(200.0, round_=3, node="", group=0, tokens=0, inner_step=0, groups=GROUPS,
                          deadline_s=DEADLINE)
    assert again.final and again.version == 1 and [p.group for p in again.participants] == [0, 1]
    assert rounds.latest_decided == 3
    store.close()


def test_a_restarted_coordinator_keeps_each_groups_counters(tmp_path: Path) -> None:
    """A group's rounds in, tokens, exchange bytes and waits are written with each decision: a restarted
    coordinator's status goes on from them (they restarted at zero), and an arrival the nodes repeat after the
    restart is not counted twice."""
    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=0.0)
    stats = {"bytes": 1000.0, "seconds": 0.5, "late": 2.0}
    for n in ("a0", "a1", "b0"):
        d = _arrive(rounds, 0.0, n, stats=stats)
    assert d.decided
    b = rounds.progress["lab-b"]
    assert (b.rounds_in, b.tokens, b.sync_bytes_total, b.wait_total_s) == (1, 200, 1000, 2.0)
    a = rounds.progress["lab-a"]
    assert (a.rounds_in, a.sync_bytes_total, a.wait_total_s) == (1, 2000, 2.0)  # two nodes' bytes, the longest wait
    store.close()  # killed

    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=50.0)
    b = rounds.progress["lab-b"]
    assert (b.rounds_in, b.tokens, b.sync_bytes_total, b.wait_total_s) == (1, 200, 1000, 2.0)
    _arrive(rounds, 50.0, "b0", stats=stats)  # repeated after the restart
    assert (rounds.progress["lab-b"].sync_bytes_total, rounds.progress["lab-b"].wait_total_s) == (1000, 2.0)
    for n in ("a0", "a1", "b0"):
        _arrive(rounds, 51.0, n, round_=4, stats={"bytes": 10.0, "late": 1.0})
    b = rounds.progress["lab-b"]
    assert (b.rounds_in, b.tokens, b.sync_bytes_total, b.wait_total_s) == (2, 400, 1010, 3.0)
    store.close()


def test_a_contribution_out_of_reach_is_decided_again_for_everyone() -> None:
    """One node could not fetch lab-b's contribution within its bound: the round is decided again without it (a new
    version), and every node, also those that had fetched it, is told the new version; it is final only once every
    node that arrived holds that version's contributions. A stale report (of an older version) changes nothing, and
    a final decision never changes."""
    rounds = OuterRounds()
    for n in ("a0", "a1", "b0"):
        d = _arrive(rounds, 0.0, n)
    assert d.decided and d.version == 1
    lab_b = d.participants[1]
    d = _arrive(rounds, 1.0, "b0", fetched_version=1)
    d = _arrive(rounds, 1.0, "a1", fetched_version=1)
    assert not d.final  # a0 has not said
    d = _arrive(rounds, 5.0, "a0", unreachable=[lab_b], version=1)
    assert d.version == 2 and [p.group for p in d.participants] == [0] and not d.final
    assert "out of reach of node a0" in d.reason
    d = _arrive(rounds, 5.1, "a1", unreachable=[lab_b], version=1)  # the same report of the old version: no change
    assert d.version == 2
    d = _arrive(rounds, 5.2, "b0", fetched_version=1)  # b0 still holds version 1 only: not final
    assert not d.final
    for n in ("a0", "a1", "b0"):
        d = _arrive(rounds, 5.3, n, fetched_version=2)
    assert d.final and d.version == 2
    d = _arrive(rounds, 6.0, "a0", unreachable=[d.participants[0]], version=2)
    assert d.final and d.version == 2 and [p.group for p in d.participants] == [0]
    # lab-b counted in with the first version, missed after all
    assert (rounds.progress["lab-b"].rounds_in, rounds.progress["lab-b"].rounds_missed) == (0, 1)


def test_decisions_as_pure_functions() -> None:
    arr = RoundArrivals(epoch=1, nodes={"a0": (0, 100), "a1": (0, 100), "b0": (1, 200)}, completed={0: 0.0, 1: 1.0})
    d = round_decision(1.0, arr, GROUPS, DEADLINE)
    assert d.decided and d.version == 1 and d.decided_unix == 1.0
    assert decision_from_json(decision_to_json(d)) == d
    b = Participant(group=7, tokens=0, since_epoch=1, nodes=("b0",))  # by identity: another plan's index
    again = redecide(2.0, d, b, "a0")
    assert again is not None and again.version == 2 and [p.group for p in again.participants] == [0]
    assert redecide(3.0, again, b, "a1") is None  # left out already
    ok, why = decision_final(2.5, again, ["a0", "a1", "b0"], {"a0": 2, "a1": 2, "b0": 1}, FINAL_AFTER_BOUNDS * 10)
    assert not ok and "b0" in why
    ok, why = decision_final(22.0, again, ["a0", "a1", "b0"], {"a0": 2, "a1": 2, "b0": 1}, 20.0)
    assert ok and "b0" in why  # a node silent past the bound holds up nobody


def _outer_state() -> CoordinatorState:
    job = JobSpec.load(ROOT / "examples" / "tiny.toml")
    state = CoordinatorState(store=MemoryStore(), job=job, token="t", clock=lambda: 1000.0)
    plan = Plan(model="tiny", global_batch=8, seq_len=64, epoch=1, mode="outer", job_id=job.id, pipelines=[
        PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[StagePlan(island="i-a", layers=(0, 4), nodes=["a0"])]),
        PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[StagePlan(island="i-b", layers=(0, 4), nodes=["b0"])])],
        groups=[ReplicaGroup(name="lab-a", pipelines=[0], inner_steps=5),
                ReplicaGroup(name="lab-b", pipelines=[1], inner_steps=5)],
        outer=OuterPlan(inner_steps=5, codec="int8", deadline_s=10.0))
    for n in ("a0", "b0"):
        state.store.put_member(MemberRecord(node_id=n, peer_address=f"{n}:1", profile=NodeProfile(
            hostname=n, device_kind="cpu", device_name="c", memory_total_bytes=1 << 30)))
    state.publish(plan, "test")
    return state


def test_an_anchor_hash_mismatch_is_flagged_in_the_log_and_the_status(caplog) -> None:
    """Each node reports a crc32 of its anchor per layer with its next arrival; the same layer after the same round
    must hash alike on every node of every group. A mismatch is logged as an error and shown by `atoll status`."""
    state = _outer_state()
    job_id = state.job.id

    def sync(node: str, group: int, hashes: list[tuple[int, int, int]]) -> pb.OuterSyncReply:
        return h.handle_outer_sync(pb.OuterSyncRequest(
            job_id=job_id, node_id=node, plan_epoch=1, round=4, group=group, arrived=True, tokens=10,
            anchor_hashes=[pb.OuterAnchorHash(round=r, layer=layer, crc32=c) for r, layer, c in hashes]), state)

    sync("a0", 0, [(3, 0, 0x11), (3, 1, 0x22)])
    sync("b0", 1, [(3, 0, 0x11), (3, 1, 0x22)])
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.anchor_mismatches == 0
    assert "every node's hashes agree" in format_status(status)
    with caplog.at_level(logging.ERROR, logger="atoll.coordinator"):
        sync("a0", 0, [(4, 0, 0x11), (4, 1, 0x23)])
        sync("b0", 1, [(4, 0, 0x11), (4, 1, 0x22)])
        sync("b0", 1, [(4, 0, 0x11), (4, 1, 0x22)])  # repeated with the next question: counted once
    status = h.handle_status(pb.StatusRequest(), state)
    assert status.anchor_mismatches == 1
    assert "outer round 4, layer 1" in status.anchor_mismatch and "a0 (lab-a)" in status.anchor_mismatch
    assert "b0 (lab-b)" in status.anchor_mismatch
    assert "ANCHOR MISMATCH" in format_status(status)
    assert any("layer 1: the anchors differ" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_an_outer_sync_with_bad_reports_is_refused() -> None:
    import pytest

    from atoll.coordinator.errors import InvalidArgument

    state = _outer_state()
    with pytest.raises(InvalidArgument, match="after round"):
        h.handle_outer_sync(pb.OuterSyncRequest(job_id=state.job.id, node_id="a0", plan_epoch=1, round=2, group=0,
                                                arrived=True, anchor_hashes=[pb.OuterAnchorHash(round=3)]), state)
    with pytest.raises(InvalidArgument, match="unreachable"):
        h.handle_outer_sync(pb.OuterSyncRequest(job_id=state.job.id, node_id="a0", plan_epoch=1, round=2, group=0,
                                                arrived=True, unreachable=[pb.OuterParticipant()] * 3), state)


def test_a_round_is_final_without_nodes_no_longer_in_an_unchanged_group() -> None:
    """lab-b lost a node after it arrived and was planned afresh (a new since-epoch): its nodes take the outer state
    anew rather than apply the round, so the round is final once lab-a holds the decision's contributions, not after
    the bound (which stalled the surviving region)."""
    rounds = OuterRounds()
    for n in ("a0", "a1", "b0"):
        d = _arrive(rounds, 0.0, n)
    assert d.decided
    replanned = [GROUPS[0], GroupInfo(index=1, name="lab-b", nodes=frozenset({"b1"}), since_epoch=2)]
    for n in ("a0", "a1"):
        d = rounds.arrive(1.0, round_=3, node=n, group=0, tokens=100, inner_step=0, groups=replanned,
                          deadline_s=DEADLINE, epoch=1, fetched_version=1)
    assert d.final, d


def test_a_decision_with_a_dead_nodes_contribution_is_decided_again_at_once() -> None:
    """lab-b's node died (its lease lapsed) after the round was decided with its contribution, which nobody else
    fetched: the very next question gets a new version without lab-b, with no time passed (before, the nodes retried
    the dead node for the whole fetch bound, and lab-a stood still that long); it is final once lab-a holds it."""
    state = _outer_state()  # its clock stands still: no bound passes
    job_id = state.job.id

    def sync(node: str, group: int, **kw) -> pb.OuterSyncReply:
        return h.handle_outer_sync(pb.OuterSyncRequest(job_id=job_id, node_id=node, plan_epoch=1, round=4, group=group,
                                                       arrived=True, tokens=10, **kw), state)

    sync("a0", 0)
    d = sync("b0", 1)
    assert d.decided and d.version == 1 and [p.group for p in d.participants] == [0, 1]
    state.store.set_member_state("b0", "gone", "no heartbeat for 12.0s")
    d = sync("a0", 0)
    assert d.version == 2 and [p.group for p in d.participants] == [0] and not d.final
    d = sync("a0", 0, fetched_version=2, version=2)
    assert d.final and d.version == 2  # the dead b0 is waited for by no one


def test_a_dead_nodes_contribution_a_live_group_relays_is_kept() -> None:
    """A contribution whose node died is kept while every node of another live group holds it (they serve it on), and
    left out once its group is replanned away and nobody holds it."""
    rounds = OuterRounds()
    three = [*GROUPS, GroupInfo(index=2, name="lab-c", nodes=frozenset({"c0"}), since_epoch=1)]
    for n, g in (("a0", 0), ("a1", 0), ("b0", 1), ("c0", 2)):
        d = rounds.arrive(0.0, round_=3, node=n, group=g, tokens=100, inner_step=0, groups=three, deadline_s=DEADLINE,
                          epoch=1, fetched_version=1 if n == "c0" else 0)
    assert d.decided and d.version == 1
    dead = {"b0"}
    d = rounds.arrive(1.0, round_=3, node="a0", group=0, tokens=100, inner_step=0, groups=three, deadline_s=DEADLINE,
                      epoch=1, alive=lambda n: n not in dead)
    assert d.version == 1, d.reason  # lab-c fetched it: a0 fetches it from c0
    assert lost_contributions(d, three, lambda n: n not in dead, {"a1": 1}) == {1: "node(s) b0 of it are no longer "
                                                                                "members and no live group holds "
                                                                                "its contribution"}
    replanned = [GROUPS[0], GroupInfo(index=1, name="lab-b", nodes=frozenset({"b0"}), since_epoch=2)]
    lost = lost_contributions(d, replanned, lambda n: True, {})
    assert list(lost) == [1, 2] and "planned afresh" in lost[1]


PACED = [GroupInfo(index=0, name="lab-a", nodes=frozenset({"a0", "a1"}), since_epoch=1, inner_steps=10),
         GroupInfo(index=1, name="lab-b", nodes=frozenset({"b0"}), since_epoch=1, inner_steps=10)]


def _paced(rounds: OuterRounds, now: float, node: str, round_: int, step_s: float, steps: int = 10, **kw):
    group = 0 if node.startswith("a") else 1
    return rounds.arrive(now, round_=round_, node=node, group=group, tokens=100 * steps, inner_step=0, groups=PACED,
                         deadline_s=DEADLINE, epoch=1, h=10, step_seconds=step_s, round_steps=steps, **kw)


def test_a_round_decision_fixes_each_groups_inner_steps_and_a_restart_keeps_them(tmp_path: Path) -> None:
    """The plan gave both groups H=10, but lab-b measures 0.111 s a step against lab-a's 0.1: the decision of round 3
    gives lab-b the 9 steps that fit in round 5 (rounds of 10 x 0.1 s). A coordinator restarted on its store answers
    round 3 with the same figures, and decides round 4 from them: lab-b's next figure (9.75 steps fit) is within
    the hysteresis of 9, so it keeps 9, where a coordinator that had forgotten them would start again from the
    plan's 10 (which fits as well) and keep 10. The OuterSync reply carries the figures to every node. (Figures taken
    as exact: `prior_noise` 0; with the default a single 11% difference is within a round's noise.)"""
    exact = PaceOptions(prior_noise=0.0)
    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=0.0)
    rounds.pace_options = exact
    for n, s in (("a0", 0.1), ("a1", 0.1), ("b0", 0.111)):
        d = _paced(rounds, 1.0, n, 3, s)
    assert d.decided and d.steps_round == 5
    assert [(g.name, g.steps) for g in d.inner_steps] == [("lab-a", 10), ("lab-b", 9)]
    assert d.target_s == pytest.approx(1.0) and d.round_s == pytest.approx(1.0)
    store.close()  # killed

    store = SqliteStore(tmp_path / "state.db")
    rounds = OuterRounds(store, now=50.0)
    rounds.pace_options = exact
    again = rounds.arrive(50.0, round_=3, node="", group=0, tokens=0, inner_step=0, groups=PACED, deadline_s=DEADLINE,
                          h=10)
    assert again.decided and again.steps_round == 5
    assert [(g.name, g.steps) for g in again.inner_steps] == [("lab-a", 10), ("lab-b", 9)]
    for n, s in (("a0", 0.1), ("a1", 0.1), ("b0", 1 / 9.75)):
        d = _paced(rounds, 51.0, n, 4, s, steps=10 if n.startswith("a") else 9)
    assert d.decided and d.steps_round == 6
    assert [(g.name, g.steps) for g in d.inner_steps] == [("lab-a", 10), ("lab-b", 9)], d.reason
    forgetful = OuterRounds(now=51.0)
    forgetful.pace_options = exact
    for n, s in (("a0", 0.1), ("a1", 0.1), ("b0", 1 / 9.75)):
        fresh = _paced(forgetful, 51.0, n, 4, s, steps=10 if n.startswith("a") else 9)
    assert [g.steps for g in fresh.inner_steps] == [10, 10]
    store.close()

    # through the handler: the reply names each group's steps and the round they are for
    state = _outer_state()  # H=5, lab-a and lab-b
    reply = None
    for node, group, s in (("a0", 0, 0.1), ("b0", 1, 0.25)):
        reply = h.handle_outer_sync(pb.OuterSyncRequest(
            job_id=state.job.id, node_id=node, plan_epoch=1, round=0, group=group, arrived=True, tokens=10,
            step_seconds=s, round_steps=5), state)
    assert reply is not None and reply.decided and reply.steps_round == 2
    assert [(g.group, g.inner_steps) for g in reply.inner_steps] == [("lab-a", 5), ("lab-b", 2)]
    assert [g.step_seconds for g in reply.inner_steps] == pytest.approx([0.1, 0.25])


def test_the_outer_deadline_follows_the_live_round() -> None:
    """The plan's deadline is 10 s, but the groups' rounds run 30 s at their live pace (3 s steps): a round then waits
    up to two of them for a late group instead of leaving it out of every round after 10 s."""
    rounds = OuterRounds()
    for n in ("a0", "a1", "b0"):
        _paced(rounds, 0.0, n, 0, 3.0)
    assert rounds.round_s == pytest.approx(30.0)
    for n in ("a0", "a1"):
        d = _paced(rounds, 100.0, n, 1, 3.0)
    assert not d.decided and d.wait_seconds == pytest.approx(60.0)
    assert not _paced(rounds, 100.0 + DEADLINE + 1, "a0", 1, 3.0).decided  # past the plan's 10 s, within 60
    d = _paced(rounds, 161.0, "a0", 1, 3.0)
    assert d.decided and [p.group for p in d.participants] == [0]


def test_a_held_question_is_answered_as_the_decision_changes() -> None:
    """A long poll (`OuterSyncRequest.hold_seconds`): a node's question is held while the round stays undecided and
    answered as soon as the last group arrives, then, once the node holds the decision's contributions, held again
    until the decision is final; a decision the node does not hold yet is answered at once, a question whose answer
    does not change when the hold ends, and past `MAX_HOLDERS` held at once, at once."""
    import threading
    import time

    from atoll.coordinator import outer as outer_mod

    rounds = OuterRounds()

    def ask():
        return rounds.arrive(1.0, round_=3, node="", group=0, tokens=0, inner_step=0, groups=GROUPS,
                             deadline_s=DEADLINE, epoch=1)

    first = _arrive(rounds, 1.0, "a0")
    _arrive(rounds, 1.0, "a1")
    assert not first.decided
    timer = threading.Timer(0.2, lambda: _arrive(rounds, 1.0, "b0"))
    timer.start()
    t0 = time.monotonic()
    d, held = rounds.hold(ask, first, 30.0)  # capped at MAX_HOLD_S
    took = time.monotonic() - t0
    timer.join()
    assert held and d.decided and not d.final, d.reason
    assert 0.15 <= took < outer_mod.MAX_HOLD_S, took  # answered at b0's arrival, not at the hold's end
    # held again: final once every node reports holding the contributions
    for n in ("a0", "a1"):
        _arrive(rounds, 1.0, n, fetched_version=1)
    timer = threading.Timer(0.2, lambda: _arrive(rounds, 1.0, "b0", fetched_version=1))
    timer.start()
    assert rounds.hold(ask, d, 30.0) == (d, False)  # a decision the node does not hold yet: at once
    d2, held = rounds.hold(ask, d, 30.0, known=1)
    timer.join()
    assert held and d2.final
    # nothing changes: answered when the hold ends, the same answer
    t0 = time.monotonic()
    again, held = rounds.hold(lambda: rounds.arrive(1.0, round_=4, node="", group=0, tokens=0, inner_step=0,
                                                    groups=GROUPS, deadline_s=DEADLINE, epoch=1),
                              rounds.arrive(1.0, round_=4, node="a0", group=0, tokens=0, inner_step=0,
                                            groups=GROUPS, deadline_s=DEADLINE, epoch=1), 0.3)
    assert held and not again.decided and 0.25 <= time.monotonic() - t0 < 3 * 0.3 + 1.0
    # a final answer, no hold asked for, or too many holders: at once
    assert rounds.hold(ask, d2, 1.0) == (d2, False)
    assert rounds.hold(ask, first, 0.0) == (first, False)
    rounds._holders = outer_mod.MAX_HOLDERS
    assert rounds.hold(ask, first, 1.0) == (first, False)


def test_the_outer_sync_handler_holds_a_question_it_is_asked_to() -> None:
    """Over the handler: `hold_seconds` is validated, and a held answer says so (`held`), so the node asks again
    without a pause."""
    import time

    from atoll.coordinator.errors import InvalidArgument

    state = _outer_state()

    def request(**kw) -> pb.OuterSyncRequest:
        return pb.OuterSyncRequest(job_id=state.job.id, node_id="a0", plan_epoch=1, round=2, group=0, arrived=True,
                                   tokens=10, **kw)

    t0 = time.monotonic()
    reply = h.handle_outer_sync(request(hold_seconds=0.3), state)
    assert reply.held and not reply.decided and time.monotonic() - t0 >= 0.25
    assert not h.handle_outer_sync(request(), state).held
    with pytest.raises(InvalidArgument, match="hold_seconds"):
        h.handle_outer_sync(request(hold_seconds=-1.0), state)


def test_the_writer_of_a_rounds_checkpoint_is_a_group_that_ran_through_it() -> None:
    """The decision of round r + 1 names the writer of round r's checkpoint: the newest plan's first group that took
    part in both rounds (one that rejoined since, with a new since-epoch, holds no checkpoint of round r), else the
    first that takes part."""
    groups = [GroupInfo(index=0, name="lab-b", since_epoch=5, nodes=frozenset({"b0"}), inner_steps=10),
              GroupInfo(index=1, name="lab-a", since_epoch=1, nodes=frozenset({"a0"}), inner_steps=10)]
    now = [Participant(group=0, tokens=10, since_epoch=5, nodes=("b0",)),
           Participant(group=1, tokens=10, since_epoch=1, nodes=("a0",))]
    rejoined_since = [Participant(group=0, tokens=10, since_epoch=1, nodes=("b0",)), now[1]]
    assert writer_of(now, groups).nodes == ("b0",)
    assert writer_of(now, groups, rejoined_since).nodes == ("a0",)
    assert writer_of(now, groups, now).nodes == ("b0",)
    assert writer_of(now, groups, [Participant(group=3, tokens=1, since_epoch=9, nodes=("c0",))]).nodes == ("b0",)
