"""`atoll status`: fetch a coordinator's StatusReply and print it as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from atoll.coordinator.calibration import predicted_compute, spread
from atoll.coordinator.history import draw_history, from_proto, sparkline
from atoll.job import resolve_token
from atoll.argtypes import MAX_SECONDS
from atoll.plan import resume_words
from atoll.serde import plan_from_proto
from atoll.rpc import RpcOptions, make_channel
from atoll.tls import bootstrap_rpc, find_ca
from atoll.v1 import atoll_pb2 as pb
from atoll.v1 import atoll_pb2_grpc as pb_grpc
from atoll.units import duration


def fetch_status(address: str, *, token: str | None, timeout: timedelta = timedelta(seconds=10),
                 rpc: RpcOptions | None = None, history_points: int = 0,
                 say: Callable[[str], None] | None = None) -> pb.StatusReply:
    """Ask the coordinator at `address` (with at most `history_points` points of the loss history; 0: enough
    for a sparkline); raises ConnectionError / PermissionError with what to do. `say` hears why, when nothing
    answers at once and the call waits (`atoll.netcheck.call_coordinator`)."""
    from atoll.netcheck import call_coordinator
    from atoll.preflight import check_dial_address

    check_dial_address(address, "--coordinator")  # a malformed address is said at once, not after the timeout
    channel = make_channel(address, rpc, token=token)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        # a coordinator that is (re)starting gets the whole timeout to come up; one that refuses this client is
        # said at once
        return call_coordinator(lambda seconds, ready: stub.GetStatus(
            pb.StatusRequest(history_points=history_points), timeout=seconds, wait_for_ready=ready),
            address, timeout, rpc, say)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise PermissionError(f"{address}: {e.details()}") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            from atoll.netcheck import unanswered

            raise unanswered(address, code.name, timeout, rpc) from None
        raise ConnectionError(f"{address}: {code.name}: {e.details()}") from None
    finally:
        channel.close()


def _rate(bps: float) -> str:
    if bps <= 0:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} B/s"


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _seconds(x: float) -> str:
    if x <= 0:
        return "-"
    return duration(x)


def _codec(codec: int) -> str:
    return pb.Codec.Name(codec).removeprefix("CODEC_").lower()


def _predicted_compute(s: pb.StatusReply) -> dict[str, float]:
    """Per node, the compute seconds per step its plan predicted (`calibration.predicted_compute`); {} without
    a plan or one that cannot be read."""
    if not s.HasField("plan") or not s.plan.pipelines:
        return {}
    try:
        return predicted_compute(plan_from_proto(s.plan))
    except (ValueError, KeyError, TypeError):
        return {}


def _progress_lines(s: pb.StatusReply) -> list[str]:
    predicted = s.plan.predicted.step_time_seconds if s.HasField("plan") else 0.0
    measured = s.measured_step_seconds
    line = (f"step time: measured {_seconds(measured)}"
            + (f" (median of {s.measured_steps} steps)" if measured > 0 else "")
            + f", predicted {_seconds(predicted)}")
    if measured > 0 and predicted > 0:
        line += f"; measured / predicted {measured / predicted:.2f}"
    out = [line]
    if s.stage_usage:
        out.append("\nstages (means per step over the recent steps; OTHER-S: all-reduce, optimizer, checkpoints; "
                   "PEAK-MEMORY: the highest measured, MEMORY-BYTES-PER-DEVICE: the plan's prediction):")
        planned = {(p.index, st.index): st.memory_bytes_per_device for p in s.plan.pipelines for st in p.stages}
        expected = _predicted_compute(s)
        rows = [["PIPELINE", "STAGE", "NODE-ID", "STEPS", "STEP-S", "COMPUTE-S", "COMPUTE-VS-PLAN", "WAIT-S", "OTHER-S",
                 "PEAK-MEMORY", "MEMORY-BYTES-PER-DEVICE", "UTILISATION"]]
        worst: tuple[float, str] | None = None
        speed: list[float] = []
        for u in s.stage_usage:
            vs = u.compute_seconds / expected[u.node_id] if expected.get(u.node_id, 0) > 0 and u.compute_seconds > 0 \
                else 0.0
            if vs > 0:
                speed.append(vs)
            other = u.step_seconds - u.compute_seconds - u.wait_seconds
            plan_bytes = planned.get((u.pipeline, u.stage), 0.0)
            if u.peak_memory_bytes and plan_bytes > 0:
                ratio = u.peak_memory_bytes / plan_bytes
                if worst is None or ratio > worst[0]:
                    worst = (ratio, f"pipeline {u.pipeline} stage {u.stage}, node {u.node_id}")
            rows.append([str(u.pipeline), str(u.stage), u.node_id, str(u.steps), _seconds(u.step_seconds),
                         _seconds(u.compute_seconds), f"{vs:.2f}x" if vs > 0 else "-", _seconds(u.wait_seconds),
                         _seconds(other),
                         _bytes(u.peak_memory_bytes) if u.peak_memory_bytes else "-",
                         _bytes(plan_bytes) if plan_bytes > 0 else "-", f"{100 * u.utilisation:.0f}%"])
        if worst is not None:
            out.insert(1, f"peak memory: measured / predicted up to {worst[0]:.2f} ({worst[1]})")
        if speed:
            out.insert(1, f"compute: measured / predicted {spread(speed, '')} per node (COMPUTE-VS-PLAN; a replan "
                          "starts from these speeds)")
        out += _table(rows)
    if s.link_usage:
        out.append("\nlinks (means per step over the recent steps; SECONDS: time on the wire; ESTIMATE: the sender's "
                   "bandwidth estimate):")
        rows = [["PIPELINE", "STAGE", "SRC", "DST", "DIRECTION", "CODEC", "BYTES-RAW", "BYTES-WIRE", "RATIO",
                 "SECONDS", "ACHIEVED", "ESTIMATE"]]
        for x in s.link_usage:
            ratio = f"{x.bytes_raw / x.bytes_wire:.2f}x" if x.bytes_wire > 0 else "-"
            rows.append([str(x.pipeline), str(x.stage), x.src, x.dst,
                         pb.Direction.Name(x.direction).removeprefix("DIRECTION_").lower(), _codec(x.codec),
                         _bytes(x.bytes_raw), _bytes(x.bytes_wire), ratio, _seconds(x.seconds),
                         _rate(x.achieved_bytes_per_s), _rate(x.estimate_bytes_per_s)])
        out += _table(rows)
    return out


def _step_headline(s: pb.StatusReply) -> str:
    """`step N`; in outer mode, where replica groups step at their own pace, the range from the slowest group's
    step to the fastest's (the newest report alone is the fastest group's)."""
    # a group yet to report a step has none; one the plan no longer lists trains no more
    steps = [g.inner_step for g in s.group_usage if g.tokens and g.planned]
    if s.HasField("plan") and s.plan.mode == "outer" and len(steps) > 1 and min(steps) != max(steps):
        return f"step {min(steps)}-{max(steps)} (slowest-fastest of {len(steps)} groups training)"
    return f"step {s.step}"


def _outer_lines(s: pb.StatusReply) -> list[str]:
    """Outer mode: how the replica groups sync, and each group's rounds."""
    p = s.plan
    o = p.outer
    codec = _codec(o.codec).removesuffix("_block")
    if o.codec in (pb.CODEC_TOPK, pb.CODEC_SPARSE2):
        codec += f" {o.codec_params.topk_fraction:.3g}"
    optimizer = f"lr {o.lr:g}" + (f" momentum {o.momentum:g}{' nesterov' if o.nesterov else ''}" if o.momentum
                                  else "")
    out = [f"\nouter mode: {len(p.groups)} replica groups, H={o.inner_steps}, {codec} pseudo-gradients, {optimizer}, "
           f"{'overlapped' if o.overlap else 'blocking'}, deadline {o.deadline_seconds:g} s; predicted sync "
           f"{duration(o.sync_seconds)} per round vs {duration(o.round_seconds)} of compute"]
    target = max((g.round_target_seconds for g in s.group_usage), default=0.0)
    if target > 0:
        out.append(f"rounds by wall-clock time: a target of {duration(target)} a round (H steps of the fastest group at "
                   f"its live pace); each group trains the steps that fit at its own")
    if s.group_usage:
        out.append("groups, by name (STEPS/ROUND and WAIT/ROUND: means over its newest rounds, WAIT of its slowest node; "
                   "NEXT: the inner steps a round the newest decision gives it, from its live STEP-S; "
                   "SHARE: of the tokens the rounds counted; SYNC: the newest exchange, bytes summed over the group's "
                   "nodes, seconds of its slowest; GROUP -: no longer planned):")
        rows = [["GROUP", "NAME", "INNER-STEP", "STEPS/ROUND", "NEXT", "STEP-S", "WAIT/ROUND", "SHARE", "TOKENS",
                 "ROUND", "IN/MISSED", "SYNC-BYTES", "SYNC-S", "LATE-S"]]
        for g in s.group_usage:
            rows.append([str(g.group) if g.planned else "-", g.name, str(g.inner_step),
                         f"{g.steps_per_round:.1f}" if g.steps_per_round > 0 else "-",
                         str(g.assigned_steps) if g.assigned_steps else "-", _seconds(g.step_seconds),
                         _seconds(g.wait_seconds_per_round),
                         f"{g.token_share:.0%}" if g.tokens else "-", f"{g.tokens:,}", str(g.round),
                         f"{g.rounds_in}/{g.rounds_missed}", _bytes(g.sync_bytes) if g.sync_bytes > 0 else "-",
                         _seconds(g.sync_seconds), _seconds(g.late_seconds)])
        out += _table(rows)
    return out


