"""The `atoll` command line: one parser, a subcommand per component.

Each subcommand's parser is built by a `register(subparsers)` function next to the component it runs;
heavy imports (torch, grpc servers) happen inside the command, so `atoll --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from atoll import __version__
from atoll.log import setup_logging

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _register_version(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("version", help="print the versions of atoll, its wire schema and its runtime",
                       description="Print the versions of atoll, its wire schema, torch, grpcio and protobuf.")
    p.set_defaults(func=_run_version)


def _run_version(args: argparse.Namespace) -> int:
    import google.protobuf
    import grpc

    from atoll import WIRE_VERSION

    try:
        import torch

        torch_version = torch.__version__
        cuda = torch.version.cuda or "none"
    except ImportError:  # pragma: no cover - torch is a dependency; say so plainly if it is missing
        torch_version, cuda = "not installed", "none"
    print(f"atoll {__version__}")
    print(f"wire schema {WIRE_VERSION}")
    print(f"python {sys.version.split()[0]}, torch {torch_version} (cuda {cuda}), grpcio {grpc.__version__}, "
          f"protobuf {google.protobuf.__version__}")
    return 0


def _commands() -> list[Register]:
    from atoll.coordinator.cli import register_coordinator, register_status
    from atoll.coordinator.planner.cli import register as register_plan
    from atoll.launch.demo import register as register_demo
    from atoll.launch.export import register as register_export
    from atoll.launch.job import register as register_job
    from atoll.launch.tokenizer import register as register_tokenizer
    from atoll.node.cli import register as register_node

    return [_register_version, register_coordinator, register_status, register_node, register_plan, register_demo,
            register_tokenizer, register_export, register_job]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description="Atoll trains large models across heterogeneous, geo-distributed GPUs: a coordinator "
        "groups the GPUs that join into islands, cuts the model into slices and runs balanced pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"atoll {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-vv for debug; GRPC_VERBOSITY=INFO for gRPC's own)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _commands():
        register(sub)
    _say_defaults(parser)
    return parser


class _DefaultsHelp(argparse.HelpFormatter):
    """Help that names each option's default where its own text does not (a flag's off, and a missing value,
    go unsaid)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, True, argparse.SUPPRESS, "")
                or "default" in text.lower() or text == argparse.SUPPRESS):
            return action.help
        shown = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """`_DefaultsHelp` for every subcommand's parser, however deep."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                child.formatter_class = _DefaultsHelp
                _say_defaults(child)


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs each failed TLS handshake and more at INFO on stderr, lines a person cannot act on; its
    # errors stay (GRPC_VERBOSITY=INFO or DEBUG brings the rest back). Set before anything imports grpc.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        # torch's C++ side logs a warning and a 20-frame stack for each socket a peer closed (a rendezvous store
        # or a collective whose peers stopped): nothing a person can act on, since the run's own error says what
        # failed. Its errors stay; -v (before torch is imported) brings the warnings back.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    setup_logging(-1 if args.quiet else args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        logging.getLogger("atoll").warning("interrupted")
        return 130
    except BrokenPipeError:  # `atoll status | head`: the reader has what it wanted; leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python flushes stdout at exit)
        return 0
    except (ValueError, OverflowError, OSError) as e:  # OSError: a missing file, a folder, a busy port, a timeout
        # errors meant for the person at the terminal: say what is wrong, without a traceback (-vv shows it)
        log = logging.getLogger("atoll")
        log.error("%s", e)
        log.debug("raised here", exc_info=True)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
