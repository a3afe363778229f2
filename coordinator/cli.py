"""`atoll coordinator` (run the coordinator of one job) and `atoll status` (show what it knows)."""

from __future__ import annotations

import argparse

from atoll.argtypes import count, number, seconds

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register_coordinator(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "coordinator", help="run the coordinator of a job",
        description="Run the coordinator of one job: nodes join it, it forms islands, plans and publishes the "
        "plan. Its state lives in SQLite under --state-dir; restarted on the same folder it resumes the job. "
        "SIGUSR1 has every link probed again.")
    p.add_argument("--job", required=True, help="job spec (TOML), e.g. examples/tiny.toml (the examples are "
                   "installed with atoll, so that one is found from any folder)")
    p.add_argument("--listen", default="0.0.0.0:7070", help="HOST:PORT of the gRPC server (port 0 picks one; "
                   "default 0.0.0.0:7070, every interface: 127.0.0.1:7070 for this machine only)")
    p.add_argument("--state-dir", default="runs/coordinator", help="folder for the coordinator's SQLite state")
    p.add_argument("--token-file", help="file holding the job token (else $ATOLL_TOKEN, else one is generated "
                   "into STATE_DIR/token: copy that file to the nodes)")
    p.add_argument("--metrics-port", type=count(least=0, most=65535, what="a port"), default=None,
                   help="serve Prometheus metrics on this port (0 picks one; default: no endpoint)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint binds (default: loopback only; 0.0.0.0 for every interface)")
    p.add_argument("--dashboard-port", type=count(least=0, most=65535, what="a port"), default=None,
                   help="serve the live web dashboard on this port (0 picks one; default: none). It opens with the "
                   "job token or the read-only viewer token (atoll job viewer-token)")
    p.add_argument("--dashboard-host", default="127.0.0.1",
                   help="address the dashboard binds (default: loopback only; 0.0.0.0 for every interface, served "
                   "over HTTPS with the coordinator's certificate unless --insecure)")
    p.add_argument("--tls-cert", help="PEM certificate chain to serve instead of the one the job CA signs (with "
                   "--tls-key; nodes then verify it with --tls-ca of its root)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--rendezvous-host", help="address the rendezvous store (torch TCPStore, unauthenticated) binds "
                   "and nodes dial: one only the nodes' private network reaches (default: the --listen host)")
    p.add_argument("--insecure", action="store_true",
                   help="closed labs only: plaintext gRPC, no node certificates (any token holder can speak as any "
                   "node). By default the coordinator is a CA (STATE_DIR/ca.pem) and every call is mutual TLS")
    p.add_argument("--lease", type=seconds(), default=10.0, help="seconds a node stays alive without a heartbeat")
    p.add_argument("--heartbeat-budget", type=number(least=0, what="heartbeats a second"), default=2000.0, metavar="PER_SECOND",
                   help="heartbeats a second the coordinator takes from all nodes (default 2000): with more than "
                   "budget x lease/4 nodes the heartbeat interval and the lease stretch with the membership, so a "
                   "large job costs the coordinator the same; 0: a fixed cadence at any size")
    p.add_argument("--join-settle", type=seconds(positive=False), default=10.0,
                   help="joins alone replan once no node has joined for this many seconds (at most 60 s after the "
                   "first), so a trickle of joins makes one new plan")
    p.add_argument("--island-threshold", type=number(above=0, most=1, what="a fraction"), default=0.1,
                   help="a link joins two nodes in one island when at least this fraction of the fastest link "
                   "measured (default 0.1: islands part at order-of-magnitude gaps)")
    p.add_argument("--drift", type=number(), nargs=2, default=(1.25, 0.10), metavar=("FACTOR", "GAIN"),
                   help="replan when a node's compute per step changes more than FACTOR times within the plan's epoch "
                   "(its last steps against its first, over the median node's change) and the new plan predicts "
                   "steps at least GAIN shorter, worth more than the switch costs "
                   "(default 1.25 0.10)")
    p.add_argument("--drift-every", type=seconds(positive=False), default=60.0, metavar="SECONDS",
                   help="how often the running plan's devices are checked for drift (default 60); 0: never replan "
                   "for drift")
    p.add_argument("--no-network-fit", dest="network_fit", action="store_false",
                   help="never fit the network model to the nodes' timed transfers, nor replan under such a fit "
                   "(the drift checks run on; a fit is on by default)")
    p.add_argument("--handshake-timeout", type=seconds(), default=10.0, metavar="SECONDS",
                   help="a connection that has not finished its TLS and HTTP/2 handshake within SECONDS is dropped "
                   "(default 10)")
    p.add_argument("--max-connections", type=count(least=1, what="connections"), default=20_000,
                   help="connections the gRPC server holds at once, from all peers together (default 20000: one per "
                   "node and its reconnect); more are closed as they arrive")
    p.add_argument("--start-fresh", action="store_true",
                   help="start a new job in --state-dir: whatever state is there (store, CA, identities) is moved "
                   "into STATE_DIR/aside/<time>/, never deleted; the token and backups stay. Without it the "
                   "coordinator refuses a state dir it cannot read whole")
    p.add_argument("--restore", metavar="BACKUP",
                   help="bring this backup of the store back (one of STATE_DIR/backups/coordinator-*.db), after "
                   "checking it; the store it replaces is moved into STATE_DIR/aside/<time>/")
    p.add_argument("--backup-every", type=seconds(positive=False), default=300.0, metavar="SECONDS",
                   help="back the store up online every SECONDS into STATE_DIR/backups (default 300); 0: never")
    p.add_argument("--backups-kept", type=count(least=1, what="backups"), default=3,
                   help="how many of the newest backups are kept (default 3)")
    p.add_argument("--address-file", help="write the real HOST:PORT here once listening (for scripts and tests)")
    p.add_argument("--plan", metavar="FILE.json",
                   help="publish this plan instead of planning (an operator's pin): JSON as `atoll plan --json` "
                   "writes it, every stage listing its nodes as `atoll node` ids (the node_id file in a node's "
                   "--state-dir) and dp x tp of them; stages of one pipeline may differ in width, and a stage may "
                   "split its replicas into `lanes` (micro-batch i on lane i %% lanes). The coordinator "
                   "fills in the epoch, job id, resume step, islands, peer addresses and rendezvous. While a node "
                   "it names is not an alive member the coordinator plans as usual, and says so")
    p.set_defaults(func=_run_coordinator)