def _anchor_lines(s: pb.StatusReply) -> list[str]:
    """Outer mode: whether the nodes' anchor hashes have agreed at every round (they must)."""
    if not s.anchor_mismatches:
        return ["anchors: every node's hashes agree at every round reported"]
    return [f"ANCHOR MISMATCH: {s.anchor_mismatches} (round, layer)s whose anchors differ between nodes; the newest: "
            f"{s.anchor_mismatch}"]


def _offender_lines(s: pb.StatusReply) -> list[str]:
    """Nodes whose tensors their neighbours rejected (named), quarantined ones with the reason; outer-mode groups
    left out of a round for an outlier pseudo-gradient."""
    out = []
    for o in s.offenders:
        if o.quarantined:
            out.append(f"QUARANTINED {o.node_id}: {o.reason} (let it back: atoll job release {o.node_id})")
        else:
            out.append(f"rejected tensors from {o.node_id}: {o.offences} step(s) recently; the newest: {o.newest}")
    if s.outer_exclusions:
        out.append(f"outer rounds: {s.outer_exclusions} group contribution(s) left out as outliers; the newest: "
                   f"{s.outer_exclusion}")
    out += [f"UNDER-REPLICATED {line}" for line in s.under_replicated]  # a writer's full disk
    out += [f"network fit: {line}" for line in s.network_fit]  # measured transfers against the plan's model
    return out


