"""Membership decisions with an injected clock: leases, joins, and when to plan."""

from __future__ import annotations

from datetime import timedelta

import pytest

from atoll.coordinator.membership import (MembershipOptions, expire_leases, join_decision, lease_deadline,
                                          plan_decision)
from atoll.coordinator.store import MemberRecord
from atoll.job import ClusterSpec
from atoll.types import NodeProfile

OPTS = MembershipOptions(lease=timedelta(seconds=10), settle=timedelta(seconds=2))


def _m(node_id: str, hb: float, state: str = "alive", host: str = "h1") -> MemberRecord:
    return MemberRecord(node_id=node_id, peer_address="x:1", profile=NodeProfile(hostname=host), state=state,
                        joined_unix=0.0, last_heartbeat_unix=hb)


def test_lease_expires_only_after_the_lease() -> None:
    members = [_m("a", 100.0), _m("b", 95.0), _m("c", 50.0, state="gone")]
    assert expire_leases(104.0, members, started_unix=0.0, options=OPTS) == []
    out = expire_leases(105.5, members, started_unix=0.0, options=OPTS)
    assert [(t.node_id, t.state) for t in out] == [("b", "gone")]
    assert "no heartbeat for 10.5s" in out[0].reason and "lease 10s" in out[0].reason
    assert [t.node_id for t in expire_leases(111.0, members, 0.0, OPTS)] == ["a", "b"]


def test_restart_grace_counts_from_the_coordinator_start() -> None:
    old = [_m("a", 100.0)]
    # the coordinator restarted at 1000: the member's last heartbeat is long past but it gets one lease
    assert expire_leases(1005.0, old, started_unix=1000.0, options=OPTS) == []
    assert [t.node_id for t in expire_leases(1010.5, old, 1000.0, OPTS)] == ["a"]
    short = MembershipOptions(lease=timedelta(seconds=10), restart_grace=timedelta(seconds=3))
    assert lease_deadline(old[0], 1000.0, short) == 1003.0


def test_join_decisions() -> None:
    assert join_decision(0.0, None, hostname="h1", started_unix=0.0, options=OPTS).kind == "new"
    live = _m("a", 100.0, host="h1")
    assert join_decision(101.0, live, hostname="h1", started_unix=0.0, options=OPTS).kind == "update"
    conflict = join_decision(101.0, live, hostname="h2", started_unix=0.0, options=OPTS)
    assert conflict.kind == "conflict" and "h1" in conflict.reason and "--state-dir" in conflict.reason
    assert join_decision(111.0, live, hostname="h2", started_unix=0.0, options=OPTS).kind == "rejoin"
    assert join_decision(101.0, _m("a", 100.0, state="gone"), hostname="h2", started_unix=0.0,
                         options=OPTS).kind == "rejoin"


CLUSTER = ClusterSpec(expected_nodes=3, min_nodes=2)


def test_first_plan_waits_for_expected_nodes_and_probes() -> None:
    d = plan_decision(10.0, alive={"a", "b"}, planned=None, unprobed=set(), last_change_unix=0.0,
                      cluster=CLUSTER, options=OPTS)
    assert not d.plan and "2 of 3" in d.reason
    d = plan_decision(10.0, alive={"a", "b", "c"}, planned=None, unprobed={"c"}, last_change_unix=0.0,
                      cluster=CLUSTER, options=OPTS)
    assert not d.plan and "probes of c" in d.reason
    d = plan_decision(10.0, alive={"a", "b", "c"}, planned=None, unprobed=set(), last_change_unix=9.9,
                      cluster=CLUSTER, options=OPTS)
    assert d.plan


def test_replan_on_change_after_settling() -> None:
    planned = {"a", "b", "c"}
    assert not plan_decision(50.0, alive=planned, planned=planned, unprobed=set(), last_change_unix=0.0,
                             cluster=CLUSTER, options=OPTS).plan
    d = plan_decision(50.0, alive={"a", "b"}, planned=planned, unprobed=set(), last_change_unix=49.0,
                      cluster=CLUSTER, options=OPTS)
    assert not d.plan and "settling" in d.reason
    d = plan_decision(51.5, alive={"a", "b"}, planned=planned, unprobed=set(), last_change_unix=49.0,
                      cluster=CLUSTER, options=OPTS)
    assert d.plan and d.reason == "gone: c"
    d = plan_decision(60.0, alive={"a", "b", "c", "d"}, planned=planned, unprobed={"d"}, last_change_unix=0.0,
                      cluster=CLUSTER, options=OPTS)
    assert not d.plan and "probes of d" in d.reason
    d = plan_decision(60.0, alive={"a", "b", "d"}, planned=planned, unprobed=set(), last_change_unix=0.0,
                      cluster=CLUSTER, options=OPTS)
    assert d.plan and d.reason == "joined: d; gone: c"
    d = plan_decision(60.0, alive={"a"}, planned=planned, unprobed=set(), last_change_unix=0.0,
                      cluster=CLUSTER, options=OPTS)
    assert not d.plan and "min_nodes" in d.reason


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="lease must be positive"):
        MembershipOptions(lease=timedelta(0))
    with pytest.raises(ValueError, match="settle"):
        MembershipOptions(settle=timedelta(seconds=-1))


def test_a_stale_plan_is_replaced_once_its_members_are_back() -> None:
    from atoll.coordinator.membership import MembershipOptions, plan_decision
    from atoll.job import ClusterSpec

    kw = dict(unprobed=set(), last_change_unix=0.0, cluster=ClusterSpec(expected_nodes=2),
              options=MembershipOptions())
    assert not plan_decision(10.0, alive={"a", "b"}, planned={"a", "b"}, **kw).plan
    d = plan_decision(10.0, alive={"a", "b"}, planned={"a", "b"}, stale=True, **kw)
    assert d.plan and "restarted" in d.reason


def test_members_back_at_new_addresses_get_a_new_plan_after_settling() -> None:
    from atoll.coordinator.membership import MembershipOptions, plan_decision
    from atoll.job import ClusterSpec

    kw = dict(alive={"a", "b"}, planned={"a", "b"}, unprobed=set(), cluster=ClusterSpec(expected_nodes=2),
              options=MembershipOptions(), moved={"b"})
    assert not plan_decision(10.5, last_change_unix=10.0, **kw).plan  # settling
    d = plan_decision(12.0, last_change_unix=10.0, **kw)
    assert d.plan and "new peer addresses: b" in d.reason


def test_a_lease_lapses_later_by_what_the_coordinator_itself_ran_late() -> None:
    members = [_m("a", 100.0)]
    assert [t.node_id for t in expire_leases(111.0, members, 0.0, OPTS)] == ["a"]
    # the coordinator's loop ran 3 s late within the lease: a heartbeat may have waited that long in its queue
    assert expire_leases(111.0, members, 0.0, OPTS, stalled=3.0) == []
    out = expire_leases(113.5, members, 0.0, OPTS, stalled=3.0)
    assert [t.node_id for t in out] == ["a"] and "ran late" in out[0].reason
