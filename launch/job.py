"""`atoll job stop`, `atoll job extend --steps N`, `atoll job quarantine`, `atoll job release NODE` and `atoll job
viewer-token`: act on a running job through its coordinator.

Both are one `ControlJob` call, authenticated with the job token (and the job CA, as `atoll status`). The
nodes hear the new end with their next step acknowledgements: a stopped job ends a few steps after the
newest reported step, with a checkpoint, and its nodes exit; an extended one trains on.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import grpc

from atoll.argtypes import count, seconds

SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(sub: SubParsers) -> None:  # type: ignore[valid-type]
    p = sub.add_parser("job", help="stop or extend a running job; list or release quarantined nodes; the dashboard's "
                       "viewer token",
                       description="Act on a running job through its coordinator (the job token authenticates).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    stop = actions.add_parser("stop", help="end the job a few steps from now, after a checkpoint; its nodes exit",
                              description="End the job a few steps after the newest reported step (every stage "
                              "hears it first), with a checkpoint; the nodes then leave and exit. The coordinator "
                              "keeps serving `atoll status` until it is stopped.")
    extend = actions.add_parser("extend", help="train N more steps than planned",
                                description="Move the job's end N steps later; the nodes train on. Steps past the "
                                "spec's train.steps train at the schedule's final learning rate.")
    extend.add_argument("--steps", type=count(what="a step count"), required=True, help="steps to add")
    listing = actions.add_parser("quarantine", help="list the quarantined nodes and why",
                                 description="List the nodes the coordinator took out of the plan for repeated "
                                 "offences (tensors their neighbours rejected), with the reason.")
    release = actions.add_parser("release", help="let a quarantined node back into the plan",
                                 description="Let a quarantined node back: the next plan may include it again (it "
                                 "starts with no offences counted).")
    release.add_argument("node", help="the quarantined node's id (as `atoll job quarantine` lists it)")
    viewer = actions.add_parser("viewer-token", help="print the dashboard's read-only token",
                                description="Print the token that opens the coordinator's dashboard "
                                "(--dashboard-port) read-only: hand it to people who watch the job. It cannot join "
                                "the job or act on it. The coordinator makes it at the first ask and keeps it in its "
                                "state dir (viewer-token).")
    for a in (stop, extend, listing, release, viewer):
        a.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
        a.add_argument("--token", help="job token (or --token-file, or $ATOLL_TOKEN)")
        a.add_argument("--token-file", help="file holding the job token")
        a.add_argument("--tls-ca", help="the job CA (the coordinator's STATE_DIR/ca.pem; default: ca.pem beside "
                       "--token-file)")
        a.add_argument("--insecure", action="store_true", help="the coordinator runs --insecure (plaintext)")
        a.add_argument("--timeout", type=seconds(), default=10.0, help="seconds to wait for the answer")
        a.set_defaults(func=run_job_cli)


def control_job(address: str, action: str, *, steps: int = 0, node_id: str = "", token: str | None, rpc=None,
                timeout: timedelta = timedelta(seconds=10), say=None):
    """One ControlJob call; returns the `JobControlReply`. Raises PermissionError (token), ValueError (refused,
    with the coordinator's reason) or ConnectionError (no answer)."""
    from atoll.rpc import make_channel
    from atoll.v1 import atoll_pb2 as pb
    from atoll.v1 import atoll_pb2_grpc as pb_grpc

    from atoll.preflight import check_dial_address

    from atoll.netcheck import call_coordinator

    check_dial_address(address, "--coordinator")  # a malformed address is said at once, not after the timeout
    channel = make_channel(address, rpc, token=token)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        return call_coordinator(lambda seconds, ready: stub.ControlJob(
            pb.JobControlRequest(action=action, steps=steps, node_id=node_id), timeout=seconds, wait_for_ready=ready),
            address, timeout, rpc, say)
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise PermissionError(f"{address}: {e.details()}") from None
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            raise ValueError(f"{address}: {e.details()}") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            from atoll.netcheck import unanswered

            raise unanswered(address, code.name, timeout, rpc) from None
        raise ConnectionError(f"{address}: {code.name}: {e.details()}") from None
    finally:
        channel.close()


def run_job_cli(args: argparse.Namespace) -> int:
    from atoll.job import resolve_token
    from atoll.tls import bootstrap_rpc, find_ca

    token = resolve_token(args.token, args.token_file)
    if not token:
        raise ValueError("atoll job needs the job token: --token-file or $ATOLL_TOKEN")
    rpc = None if args.insecure else bootstrap_rpc(token, find_ca(args.tls_ca, args.token_file).read_bytes())
    reply = control_job(args.coordinator, args.action, steps=getattr(args, "steps", 0),
                        node_id=getattr(args, "node", ""), token=token, rpc=rpc, timeout=timedelta(seconds=args.timeout),
                        say=lambda line: print(f"atoll: {line}", file=sys.stderr, flush=True))
    if args.action == "viewer-token":
        print(reply.viewer_token)  # alone on stdout, for scripts: `atoll job viewer-token ... > viewer-token`
        return 0
    print(reply.message)  # it names the newest reported step and the last step, in the logs' numbering
    for q in reply.quarantined:
        print(f"  {q.node_id}: {q.reason}")
    return 0