PLOT_POINTS = 1_000_000
"""History points `--plot` asks for: every row the coordinator's store holds."""


def history_lines(s: pb.StatusReply, width: int = 60) -> list[str]:
    """The loss history as a sparkline (and the validation loss's, when reported), with the steps it spans
    and how the coordinator holds it."""
    points = list(s.history)
    losses = [p for p in points if p.count]
    if not losses:
        return []
    first, last = points[0].first_step, max(p.last_step for p in points)
    out = [f"loss history {sparkline([p.loss for p in losses], width)}  {losses[0].loss:.3f} -> {losses[-1].loss:.3f} "
           f"(min {min(p.loss_min for p in losses):.3f}), steps {first}-{last}"]
    vals = [p for p in points if p.has_val_loss]
    if vals:
        out.append(f"val loss     {sparkline([p.val_loss for p in vals], width)}  {vals[0].val_loss:.3f} -> "
                   f"{vals[-1].val_loss:.3f} ({len(vals)} points)")
    out.append(f"  held as {s.history_resolution}; `atoll status --plot FILE.png` draws it whole")
    return out + _precision_lines(s)


def _precision_lines(s: pb.StatusReply) -> list[str]:
    """fp16: the latest loss scale and the steps skipped for an overflow among the recent reports."""
    scaled = [r for r in s.recent_steps if r.loss_scale > 0]
    if not scaled:
        return []
    latest = max(scaled, key=lambda r: r.step)
    steps = {r.step for r in scaled}
    skipped = sorted({r.step for r in scaled if r.skipped})
    which = f" (step {', '.join(map(str, skipped[-5:]))})" if skipped else ""
    return [f"fp16 loss scale {latest.loss_scale:g} at step {latest.step}; {len(skipped)} of the last {len(steps)} "
            f"steps skipped for an overflow{which}"]