def _run_coordinator(args: argparse.Namespace) -> int:
    from atoll.coordinator.service import run_coordinator_cli

    return run_coordinator_cli(args)


def register_status(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "status", help="show a coordinator's job live: progress, stages, links, members, islands and plan",
        description="Ask a coordinator for its job: step, loss, the whole job's loss history as a sparkline (--plot "
        "draws it), tokens/s, measured vs predicted step time, each node's compute and wait time, each link's codec "
        "and bandwidth, members, islands and the plan.")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--token", help="job token (or --token-file, or $ATOLL_TOKEN)")
    p.add_argument("--token-file", help="file holding the job token")
    p.add_argument("--tls-ca", help="the job CA (the coordinator's STATE_DIR/ca.pem; default: ca.pem beside "
                   "--token-file)")
    p.add_argument("--insecure", action="store_true", help="the coordinator runs --insecure (plaintext)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables (one line per update with "
                   "--watch): the tables' headers are its field names in capitals; a failure is printed as "
                   "{\"error\": ...} with exit code 2")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="ask again every SECONDS (default 2) until Ctrl-C")
    # checked by the command, not argparse: with --json a bad value is answered in JSON too
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    p.add_argument("--plot", metavar="FILE.png", help="write the whole job's loss curve (and validation loss) as a "
                   "PNG to FILE.png and exit")
    p.set_defaults(func=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from atoll.coordinator.status import run_status_cli

    return run_status_cli(args)
