"""Robust outer aggregation: a replica group whose pseudo-gradient is an outlier (not finite, or far above the other
groups' norms) is left out of the round by the coordinator's decision, the one every node applies, and named."""

from __future__ import annotations

import math

import pytest

from atoll.coordinator.outer import GroupInfo, OuterRounds, outliers
from atoll.node.outer import RoundReport, RoundStats

GROUPS = [GroupInfo(index=0, name="lab-a", nodes=frozenset({"a0", "a1"}), since_epoch=1),
          GroupInfo(index=1, name="lab-b", nodes=frozenset({"b0"}), since_epoch=1),
          GroupInfo(index=2, name="lab-c", nodes=frozenset({"c0"}), since_epoch=1)]
GROUP_OF = {n: g.index for g in GROUPS for n in g.nodes}


def decide(norms: dict[str, float | None]):
    rounds = OuterRounds()
    d = None
    for i, (node, norm) in enumerate(norms.items()):
        d = rounds.arrive(float(i), round_=0, node=node, group=GROUP_OF[node], tokens=100, inner_step=0,
                          groups=GROUPS, deadline_s=60.0, epoch=1, norm=norm)
    return rounds, d


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e4])
def test_an_outlier_group_is_left_out_of_the_decision_and_named(bad) -> None:
    # lab-a's nodes serve halves of its contribution: its norm is sqrt(3^2 + 4^2) = 5
    rounds, d = decide({"a0": 3.0, "a1": 4.0, "b0": 6.0, "c0": bad})
    assert d is not None and d.decided
    assert [p.group for p in d.participants] == [0, 1]
    assert "lab-c (c0)" in d.reason and "outlier" in d.reason
    assert rounds.exclusions == 1 and "lab-c" in rounds.last_exclusion


def test_honest_groups_of_unequal_pace_all_take_part() -> None:
    # a group that trained five times fewer inner steps has a smaller pseudo-gradient: never an outlier; nor is a
    # group a few times above the median
    rounds, d = decide({"a0": 3.0, "a1": 4.0, "b0": 1.0, "c0": 20.0})
    assert [p.group for p in d.participants] == [0, 1, 2] and rounds.exclusions == 0
    rounds, d = decide({"a0": 3.0, "a1": 4.0, "b0": 5.0, "c0": None})  # an older node reports no norm: not judged
    assert [p.group for p in d.participants] == [0, 1, 2]


def test_a_fast_region_beside_one_slow_region_is_not_an_outlier() -> None:
    # uneven regions, one of them lost: two groups left, the fast one training 10 inner steps a round to the slow
    # one's 1. Its pseudo-gradient is ~11x the other's norm, honestly: judged per token it takes part (compared
    # whole it was left out of every round to the job's end)
    two = GROUPS[:2]
    rounds = OuterRounds()
    d = None
    for i, (node, tokens, norm) in enumerate([("a0", 10_240, 0.6), ("a1", 10_240, 0.8), ("b0", 1_024, 0.09)]):
        d = rounds.arrive(float(i), round_=0, node=node, group=GROUP_OF[node], tokens=tokens, inner_step=0,
                          groups=two, deadline_s=60.0, epoch=1, norm=norm)
    assert d is not None and [p.group for p in d.participants] == [0, 1] and rounds.exclusions == 0
    # per token, a contribution far above the other's is still left out
    assert set(outliers({0: 1.0, 1: 0.09}, tokens={0: 1_024, 1: 10_240})) == {0}
    assert outliers({0: 1.0, 1: 0.09}, tokens={0: 10_240, 1: 1_024}) == {}


def test_the_outlier_rule() -> None:
    assert set(outliers({0: 1.0, 1: 1000.0})) == {1}  # two groups: each judged against the other
    assert outliers({0: 1.0, 1: 9.0}) == {}
    assert set(outliers({0: math.nan, 1: 1.0, 2: 0.0})) == {0}
    assert outliers({0: 5.0, 1: 0.0}) == {}  # no positive median to compare with


def test_a_node_reports_the_norm_of_what_it_serves(monkeypatch) -> None:
    from atoll.node import runner

    sent = []

    def call(req):
        sent.append(req)
        raise_unavailable()

    def raise_unavailable():
        import grpc

        class E(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE
        raise E()

    class P:
        job_id, epoch = "j", 1
        groups = [type("G", (), {"name": "lab-a"})()]

    monkeypatch.setattr(runner, "group_index", lambda plan, node: 0)
    arrive = runner._arrive_via(call, lambda: P(), "a0")
    assert arrive(RoundReport(round=0, tokens=1, previous=RoundStats(), norm=float("nan"))) is None
    assert sent[0].has_contribution_norm and math.isnan(sent[0].contribution_norm)
    arrive(RoundReport(round=0, tokens=1, previous=RoundStats()))
    assert not sent[1].has_contribution_norm


def test_the_checkpoint_writer_is_a_group_that_takes_part() -> None:
    """The plan's first group killed: from the first round decided without it, the next group that takes part writes
    the checkpoints (it named the dead group until a replan, and that interval's checkpoints were lost)."""
    from atoll.coordinator.outer import Participant, redecide

    rounds = OuterRounds()
    d = None
    for i, node in enumerate(["a0", "a1", "b0"]):  # lab-c never arrives: decided at the deadline without it
        d = rounds.arrive(float(i), round_=0, node=node, group=GROUP_OF[node], tokens=100, inner_step=0,
                          groups=GROUPS, deadline_s=60.0, epoch=1, norm=1.0)
    d = rounds.arrive(100.0, round_=0, node="a0", group=0, tokens=100, inner_step=0, groups=GROUPS[::-1],
                      deadline_s=60.0, epoch=1, norm=1.0)  # (a plan whose first group is lab-c)
    assert d.decided and [p.group for p in d.participants] == [0, 1]
    assert d.checkpointer is not None and d.checkpointer.group == 1  # lab-b: the first of the plan's that arrived
    lab_b = next(p for p in d.participants if p.group == 1)
    again = redecide(101.0, d, lab_b, "a0")  # and lab-b's contribution out of reach: lab-a writes
    assert again is not None and again.checkpointer.group == 0 and again.checkpointer.tokens == 0
    assert redecide(101.0, again, Participant(group=1, tokens=0, since_epoch=1, nodes=("b0",)), "a0") is None