def plot_history(s: pb.StatusReply, path: str | Path) -> Path:
    """Draw the reply's whole history (fetched with `history_points=PLOT_POINTS`) as a PNG at `path`."""
    rows = [from_proto(p) for p in s.history]
    if not any(r.count or r.val_count for r in rows):
        raise ValueError(f"job {s.job.name} has no loss reported yet: nothing to plot; try again once steps run")
    name = s.job.name or "job"
    return draw_history(rows, path, title=f"{name}: loss per step ({s.history_resolution})")


def _job_state_lines(s: pb.StatusReply) -> list[str]:
    """Whether the job runs, is stopping or has finished (and when), with the step it ends at."""
    if s.job_state == "finished":
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(s.finished_unix))
        how = (f"stopped (atoll job stop) after step {s.target_steps - 1}: {s.target_steps} steps trained"
               if s.stopped_unix else f"finished: all {s.target_steps} steps trained")
        out = [f"{how}, at {when}; the nodes have left (the coordinator serves this status until it is stopped)"]
        if s.final_checkpoint_step and s.last_checkpoint_step < s.final_checkpoint_step:
            newest = f"step-{s.last_checkpoint_step:08d}" if s.last_checkpoint_step else "none"
            out.append(f"WITHOUT ITS FINAL CHECKPOINT (step-{s.final_checkpoint_step:08d}): the newest complete one "
                       f"held is {newest}; resume or export from that")
        return out
    if s.job_state == "stopping":
        return [f"stopping (atoll job stop): the job ends after step {s.target_steps - 1}, with a checkpoint"]
    return [f"running: ends after step {s.target_steps - 1}"] if s.target_steps else []


