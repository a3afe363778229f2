"""The dashboard's snapshot, event log, tokens and server in one process (its browser tests: test_dashboard_browser)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from atoll.coordinator import handlers as h
from atoll.coordinator.dashboard.access import ViewerToken, may_view
from atoll.coordinator.dashboard.events import EventLog, kind_of
from atoll.coordinator.dashboard.snapshot import Snapshots
from atoll.coordinator.errors import Unauthenticated
from atoll.coordinator.service import CoordinatorService, ServiceConfig
from atoll.coordinator.state import CoordinatorState
from atoll.coordinator.store import CheckpointRecord, MemberRecord, MemoryStore
from atoll.job import JobSpec
from atoll.plan import IslandInfo
from atoll.types import LayerTiming, NodeProfile
from atoll.v1 import atoll_pb2 as pb

REPO = Path(__file__).resolve().parent.parent


def _job() -> JobSpec:
    return JobSpec.load(REPO / "examples" / "tiny.toml")


def _member(i: int, region: str, state: str = "alive", now: float = 1000.0) -> MemberRecord:
    timings = [LayerTiming(layer_kind="block", micro_batch=4, seq_len=64, forward_seconds=0.001 * (i + 1),
                           backward_seconds=0.002 * (i + 1))]
    return MemberRecord(node_id=f"n{i}", peer_address=f"127.0.0.1:{5000 + i}", state=state, joined_unix=now,
                        last_heartbeat_unix=now, profile=NodeProfile(device_kind="cuda", device_name="H100",
                                                                     region=region, layer_timings=timings))


def test_snapshot_counts_members_by_region_and_island() -> None:
    store = MemoryStore()
    state = CoordinatorState(store=store, job=_job(), token="t", clock=lambda: 1000.0)
    for i, (region, st) in enumerate([("a", "alive"), ("a", "alive"), ("a", "gone"), ("b", "alive"), ("b", "left")]):
        store.put_member(_member(i, region, st))
    store.put_islands([IslandInfo(id="a-0", group="a", device="H100", nodes=["n0", "n1", "n2"], gpus=2),
                       IslandInfo(id="b-0", group="b", device="H100", nodes=["n3"], gpus=1)])
    snap = Snapshots(state)
    doc = snap.take(now=1001.0)
    m = doc["map"]
    assert (m["members"], m["states"]) == (5, {"alive": 3, "gone": 1, "left": 1})
    assert [r["name"] for r in m["regions"]] == ["a", "b"]
    a, b = m["regions"]
    assert [i["id"] for i in a["islands"]] == ["a-0"] and a["islands"][0]["states"] == {"alive": 2, "gone": 1}
    # n4 left and is in no island: it is counted under its region, not dropped
    assert sorted(i["id"] for i in b["islands"]) == ["(no island) b", "b-0"]
    rows = snap.island_nodes("a-0", now=1003.0)
    assert [r["id"] for r in rows] == ["n0", "n1", "n2"]
    assert rows[1]["block_ms"] == pytest.approx(6.0) and rows[0]["heartbeat_age"] == pytest.approx(3.0)
    assert snap.island_nodes("nowhere") is None
    page = snap.node_page("n3", now=1001.0)
    assert page["island"] == "b-0" and page["layer_timings"][0]["kind"] == "block"
    json.dumps(doc, allow_nan=False)  # what the server sends must be plain JSON


def test_events_from_changes_between_snapshots() -> None:
    log = EventLog(clock=lambda: 5.0)
    members = {f"n{i}": _member(i, "a") for i in range(3)}
    log.observe(1.0, members, {}, [], [], {})
    assert [e["kind"] for e in log.recent()] == ["info"]  # the first look: what is there, in one line
    members["n1"] = _member(1, "a", "gone")
    members["n1"].reason = "no heartbeat for 10.0s"
    members["n9"] = _member(9, "b")
    ckpts = [CheckpointRecord(step=25, plan_epoch=1, node_id=n, layer_start=0, layer_end=4) for n in ("n0", "n2")]
    log.observe(2.0, members, {}, [25], ckpts, {"n2": (1, "non-finite activations")})
    got = [(e["kind"], e["text"]) for e in log.recent()[1:]]
    assert ("failure", "node n1 is gone (missed its lease): no heartbeat for 10.0s") in got
    assert ("join", "node n9 joined (H100, b)") in got
    assert ("checkpoint", "checkpoint step-00000025 complete, held by 2 node(s): n0, n2") in got
    assert any(k == "quarantine" and "n2" in t for k, t in got)
    log.note_tick(["plan epoch 3 (drift: n1 1.6x slower; ...): a[0, 4)x2", "plan epoch 4 (node joined; ...)",
                   "node n0 is gone: no heartbeat for 5.1s"])
    assert [e["kind"] for e in log.recent()[-3:]] == ["drift", "replan", "failure"]
    members["n0"] = _member(0, "a", "gone")
    log.observe(3.0, members, {}, [25], ckpts, {"n2": (1, "non-finite activations")})
    assert len([e for e in log.recent() if "n0 is gone" in e["text"]]) == 1  # the loop said it: not twice
    assert kind_of("node x is quarantined: 3 steps") == "quarantine"


def test_viewer_token_opens_the_dashboard_only(tmp_path: Path) -> None:
    viewer = ViewerToken(tmp_path)
    assert viewer.current == "" and not may_view("anything", "job-token", viewer)
    made = viewer.get_or_create()
    assert (tmp_path / "viewer-token").read_text().strip() == made
    assert ViewerToken(tmp_path).current == made  # kept over a restart
    assert may_view(made, "job-token", viewer) and may_view("job-token", "job-token", viewer)
    assert not may_view("", "job-token", viewer) and not may_view(None, "job-token", viewer)
    # handed out by ControlJob to a job-token holder; the gRPC service does not take it as a job token
    state = CoordinatorState(store=MemoryStore(), job=_job(), token="job-token")
    state.viewer_token = viewer.get_or_create
    assert h.handle_control_job(pb.JobControlRequest(action="viewer-token"), state).viewer_token == made
    with pytest.raises(Unauthenticated):
        h.check_token(made, state)


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_exposed_dashboard_serves_https_with_the_coordinators_certificate(tmp_path: Path) -> None:
    # 127.0.0.2 is loopback to Linux but not to the coordinator's check: it counts as exposed
    config = ServiceConfig(state_dir=tmp_path, mutual_tls=True, dashboard_port=0, dashboard_host="127.0.0.2",
                           backup_every=None)
    with CoordinatorService(job=_job(), token="job-token", config=config) as svc:
        url = svc.dashboard.url
        assert url.startswith("https://127.0.0.2:")
        ctx = ssl.create_default_context(cafile=str(svc.authority.ca_path))
        ctx.check_hostname = False  # the certificate names the coordinator's host, not this test's address
        assert _get(url + "api/snapshot", context=ctx)[0] == 401
        status, body = _get(url + "api/snapshot", "job-token", ctx)
        assert status == 200 and json.loads(body)["job"]["name"] == "tiny"
        viewer = svc.state.viewer_token()
        assert _get(url + "api/snapshot", viewer, ctx)[0] == 200
        assert _get(url + "api/snapshot", viewer + "x", ctx)[0] == 401


def test_loopback_dashboard_is_plain_http_behind_its_token() -> None:
    with CoordinatorService(job=_job(), token="job-token", config=ServiceConfig(dashboard_port=0)) as svc:
        url = svc.dashboard.url
        assert url.startswith("http://127.0.0.1:")
        status, page = _get(url)
        assert status == 401 and b'name="token"' in page  # the sign-in form, no data
        assert _get(url + "api/history")[0] == 401
        assert _get(url + "api/node/n1")[0] == 401
        status, page = _get(url, "job-token")
        assert status == 200 and b"/static/app.js" in page
        assert _get(url + "static/app.js")[0] == 200  # the code alone, no data: open to anyone
        assert _get(url + "static/../service.py")[0] == 404


def test_bench_script_parses_its_arguments() -> None:
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the bench tree is not installed
    from bench.dashboard import parse_args

    args = parse_args([])
    assert (args.nodes, args.browsers, args.job_screenshots) == ("1000,10000", 10, None)
    args = parse_args(["--nodes", "200", "--browsers", "2", "--window", "3", "--job-screenshots", "docs"])
    assert (args.nodes, args.browsers, args.window, args.job_screenshots) == ("200", 2, 3.0, "docs")


def test_coordinator_flags_serve_no_dashboard_unless_asked() -> None:
    from atoll.launch.cli import build_parser

    base = ["coordinator", "--job", "examples/tiny.toml"]
    args = build_parser().parse_args(base)
    assert (args.dashboard_port, args.dashboard_host) == (None, "127.0.0.1")
    assert ServiceConfig().dashboard_port is None and ServiceConfig().dashboard_host == "127.0.0.1"
    args = build_parser().parse_args(base + ["--dashboard-port", "0", "--dashboard-host", "0.0.0.0"])
    assert (args.dashboard_port, args.dashboard_host) == (0, "0.0.0.0")
    with pytest.raises(ValueError, match="dashboard port"):
        ServiceConfig(dashboard_port=70000)


def test_members_are_read_again_only_when_the_membership_moved() -> None:
    store = MemoryStore()
    state = CoordinatorState(store=store, job=_job(), token="t", clock=lambda: 1000.0)
    for i in range(3):
        store.put_member(_member(i, "a"))
    snap = Snapshots(state)
    assert snap.take(now=1001.0)["map"]["states"] == {"alive": 3}
    store.set_member_state("n1", "gone", "no heartbeat")  # not yet told to the state: the aggregate is kept
    assert snap.take(now=1002.0)["map"]["states"] == {"alive": 3}
    assert snap.island_nodes("(no island) a")[1]["state"] == "gone"  # a page asked for reads the store now
    state.membership_changed(1002.0)
    doc = snap.take(now=1003.0)
    assert doc["map"]["states"] == {"alive": 2, "gone": 1}
    assert any(e["kind"] == "failure" and "n1" in e["text"] for e in doc["events"])
