"""A node's place in a plan: row shares, neighbours with their row slices, batch rows and groups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.node.placement import Neighbour, PlacementError, place, shares
from atoll.plan import PipelinePlan, Plan, StagePlan


def _stage(layers, nodes):
    return StagePlan(island="i", layers=layers, dp=len(nodes), nodes=list(nodes))


def _plan(*pipelines: PipelinePlan, batch: int = 16) -> Plan:
    return Plan(model="tiny", global_batch=batch, seq_len=64, pipelines=list(pipelines))


def test_shares_are_consecutive_and_as_even_as_possible() -> None:
    assert shares(4, 1) == [(0, 4)]
    assert shares(4, 2) == [(0, 2), (2, 4)]
    assert shares(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert shares(7, 7) == [(i, i + 1) for i in range(7)]
    with pytest.raises(ValueError, match="cannot share"):
        shares(2, 3)


def test_equal_widths_keep_replica_r_to_replica_r_and_consecutive_rows() -> None:
    plan = _plan(PipelinePlan(micro_batch=8, num_micro_batches=2,
                              stages=[_stage((0, 3), ["a", "b"]), _stage((3, 6), ["c", "d"])]))
    p = place(plan, "d", 6)
    assert (p.stage, p.replica, p.rows, p.replica_micro_batch, p.micro_rows) == (1, 1, (8, 16), 4, (4, 8))
    assert p.upstream == (Neighbour("b", (4, 8)),) and p.downstream == ()
    assert p.batch_order() is None and p.blocks == ((4, 8),)
    assert [s.holders for s in p.segments] == [("c", "d")]
    assert p.pipeline_nodes == ("a", "b", "c", "d") and p.loss_group == ("c", "d")
    assert not p.counts_norm and place(plan, "c", 6).counts_norm
    assert place(plan, "zz", 6) is None


def test_two_replicas_then_one() -> None:
    plan = _plan(PipelinePlan(micro_batch=4, num_micro_batches=4,
                              stages=[_stage((0, 3), ["a", "b"]), _stage((3, 6), ["c"])]))
    a, b, c = (place(plan, n, 6) for n in "abc")
    assert a.downstream == b.downstream == (Neighbour("c", (0, 4)),)
    assert c.upstream == (Neighbour("a", (0, 2)), Neighbour("b", (2, 4)))
    assert (a.rows, b.rows, c.rows) == ((0, 8), (8, 16), (0, 16))
    assert a.batch_order() is None
    # c's micro-batch i is a's micro-batch i (rows 2i, 2i + 1) followed by b's (rows 8 + 2i, 9 + 2i)
    assert c.batch_order() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert c.loss_group == ("c",) and c.pipeline_nodes == ("a", "b", "c")


def test_uneven_shares_overlap_two_senders() -> None:
    plan = _plan(PipelinePlan(micro_batch=8, num_micro_batches=2,
                              stages=[_stage((0, 3), ["a", "b"]), _stage((3, 6), ["c", "d", "e"])]))
    d = place(plan, "d", 6)
    assert d.micro_rows == (3, 6) and d.rows == (6, 12)
    assert d.upstream == (Neighbour("a", (0, 4)), Neighbour("b", (4, 8)))
    assert place(plan, "a", 6).downstream == (Neighbour("c", (0, 3)), Neighbour("d", (3, 6)))
    assert place(plan, "e", 6).upstream == (Neighbour("b", (4, 8)),)
    assert d.blocks == ((3, 4), (4, 6))


def _micro_batches(plan: Plan, pipe: int, stage: int) -> list[list[int]]:
    """The global rows of each micro-batch as the replicas of one stage see it, in row order (a laned replica
    fills the micro-batches of its lane only)."""
    pipeline = plan.pipelines[pipe]
    out: list[list[int]] = [[] for _ in range(pipeline.num_micro_batches)]
    for node in pipeline.stages[stage].nodes:
        p = place(plan, node, 6)
        rows = list(range(*p.rows))
        order = p.batch_order()
        rows = [rows[k] for k in order] if order is not None else rows
        n = p.replica_micro_batch
        assert len(rows) == p.trained_rows == n * len(p.micro_batch_ids)
        for j, i in enumerate(p.micro_batch_ids):
            out[i].extend(rows[j * n:(j + 1) * n])
    return out


@settings(max_examples=60, deadline=None)
@given(widths=st.lists(st.integers(1, 4), min_size=1, max_size=4), micro=st.integers(4, 9),
       m=st.integers(1, 3), offset=st.integers(0, 1))
def test_every_stage_sees_the_same_rows_in_each_micro_batch(widths, micro, m, offset) -> None:
    """Whatever the widths, a micro-batch is the same rows of the global batch at every stage (so the first
    stage's inputs and the last stage's targets agree), and every row of the pipeline is trained once."""
    names = iter(f"n{k}" for k in range(100))
    layers = [(k, k + 1) for k in range(len(widths) - 1)] + [(len(widths) - 1, 6)]
    first = PipelinePlan(micro_batch=1, num_micro_batches=offset, stages=[_stage((0, 6), ["x"])])
    pipe = PipelinePlan(micro_batch=micro, num_micro_batches=m,
                        stages=[_stage(a, [next(names) for _ in range(w)]) for a, w in zip(layers, widths)])
    plan = _plan(*([first] if offset else []), pipe, batch=offset + micro * m)
    p = 1 if offset else 0
    views = [_micro_batches(plan, p, s) for s in range(len(widths))]
    assert all(v == views[0] for v in views)
    assert sorted(r for mb in views[0] for r in mb) == list(range(offset, offset + micro * m))
    for s in range(len(widths)):  # each replica's neighbours carry exactly its rows, in order
        for node in pipe.stages[s].nodes:
            pl = place(plan, node, 6)
            for side in (pl.upstream, pl.downstream):
                if side:
                    cut = [(max(pl.micro_rows[0], x.rows[0]), min(pl.micro_rows[1], x.rows[1])) for x in side]
                    assert cut[0][0] == pl.micro_rows[0] and cut[-1][1] == pl.micro_rows[1]
                    assert all(u[1] == v[0] for u, v in zip(cut, cut[1:]))


def test_plans_the_runtime_cannot_run_are_refused_with_the_reason() -> None:
    with pytest.raises(PlacementError, match="cannot share a micro-batch of 2"):
        place(_plan(PipelinePlan(micro_batch=2, num_micro_batches=8,
                                 stages=[_stage((0, 3), ["a", "b", "c"]), _stage((3, 6), ["d"])])), "a", 6)
    with pytest.raises(PlacementError, match="node a is listed in pipeline 0 stage 0 and again"):
        place(_plan(PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[_stage((0, 3), ["a"]), _stage((3, 6), ["a"])])), "a", 6)
    bad = _stage((3, 6), ["c", "d"])
    bad.dp = 3
    with pytest.raises(PlacementError, match=r"dp = 3\b.*but 2"):
        place(_plan(PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[_stage((0, 3), ["a"]), bad])), "a", 6)
    with pytest.raises(PlacementError, match="lists no nodes"):
        place(_plan(PipelinePlan(micro_batch=4, num_micro_batches=4,
                                 stages=[_stage((0, 3), ["a"]), StagePlan(island="i", layers=(3, 6))])), "a", 6)
    with pytest.raises(PlacementError, match="train 12 sequences per step, the global batch is 16"):
        place(_plan(PipelinePlan(micro_batch=4, num_micro_batches=3, stages=[_stage((0, 6), ["a"])])), "a", 6)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=4),
       micro=st.integers(3, 6), rounds=st.integers(1, 2))
def test_lanes_train_every_row_once_and_meet_the_right_lane(shape, micro, rounds) -> None:
    """Stages of `lanes` lanes of `width` replicas each (shape: (width, lanes) per stage): micro-batch i is the
    same rows at every stage, trained at each stage by lane i % lanes alone, every row of the batch once; a
    replica's neighbours for micro-batch i are the replicas of the neighbour stage's lane i % lanes whose rows
    overlap its own, covering them."""
    import math
    names = iter(f"n{k}" for k in range(100))
    m = rounds * math.lcm(*(lanes for _, lanes in shape))
    layers = [(k, k + 1) for k in range(len(shape) - 1)] + [(len(shape) - 1, 6)]
    stages = [StagePlan(island="i", layers=a, dp=w * lanes, lanes=lanes, nodes=[next(names) for _ in range(w * lanes)])
              for a, (w, lanes) in zip(layers, shape)]
    plan = _plan(PipelinePlan(micro_batch=micro, num_micro_batches=m, stages=stages), batch=micro * m)
    views = [_micro_batches(plan, 0, s) for s in range(len(shape))]
    assert all(v == views[0] for v in views)
    assert sorted(r for mb in views[0] for r in mb) == list(range(micro * m))
    for s, stage in enumerate(stages):
        d = stage.dp // stage.lanes
        for r, node in enumerate(stage.nodes):
            pl = place(plan, node, 6)
            assert (pl.lane, pl.lanes) == (r // d, stage.lanes)
            for k, side, by_lane in ((s - 1, pl.upstream, pl.upstream_lanes), (s + 1, pl.downstream, pl.downstream_lanes)):
                if not 0 <= k < len(stages):
                    assert side == () and by_lane == ()
                    continue
                other = stages[k]
                od = other.dp // other.lanes
                for i in pl.micro_batch_ids:
                    used = by_lane[i % len(by_lane)] if by_lane else side
                    lane_nodes = other.nodes[(i % other.lanes) * od:(i % other.lanes + 1) * od]
                    assert used and all(x.node_id in lane_nodes for x in used)
                    cut = [(max(pl.micro_rows[0], x.rows[0]), min(pl.micro_rows[1], x.rows[1])) for x in used]
                    assert cut[0][0] == pl.micro_rows[0] and cut[-1][1] == pl.micro_rows[1]
                    assert all(u[1] == v[0] for u, v in zip(cut, cut[1:]))


def test_laned_plans_the_runtime_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="divide dp"):
        StagePlan(island="i", layers=(0, 6), dp=3, lanes=2)
    bad = _plan(PipelinePlan(micro_batch=4, num_micro_batches=3, stages=[
        StagePlan(island="i", layers=(0, 6), dp=2, lanes=2, nodes=["a", "b"])]), batch=12)
    with pytest.raises(ValueError, match="must divide the pipeline's 3 micro-batches"):
        place(bad, "a", 6)
    wide = _plan(PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
        StagePlan(island="i", layers=(0, 6), dp=6, lanes=2, nodes=list("abcdef"))]), batch=8)
    with pytest.raises(PlacementError, match="3 replicas in each of its 2 lanes cannot share a micro-batch of 2"):
        place(wide, "a", 6)
    ok = _plan(PipelinePlan(micro_batch=2, num_micro_batches=4, stages=[
        StagePlan(island="i", layers=(0, 6), dp=4, lanes=2, nodes=list("abcd"))]), batch=8)
    assert place(ok, "c", 6).micro_batch_ids == range(1, 4, 2)


def test_a_replica_group_continues_through_a_replan_only_with_the_same_lanes() -> None:
    """Outer mode: a replan that keeps a group's nodes, cuts and batch keeps it training, unless a stage's lanes
    change (its replicas would train other micro-batches)."""
    import copy

    from atoll.node.placement import group_continues
    from atoll.plan import OuterPlan, ReplicaGroup

    def plan(lanes: int) -> Plan:
        p = _plan(PipelinePlan(micro_batch=4, num_micro_batches=4, stages=[
            _stage((0, 3), ["a"]), StagePlan(island="i", layers=(3, 6), dp=2, lanes=lanes, nodes=["b", "c"])]))
        p.mode, p.rendezvous = "outer", "10.0.0.1:29400"
        p.groups = [ReplicaGroup(name="eu", pipelines=[0], inner_steps=4, since_epoch=2)]
        p.outer = OuterPlan(inner_steps=4)
        return p

    old = plan(1)
    assert group_continues(old, copy.deepcopy(old), "b")
    assert not group_continues(old, plan(2), "b")
