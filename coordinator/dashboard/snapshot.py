"""What the dashboard shows, as one JSON-ready document built from the coordinator's state.

`Snapshots.take(now)` reads the state the way `atoll status` does (`atoll.coordinator.handlers.handle_status`),
but aggregates by region and island instead of listing every member, so the document stays small at 10,000
members; one island's nodes (`island_nodes`) and one node (`node_page`) are read from the newest snapshot on
demand. The costly reads are spaced out: the links (tens of thousands at that size, sorted under the store's
lock) every `LINKS_EVERY_S`, the islands every `ISLANDS_EVERY_S`. Everything here is plain Python: no grpc,
no aiohttp, so it is tested without a server.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from atoll.coordinator import job_control
from atoll.coordinator.calibration import predicted_compute
from atoll.coordinator.checkpoints import complete_steps
from atoll.coordinator.dashboard.events import EventLog
from atoll.coordinator.progress import summarize
from atoll.coordinator.store import MemberRecord
from atoll.plan import Plan

LINKS_EVERY_S = 10.0
"""Seconds between reads of the measured links."""
ISLANDS_EVERY_S = 2.0
"""Seconds between reads of the islands."""
CHECKPOINTS_EVERY_S = 5.0
"""Seconds between reads of the checkpoint reports."""
STATUS_WINDOW_STEPS = 8
RECENT_STEPS = 256
MAX_RECENT_STEPS = 50_000
"""Most step reports one snapshot reads (a plan of 5,000 nodes' last window of steps)."""
MAX_LINK_ROWS = 400
"""Most per-link rows (codec, bytes) the plan view lists."""
MAX_NODE_LINKS = 64


def _finite(x: float | None, digits: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


def block_seconds(m: MemberRecord) -> float:
    """A node's profiled forward + backward seconds of one transformer block (0: not profiled): its speed."""
    t = [x.forward_seconds + x.backward_seconds for x in m.profile.layer_timings if x.layer_kind == "block"]
    return min(t) if t else 0.0


@dataclass
class _Cache:
    links_at: float = -math.inf
    region_links: list[dict] = field(default_factory=list)
    island_links: list[dict] = field(default_factory=list)
    node_links: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    islands_at: float = -math.inf
    islands: list = field(default_factory=list)
    checkpoints_at: float = -math.inf
    checkpoints: list = field(default_factory=list)
    complete: list[int] = field(default_factory=list)
    progress: Any = None
    progress_epoch: int = -1
    progress_next: float = -math.inf


class Snapshots:
    """Builds the dashboard's documents from one coordinator's state (not thread-safe: one builder thread)."""

    def __init__(self, state, events: EventLog | None = None) -> None:
        self.state = state
        self.events = events if events is not None else EventLog()
        self._cache = _Cache()
        self.members: dict[str, MemberRecord] = {}
        """The members as the newest snapshot read them."""
        self.island_of: dict[str, str] = {}
        self.stage_of: dict[str, str] = {}
        self.usage: dict[str, dict] = {}
        self._members_key: tuple | None = None
        self._map_doc: dict[str, Any] = {}
        self.doc: dict[str, Any] = {}
        """The newest snapshot."""

    # --- reads, spaced out ---------------------------------------------------------------------------------

    def _links(self, now: float) -> None:
        c = self._cache
        if now - c.links_at < LINKS_EVERY_S:
            return
        c.links_at = now
        links = self.state.store.links_view()
        region = {n: m.profile.region or "-" for n, m in self.members.items()}
        by_region: dict[tuple[str, str], list[float]] = {}
        by_island: dict[tuple[str, str], list[float]] = {}
        nodes: dict[str, list[tuple[str, float]]] = {}
        for x in links:
            if x.flows > 1:  # a machine probe's share of a flow, not the link's own figure
                continue
            ra, rb = region.get(x.src), region.get(x.dst)
            if ra is not None and rb is not None and ra != rb:
                by_region.setdefault((min(ra, rb), max(ra, rb)), []).append(x.bandwidth_bytes_per_s)
            ia, ib = self.island_of.get(x.src), self.island_of.get(x.dst)
            if ia and ib and ia != ib:
                by_island.setdefault((min(ia, ib), max(ia, ib)), []).append(x.bandwidth_bytes_per_s)
            for a, b in ((x.src, x.dst), (x.dst, x.src)):
                row = nodes.setdefault(a, [])
                if len(row) < MAX_NODE_LINKS:
                    row.append((b, x.bandwidth_bytes_per_s))
        c.region_links = [{"a": a, "b": b, "bandwidth": statistics.median(v), "links": len(v)}
                          for (a, b), v in sorted(by_region.items())]
        c.island_links = [{"a": a, "b": b, "bandwidth": statistics.median(v), "links": len(v)}
                          for (a, b), v in sorted(by_island.items())]
        c.node_links = nodes

    def _islands(self, now: float) -> list:
        c = self._cache
        if now - c.islands_at >= ISLANDS_EVERY_S:
            c.islands_at = now
            islands = self.state.store.get_islands()
            if islands != c.islands:  # the same islands keep their object: readers key on it
                c.islands = islands
        return c.islands

    def _progress(self, now: float, plan: Plan | None):
        """The recent steps' summary, as `atoll status` makes it; read again after 20 times what the last read
        took (at least every snapshot's period), so thousands of reporting nodes cost at most about 5% of a core."""
        c = self._cache
        epoch = plan.epoch if plan is not None else 0
        if c.progress is not None and now < c.progress_next and c.progress_epoch == epoch:
            return c.progress
        started = time.monotonic()
        rows = max(RECENT_STEPS, len(plan.node_addresses) * (STATUS_WINDOW_STEPS + 1)) if plan is not None \
            else RECENT_STEPS
        c.progress = summarize(self.state.store.recent_steps(min(rows, MAX_RECENT_STEPS)), epoch,
                               window=STATUS_WINDOW_STEPS)
        c.progress_epoch = epoch
        c.progress_next = now + 20 * (time.monotonic() - started)
        return c.progress

    def _checkpoints(self, now: float) -> tuple[list, list[int]]:
        c = self._cache
        if now - c.checkpoints_at >= CHECKPOINTS_EVERY_S:
            c.checkpoints_at = now
            records = self.state.store.list_checkpoints()
            plans = {}
            for e in {r.plan_epoch for r in records}:
                p = self.state.plan_of(e)
                if p is not None:
                    plans[e] = p
            c.checkpoints, c.complete = records, complete_steps(records, plans)
        return c.checkpoints, c.complete

    # --- the document ----------------------------------------------------------------------------------------

    def take(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        mono = time.monotonic()
        state = self.state
        plan: Plan | None = state.current_plan()
        islands = self._islands(mono)
        # the members are read again (and aggregated) only when the membership, the islands or the plan moved:
        # at 10,000 members that is most of a snapshot's cost, and heartbeats change none of it
        key = (state.members_version, id(islands), plan.epoch if plan is not None else 0)
        if key != self._members_key:
            self.members = dict(state.store.members_view())
            self.island_of = {n: i.id for i in islands for n in i.nodes}
            self._map_doc = self._map(self.members, islands, plan)
            self.events.observe_members(now, self.members)
            self._members_key = key
        progress = self._progress(mono, plan)
        checkpoints, complete = self._checkpoints(mono)
        self._links(mono)
        self.stage_of = {}
        if plan is not None:
            for pi, p in enumerate(plan.pipelines):
                for si, st in enumerate(p.stages):
                    for n in st.nodes:
                        self.stage_of[n] = f"pipeline {pi} stage {si}"
        self.usage = {u.node_id: {"pipeline": u.pipeline, "stage": u.stage, "step_seconds": u.step_seconds,
                                  "compute_seconds": u.compute_seconds, "wait_seconds": u.wait_seconds,
                                  "utilisation": u.utilisation, "peak_memory_bytes": u.peak_memory_bytes}
                      for u in progress.stages}
        target = state.target_steps
        step = progress.step
        eta = None
        if progress.measured_step_seconds > 0 and target and job_control.job_state(state.control) != "finished":
            eta = max(0, target - 1 - step) * progress.measured_step_seconds
        doc: dict[str, Any] = {
            "time": now,
            "job": {
                "name": state.job.name, "id": state.job.id, "run_id": state.run_id,
                "state": job_control.job_state(state.control), "step": step, "target_steps": target,
                "loss": _finite(progress.loss), "loss_step": progress.loss_step,
                "tokens_per_second": progress.tokens_per_second, "eta_seconds": eta,
                "measured_step_seconds": progress.measured_step_seconds,
                "predicted_step_seconds": plan.predicted.step_time_s if plan is not None else 0.0,
                "epoch": plan.epoch if plan is not None else 0, "mode": plan.mode if plan is not None else "",
                "waiting": state.waiting_reason, "last_checkpoint_step": complete[-1] if complete else 0,
            },
            "map": {**self._map_doc, "region_links": self._cache.region_links,
                    "island_links": self._cache.island_links},
            "plan": self._plan(plan, progress),
            "outer": self._outer(plan),
            "history_key": None,
        }
        hist = state.store.history(1)
        doc["history_key"] = f"{hist[-1].first}:{hist[-1].last}:{hist[-1].count}:{hist[-1].val_count}" \
            if hist else ""
        self.events.observe_progress(now, state.failures(), complete, checkpoints, state.offences.summary())
        doc["events"] = self.events.recent()
        self.doc = doc
        return doc

    def _map(self, members: dict[str, MemberRecord], islands: list, plan: Plan | None) -> dict[str, Any]:
        planned = set(plan.node_addresses) if plan is not None else set()
        states = Counter(m.state for m in members.values())
        regions: dict[str, dict] = {}
        island_rows: dict[str, dict] = {}
        for i in islands:
            island_rows[i.id] = {"id": i.id, "region": i.group or "-", "device": i.device, "gpus": i.gpus,
                                 "inner_bandwidth": i.inner_bandwidth, "outer_bandwidth": i.outer_bandwidth,
                                 "members": 0, "states": {}, "devices": {}, "planned": 0}
        for n, m in members.items():
            iid = self.island_of.get(n) or f"(no island) {m.profile.region or '-'}"
            row = island_rows.get(iid)
            if row is None:
                row = island_rows[iid] = {"id": iid, "region": m.profile.region or "-", "device": "", "gpus": 0,
                                          "inner_bandwidth": 0.0, "outer_bandwidth": 0.0, "members": 0,
                                          "states": {}, "devices": {}, "planned": 0, "unformed": True}
            row["members"] += 1
            row["states"][m.state] = row["states"].get(m.state, 0) + 1
            dev = f"{m.profile.device_name or m.profile.device_kind} x{m.profile.device_count}"
            row["devices"][dev] = row["devices"].get(dev, 0) + 1
            row["planned"] += n in planned
        for row in island_rows.values():
            r = regions.setdefault(row["region"], {"name": row["region"], "members": 0, "alive": 0, "islands": [],
                                                   "devices": 0})
            r["members"] += row["members"]
            r["alive"] += row["states"].get("alive", 0)
            r["devices"] += row["gpus"]
            r["islands"].append(row)
        for r in regions.values():
            r["islands"].sort(key=lambda x: x["id"])
        return {"members": len(members), "states": dict(states), "islands": len(islands),
                "devices": sum(i.gpus for i in islands), "regions": [regions[k] for k in sorted(regions)],
                "region_links": self._cache.region_links, "island_links": self._cache.island_links}

    def _plan(self, plan: Plan | None, progress) -> dict[str, Any] | None:
        if plan is None:
            return None
        expected = predicted_compute(plan)
        measured: dict[tuple[int, int], list] = {}
        for u in progress.stages:
            measured.setdefault((u.pipeline, u.stage), []).append(u)
        group_of = {k: g.name for g in plan.groups for k in g.pipelines} if plan.mode == "outer" else {}
        pipelines = []
        for pi, p in enumerate(plan.pipelines):
            stages = []
            for si, st in enumerate(p.stages):
                us = measured.get((pi, si), [])
                pred = [expected[n] for n in st.nodes if expected.get(n, 0) > 0]
                stages.append({
                    "index": si, "island": st.island, "layers": list(st.layers), "dp": st.dp, "tp": st.tp,
                    "lanes": st.lanes, "nodes": len(st.nodes), "node_ids": st.nodes[:32],
                    "codec": st.send.codec if st.send is not None else "",
                    "send_seconds": st.send.seconds if st.send is not None else 0.0,
                    "memory_gb_per_device": st.memory_gb_per_device,
                    "predicted_compute_seconds": max(pred) if pred else 0.0,
                    "measured_compute_seconds": max((u.compute_seconds for u in us), default=0.0),
                    "measured_step_seconds": max((u.step_seconds for u in us), default=0.0),
                    "wait_seconds": max((u.wait_seconds for u in us), default=0.0),
                    "utilisation": statistics.mean(u.utilisation for u in us) if us else 0.0,
                })
            pipelines.append({"index": pi, "micro_batch": p.micro_batch, "micro_batches": p.num_micro_batches,
                              "group": group_of.get(pi, ""), "stages": stages})
        links = [{"src": x.src, "dst": x.dst, "direction": x.direction, "pipeline": x.pipeline, "stage": x.stage,
                  "codec": x.codec, "bytes_raw": x.bytes_raw, "bytes_wire": x.bytes_wire,
                  "achieved_bytes_per_s": x.achieved_bytes_per_s} for x in progress.links[:MAX_LINK_ROWS]]
        return {"epoch": plan.epoch, "mode": plan.mode, "mode_reason": plan.mode_reason, "model": plan.model,
                "global_batch": plan.global_batch, "seq_len": plan.seq_len,
                "predicted_step_seconds": plan.predicted.step_time_s,
                "predicted_tokens_per_second": plan.predicted.tokens_per_s, "bottleneck": plan.predicted.bottleneck,
                "resume_step": plan.resume_step, "pipelines": pipelines, "links": links,
                "idle": [{"island": i.island, "gpus": i.gpus, "reason": i.reason, "nodes": i.nodes[:32]}
                         for i in plan.idle],
                "relays": [{"a": r.a, "b": r.b, "via": r.via, "bandwidth": r.bandwidth_bytes_per_s}
                           for r in plan.relays]}

    def _outer(self, plan: Plan | None) -> dict[str, Any] | None:
        if plan is None or plan.mode != "outer" or plan.outer is None:
            return None
        outer = self.state.outer
        names = [g.name for g in plan.groups]
        tokens_per_step = plan.global_batch * plan.seq_len
        progress = dict(outer.progress)
        groups = []
        for name in names + sorted(set(progress) - set(names)):
            g = progress.get(name)
            if g is None:
                groups.append({"name": name, "planned": True, "rounds": []})
                continue
            waits = dict(g.round_waits)
            rounds = [{"round": r, "inner_steps": t / tokens_per_step if tokens_per_step else 0,
                       "wait_seconds": waits.get(r, 0.0)} for r, t in sorted(dict(g.round_tokens).items())[-16:]]
            groups.append({"name": name, "planned": name in names, "inner_step": g.inner_step, "round": g.round,
                           "rounds_in": g.rounds_in, "rounds_missed": g.rounds_missed, "tokens": g.tokens,
                           "sync_bytes": float(sum(list(g.sync_bytes.values()))),
                           "sync_seconds": max(list(g.sync_seconds.values()), default=0.0),
                           "steps_per_round": g.steps_per_round(tokens_per_step),
                           "wait_per_round": g.wait_per_round(), "step_seconds": g.step_s, "rounds": rounds})
        decisions = []
        for r, d in outer.recent_decisions(16).items():
            included = {p.group for p in d.participants}
            decisions.append({"round": r, "groups_in": sorted(names[i] for i in included if i < len(names)),
                              "left_out": sorted(n for i, n in enumerate(names) if i not in included),
                              "wait_seconds": d.wait_seconds, "reason": d.reason})
        o = plan.outer
        return {"inner_steps": o.inner_steps, "codec": o.codec, "deadline_seconds": o.deadline_s,
                "bytes_per_round": o.bytes_per_round, "sync_seconds": o.sync_s, "round_seconds": o.round_s,
                "groups": groups, "decisions": decisions, "exclusions": outer.exclusions,
                "last_exclusion": outer.last_exclusion}

    # --- on demand ---------------------------------------------------------------------------------------------

    def node_row(self, n: str, m: MemberRecord, now: float) -> dict[str, Any]:
        p = m.profile
        return {"id": n, "state": m.state, "region": p.region or "-", "island": self.island_of.get(n, ""),
                "device": p.device_name or p.device_kind, "device_kind": p.device_kind, "devices": p.device_count,
                "block_ms": round(1000 * block_seconds(m), 3), "speed_factor": self.state.speed.get(n, 1.0),
                "heartbeat_age": round(max(0.0, now - m.last_heartbeat_unix), 1), "step": m.step,
                "stage": self.stage_of.get(n, ""), "reason": m.reason, "peer_address": m.peer_address}

    def island_nodes(self, island: str, now: float | None = None) -> list[dict[str, Any]] | None:
        """The rows of one island's nodes (its id as the map names it), None when no such island."""
        now = time.time() if now is None else now
        members = self.state.store.members_view()  # read now: the heartbeats' ages are live
        rows = [self.node_row(n, m, now) for n, m in members.items()
                if (self.island_of.get(n) or f"(no island) {m.profile.region or '-'}") == island]
        known = any(r["id"] == island for reg in self.doc.get("map", {}).get("regions", []) for r in reg["islands"])
        return sorted(rows, key=lambda r: r["id"]) if rows or known else None

    def node_page(self, node_id: str, now: float | None = None) -> dict[str, Any] | None:
        now = time.time() if now is None else now
        m = self.state.store.members_view().get(node_id)
        if m is None:
            return None
        p = m.profile
        row = self.node_row(node_id, m, now)
        row.update({"hostname": p.hostname, "memory_total_bytes": p.memory_total_bytes, "cpu_count": p.cpu_count,
                    "torch_version": p.torch_version, "atoll_version": p.atoll_version,
                    "joined_unix": m.joined_unix, "plan_epoch": m.plan_epoch, "unreachable": p.unreachable,
                    "layer_timings": [{"kind": t.layer_kind, "micro_batch": t.micro_batch, "seq_len": t.seq_len,
                                       "forward_seconds": t.forward_seconds, "backward_seconds": t.backward_seconds}
                                      for t in p.layer_timings],
                    "usage": self.usage.get(node_id),
                    "links": [{"peer": b, "bandwidth": bw} for b, bw in self._cache.node_links.get(node_id, [])],
                    "events": [e for e in self.events.recent() if node_id in e["text"]][-50:]})
        return row


def history_doc(points) -> dict[str, Any]:
    """The whole loss history as columns (oldest step first): each row's step, loss (mean, min, max), validation
    loss and tokens/s; null where a row has none."""
    cols: dict[str, list] = {"step": [], "loss": [], "loss_min": [], "loss_max": [], "val_loss": [], "tps": []}
    for p in points:
        cols["step"].append(p.step)
        loss = p.loss
        cols["loss"].append(_finite(loss))
        cols["loss_min"].append(_finite(p.loss_min) if p.count else None)
        cols["loss_max"].append(_finite(p.loss_max) if p.count else None)
        cols["val_loss"].append(_finite(p.val_loss))
        cols["tps"].append(_finite(p.tokens_per_second, 1))
    return cols