def format_status(s: pb.StatusReply, now: float | None = None) -> str:
    """The reply as tables: the job's progress first, then members, islands and the plan.

    A column's header is its field's name in the JSON (`status_json`) in capitals, `-` for `_`, with the unit
    left off where the cell shows one (`_bytes_per_s`, `_bytes`, `_unix`) and `_seconds` written `-S`:
    PEER-ADDRESS is `peer_address`, INNER-BANDWIDTH `inner_bandwidth_bytes_per_s`, STEP-S `step_seconds`.
    Exceptions: DEVICES is an island's `gpus` (its devices, GPUs or CPUs), PROFILE the member's
    `profile.device_kind`, `device_count` and `device_name`, REGION a member's `profile.region` and an island's
    `group` (its region), PLANNED-CODEC a stage's `send.codec` (what the plan chose for its boundary; the links
    table shows what each link sends now, as adaptive compression measures it); RATIO and OTHER-S are derived, and so is
    COMPUTE-VS-PLAN (a node's `compute_seconds` over what the plan's stage predicted for its rows).
    """
    now = time.time() if now is None else now
    loss = f"loss {s.loss:.4f} (step {s.loss_step})   " if s.has_loss else ""
    run = f", run {s.job.run_id}" if s.job.run_id else ""
    out = [f"job {s.job.name} ({s.job.job_id}{run})   plan epoch {s.plan.epoch if s.HasField('plan') else 0}   "
           f"{_step_headline(s)}   {loss}{s.tokens_per_second:,.0f} tokens/s   last checkpoint "
           # a step by its index, as the logs name it; a checkpoint by the steps it follows, as its folder does
           + (f"step-{s.last_checkpoint_step:08d} (after step {s.last_checkpoint_step - 1})"
              if s.last_checkpoint_step else "-")]
    out += _job_state_lines(s)
    if s.newest_backup_path:
        out.append(f"newest backup of the store: {s.newest_backup_path} (taken "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.newest_backup_unix))}, "
                   f"{duration(max(0.0, now - s.newest_backup_unix))} ago)")
    out += history_lines(s)
    out += _progress_lines(s)
    if s.HasField("plan") and s.plan.mode == "outer":
        out += _outer_lines(s)
        out += _anchor_lines(s)
    out += _offender_lines(s)
    alive = sum(1 for m in s.members if m.state == "alive")
    out.append(f"\nmembers: {alive} alive of {len(s.members)}")
    if s.members:
        rows = [["NODE-ID", "STATE", "REGION", "PROFILE", "MEMORY-TOTAL", "PEER-ADDRESS", "LAST-HEARTBEAT"]]
        for m in s.members:
            p = m.profile
            rows.append([m.node_id, m.state, p.region or "-", f"{p.device_kind} x{p.device_count} {p.device_name}"[:48],
                         _bytes(p.memory_total_bytes),
                         # a node behind NAT: its neighbours send over the streams it opens
                         f"{m.peer_address or '-'} (dials out)" if p.unreachable else m.peer_address,
                         f"{max(0.0, now - m.last_heartbeat_unix):.1f}s ago"])
        out += _table(rows)
    out.append(f"\nislands: {len(s.islands)}")
    if s.islands:
        rows = [["ID", "REGION", "DEVICE-NAME", "DEVICES", "INNER-BANDWIDTH", "OUTER-BANDWIDTH", "NODE-IDS"]]
        for i in s.islands:
            rows.append([i.id, i.group or "-", i.device_name[:32], str(i.gpus), _rate(i.inner_bandwidth_bytes_per_s),
                         _rate(i.outer_bandwidth_bytes_per_s), ", ".join(i.node_ids)])
        out += _table(rows)
    if s.HasField("plan"):
        p = s.plan
        pred = p.predicted
        out.append(f"\nplan epoch {p.epoch}: {p.model}, global batch {p.global_batch}, seq {p.seq_len}, "
                   f"{resume_words(p.resume_step, p.reached_step, not p.checkpoint_resume)}; predicted {duration(pred.step_time_seconds)} a step, "
                   f"{pred.tokens_per_second:.0f} tokens/s" + (f", bottleneck: {pred.bottleneck}" if pred.bottleneck
                                                               else ""))
        if p.mode != "outer" and p.mode_reason:  # (outer mode's reason is in the outer lines above)
            out.append(f"  {p.mode_reason}")
        group_of = {k: g.name for g in p.groups for k in g.pipelines} if p.mode == "outer" else {}
        for pl in p.pipelines:
            owner = f", replica group {group_of[pl.index]}" if pl.index in group_of else ""
            out.append(f"  pipeline {pl.index}: micro-batch {pl.micro_batch} x {pl.num_micro_batches}{owner}")
            rows = [["STAGE", "ISLAND", "LAYERS", "DP", "NODE-IDS", "PLANNED-CODEC", "DP-RENDEZVOUS"]]
            for st in pl.stages:
                send = _codec(st.send.codec) if st.HasField("send") else "-"
                rows.append([str(st.index), st.island, f"[{st.layer_start}, {st.layer_end})",
                             str(st.dp) + (f" ({st.lanes} lanes)" if st.lanes > 1 else ""),
                             ", ".join(st.node_ids), send, st.dp_rendezvous])
            out += _table(rows, "    ")
        for r in p.relays:  # two neighbours that both accept no connections
            out.append(f"  {r.a} <-> {r.b} relayed by {r.via} ({_rate(r.bandwidth_bytes_per_s)}, the slower leg)")
    else:
        out.append("\nno plan yet" + (f": {s.waiting}" if s.waiting else ""))
    return "\n".join(out)


