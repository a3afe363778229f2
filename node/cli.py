"""`atoll node`: profile this machine, join a coordinator, heartbeat, probe peers and follow the plan."""

from __future__ import annotations

import argparse

from atoll.argtypes import count, number, seconds

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser(
        "node", help="join a coordinator as a node",
        description="Profile this machine on the job's own layers, start the peer server, join the coordinator, "
        "heartbeat, run the link probes it asks for and follow its plans.")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--token", help="job token; shows in the process list, so prefer --token-file or $ATOLL_TOKEN")
    p.add_argument("--token-file", help="file holding the job token (the coordinator's STATE_DIR/token)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--listen", default="0.0.0.0:0", help="HOST:PORT of this node's peer server (default 0.0.0.0:0: "
                   "every interface, a port picked at each start; give a fixed port where a firewall must let "
                   "it in)")
    p.add_argument("--advertise", help="HOST:PORT peers should dial (default: the listen address, with a "
                   "wildcard host replaced by this machine's hostname)")
    p.add_argument("--state-dir", default="runs/node", help="folder that keeps this node's stable id, key and "
                   "certificate; locked while the node runs, so each node on a machine needs its own")
    p.add_argument("--tls-ca", help="the job CA: a copy of the coordinator's STATE_DIR/ca.pem (default: ca.pem beside "
                   "--token-file). The coordinator and every peer are verified with it")
    p.add_argument("--ca-hash", help="instead of --tls-ca: the job CA's fingerprint (sha256:..., printed in the join "
                   "command of `atoll coordinator`); the node takes the CA from the coordinator and checks it")
    p.add_argument("--insecure", action="store_true",
                   help="closed labs only: plaintext gRPC to a coordinator that runs --insecure")
    p.add_argument("--region", help="site label of this machine (a lab, a datacenter, a cloud region); islands never "
                   "span two regions")
    p.add_argument("--machine", help="the machine this node runs on (default: its hostname): nodes of one machine "
                   "share its network card, so the coordinator measures what each gets while all send at once, and "
                   "[cluster] host_tp runs tensor parallelism among them. Give it where containers each have a "
                   "hostname of their own (docker), the same for every node of one machine")
    p.add_argument("--wan-latency-ms", type=number(least=0, most=60_000, what="milliseconds"), default=0.0,
                   help="testbeds only: hold each tensor sent to a peer of another region this many ms, to emulate a "
                   "wide-area link's one-way latency where the kernel cannot delay packets (default 0: off)")
    p.add_argument("--checkpoint-dir", help="this node's own checkpoint folder: its checkpoints and the copies it keeps "
                   "of other nodes' (default: STATE_DIR/checkpoints); files it lacks are fetched from their holders")
    p.add_argument("--stay", action="store_true", help="keep the node running after the job has finished its steps "
                   "(by default it leaves and exits, as does a node the plan leaves idle)")
    p.add_argument("--exit-when-done", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for scripts
    p.add_argument("--no-listen", action="store_true",
                   help="accept no connections (behind NAT or a firewall): this node opens the streams to its "
                   "neighbours itself, and a node that accepts connections relays between it and others like it. "
                   "Without it, the coordinator dials --advertise back at join and tells the node what it found"),
    p.add_argument("--profile-seconds", type=seconds(most=3600), default=3.0, help="time budget of the start-up profile")
    p.add_argument("--reprofile", action="store_true",
                   help="measure this machine again at start-up even where its state dir holds a profile of the same "
                        "job, device, CPU quota and versions from the last 24 hours (a restart otherwise reuses it)")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files of every step under DIR/<node "
                   "id>/ (overrides [train] tensorboard_dir; needs the tensorboard package: atoll[tensorboard])")
    p.add_argument("--threads", type=count(most=4096, what="a thread count"), default=None,
                   help="CPU threads torch may use (default: torch's choice, one per core). With several nodes on "
                   "one machine give each cores / nodes, or they slow each other down many times over")
    p.set_defaults(func=_run_node)


def _run_node(args: argparse.Namespace) -> int:
    from atoll.node.agent import run_node_cli

    return run_node_cli(args)
