"""`atoll node`: profile this machine, join a coordinator, heartbeat, probe peers and follow the plan."""

from __future__ import annotations

import argparse

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "node", help="join a coordinator as a node",
        description="Profile this machine on the job's own layers, start the peer server, join the coordinator, "
        "heartbeat, run the link probes it asks for and follow its plans.")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--token", help="job token (or --token-file, or $ATOLL_TOKEN)")
    p.add_argument("--token-file", help="file holding the job token")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--listen", default="0.0.0.0:0", help="HOST:PORT of this node's peer server (port 0 picks one)")
    p.add_argument("--advertise", help="HOST:PORT peers should dial (default: the listen address, with a "
                   "wildcard host replaced by this machine's hostname)")
    p.add_argument("--state-dir", default="runs/node", help="folder that keeps this node's stable id")
    p.add_argument("--tls-ca", help="PEM root certificate to verify a TLS coordinator (peer links stay plaintext)")
    p.add_argument("--region", help="site label of this machine (a lab, a datacenter, a cloud region); islands never "
                   "span two regions")
    p.add_argument("--wan-latency-ms", type=float, default=0.0,
                   help="testbeds only: hold each tensor sent to a peer of another region this many ms, to emulate a "
                   "wide-area link's one-way latency where the kernel cannot delay packets (default 0: off)")
    p.add_argument("--checkpoint-dir", help="where checkpoints are written and read (default: STATE_DIR/checkpoints); "
                   "nodes that may take over each other's layers need one shared folder")
    p.add_argument("--exit-when-done", action="store_true", help="leave and exit once the job has finished its steps")
    p.add_argument("--profile-seconds", type=float, default=3.0, help="time budget of the start-up profile")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads torch may use (default: torch's choice, one per core). With several nodes on "
                   "one machine give each cores / nodes, or they slow each other down many times over")
    p.set_defaults(func=_run_node)


def _run_node(args: argparse.Namespace) -> int:
    from atoll.node.agent import run_node_cli

    return run_node_cli(args)