def status_json(s: pb.StatusReply, indent: int | None = 2) -> str:
    """The reply as JSON for scripts: the StatusReply fields (protos/atoll/v1/atoll.proto) by their proto names,
    every field present (a zero is written, not left out) and 64-bit integers as numbers, not strings."""
    try:
        doc = MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
                            unquote_int64_if_possible=True)
    except TypeError:  # a protobuf without unquote_int64_if_possible: its 64-bit integers stay strings
        doc = MessageToDict(s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return json.dumps(doc, indent=indent, sort_keys=True)


CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen


def watch(fetch: Callable[[], pb.StatusReply], render: Callable[[pb.StatusReply], str], *, interval: float,
          out: TextIO, clear: bool, title: Callable[[], str] | None = None,
          unanswered: Callable[[str], str] = lambda why: f"no answer: {why}",
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Print `render(fetch())` every `interval` seconds until Ctrl-C (KeyboardInterrupt propagates).

    With `clear` each one replaces the last on the screen; else they follow one another. A coordinator that
    does not answer is said so (`unanswered`) and asked again at the next interval.
    """
    while True:
        started = time.monotonic()
        try:
            text = render(fetch())
        except ConnectionError as e:
            text = unanswered(str(e))
        out.write((CLEAR_SCREEN if clear else "") + (f"{title()}\n" if title else "") + text + "\n")
        out.flush()
        sleep(max(0.0, interval - (time.monotonic() - started)))


def run_status_cli(args: argparse.Namespace) -> int:
    """`atoll status`. With --json every outcome is JSON on stdout, a failure as {"error": ...} with exit code 2."""
    if not args.json:
        return _run_status(args)
    try:
        return _run_status(args)
    except (ValueError, OverflowError, OSError) as e:  # what `atoll` prints as one line, as JSON here
        print(json.dumps({"error": str(e)}), flush=True)
        return 2


def _to_stderr(line: str) -> None:
    print(f"atoll: {line}", file=sys.stderr, flush=True)


def _run_status(args: argparse.Namespace) -> int:
    if args.watch is not None and not 0 < args.watch <= MAX_SECONDS:  # NaN fails too
        raise ValueError(f"--watch takes a positive number of seconds, got {args.watch:g}")
    if not 0 < args.timeout <= MAX_SECONDS:
        raise ValueError(f"--timeout takes a positive number of seconds, got {args.timeout:g}")
    token = resolve_token(args.token, args.token_file)
    rpc = None
    if not getattr(args, "insecure", False):
        if not token:
            raise ValueError("atoll status needs the job token: --token-file or $ATOLL_TOKEN")
        rpc = bootstrap_rpc(token, find_ca(args.tls_ca, args.token_file).read_bytes())

    def fetch() -> pb.StatusReply:
        return fetch_status(args.coordinator, token=token, timeout=timedelta(seconds=args.timeout), rpc=rpc,
                            say=None if args.json else _to_stderr)  # --json: stdout only, for scripts

    if getattr(args, "plot", None):
        if args.watch is not None:
            raise ValueError("--plot writes one picture; leave out --watch")
        reply = fetch_status(args.coordinator, token=token, timeout=timedelta(seconds=args.timeout), rpc=rpc,
                             history_points=PLOT_POINTS, say=None if args.json else _to_stderr)
        path = plot_history(reply, args.plot)
        print(json.dumps({"plot": str(path), "history_resolution": reply.history_resolution}) if args.json else
              f"loss curve of job {reply.job.name} written to {path} ({reply.history_resolution})")
        return 0

    if args.watch is None:
        reply = fetch()
        print(status_json(reply) if args.json else format_status(reply))
        return 0

    def title() -> str:
        return (f"atoll status {args.coordinator} at {time.strftime('%H:%M:%S')}, every {args.watch:g} s "
                f"(Ctrl-C stops)\n")

    try:
        if args.json:  # one JSON document per line
            watch(fetch, lambda s: status_json(s, indent=None), interval=args.watch, out=sys.stdout,
                  clear=False, unanswered=lambda why: json.dumps({"error": why}))
        else:
            watch(fetch, format_status, interval=args.watch, out=sys.stdout, clear=sys.stdout.isatty(), title=title)
    except KeyboardInterrupt:  # the way a watch ends
        print()
    return 0
