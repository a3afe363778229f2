"""Emulated wide-area latency, a testbed knob: which peers a node holds its tensors back for, and how long.

A testbed on one machine (`bench/geo.py`) shapes the bandwidth between regions with `tc tbf` but cannot
delay packets where the kernel lacks netem. Nodes started there with `--wan-latency-ms N` instead hold
every tensor they send to a peer of another region for N ms before it goes on the wire
(`PeerRef.added_latency`). Off by default; real deployments have real latency and leave it at zero.
"""

from __future__ import annotations

from datetime import timedelta

from atoll.plan import Plan


def wan_delay(plan: Plan, my_node: str, peer_node: str, my_region: str, latency: timedelta) -> timedelta:
    """The one-way delay to add to what `my_node` sends `peer_node` in `plan`.

    `latency` when the peer's region in the plan (`Plan.region_of`) is known and differs from this node's:
    `my_region` (its `--region`), or its own region in the plan when that is empty. Zero otherwise, also
    when either region is unknown: a node without a site label is not taken to be far away.
    """
    if latency <= timedelta(0):
        return timedelta(0)
    mine = my_region or plan.region_of(my_node)
    theirs = plan.region_of(peer_node)
    if not mine or not theirs or mine == theirs:
        return timedelta(0)
    return latency
