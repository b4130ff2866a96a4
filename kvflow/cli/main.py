"""The `kvflow` command: `proxy`, `transports`, `keygen`, `new-transport`, `inspect`, `doctor`,
and what installed packages add through the `kvflow.commands` entry point (the vLLM
adapter adds `demo`)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import Any

__all__ = ["main"]


def _cmd_transports(args: argparse.Namespace) -> int:
    from ..transport import TransportNotFound, available_transports, load_transport

    eps = available_transports()
    if not eps:
        print("no kvflow transports installed")
        return 1
    for name, ep in sorted(eps.items()):
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            status = load_transport(name).capabilities.describe()
        except TransportNotFound as exc:
            status = f"BROKEN: {exc}"
        print(f"{name:<10} {ep.value:<32} ({dist})  {status}")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from ..keyfiles import keygen

    try:
        path = keygen(args.path)
    except OSError as exc:
        print(f"kvflow keygen: {args.path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(
        f"wrote a new P/D key to {path} (owner-only). Give every instance of the deployment "
        f"a copy and kv_connector_extra_config['key_file'] = \"{path}\" (docs/security.md)"
    )
    return 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    from kvflow.pd.proxy import run

    return run(args)


def _add_proxy_parser(sub: Any) -> None:
    x = sub.add_parser(
        "proxy",
        help="a prefill/decode proxy following vLLM's convention, between OpenAI servers",
    )
    x.add_argument("--prefill", nargs="+", default=[], help="prefill server base URL(s)")
    x.add_argument("--decode", nargs="+", default=[], help="decode server base URL(s)")
    x.add_argument(
        "--server",
        nargs="+",
        default=[],
        help="instead of --prefill and --decode: servers each serving whole requests, "
        "chosen by --route",
    )
    x.add_argument(
        "--route",
        choices=["prefix", "least-loaded", "round-robin", "random"],
        default="round-robin",
        help="prefix (where the prompt's leading blocks are, by the servers' KV events: "
        "--kv-events; with --prefill, the prefill server so and the decode server by load), "
        "least-loaded, round-robin (default) or random",
    )
    x.add_argument(
        "--kv-events",
        nargs="+",
        default=[],
        metavar="ENDPOINT[,REPLAY]",
        help="with --route prefix, one per --server (or --prefill) in order: its "
        "--kv-events-config endpoint (tcp://host:port), and its replay_endpoint after a comma",
    )
    x.add_argument(
        "--max-skew",
        type=int,
        default=None,
        help="with --route prefix: a server with this many more requests in flight than "
        "the least loaded is not chosen for its prefix (default 4)",
    )
    x.add_argument("--host", default="127.0.0.1")
    x.add_argument("--port", type=int, default=8000)
    x.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="answer 413 to a request body longer than this (default 32 MiB)",
    )
    x.add_argument(
        "--client-timeout-s",
        type=float,
        default=None,
        help="let go of a client silent this long while the proxy waits on it; a body that "
        "stops arriving is answered 408 (default 60)",
    )
    x.add_argument(
        "--max-clients",
        type=int,
        default=None,
        help="client connections served at once; one more is answered 503 and closed "
        "(default 1024)",
    )
    x.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="a request (head and body) must arrive within this many seconds of its first "
        "byte, however steadily it trickles, else 408 (default 60)",
    )
    x.add_argument(
        "--stream",
        action="store_true",
        help="kvflow only: send each request to its prefill and decode servers at once; the "
        "decode server pulls each layer as the prefill computes it (docs/pd.md#streamed)",
    )
    x.set_defaults(fn=_cmd_proxy)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvflow {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transports", help="list installed transports")
    t.set_defaults(fn=_cmd_transports)
    k = sub.add_parser(
        "keygen", help="write a new deployment key for the P/D side channel (docs/security.md)"
    )
    k.add_argument("path", help="file to create (refused if it exists)")
    k.set_defaults(fn=_cmd_keygen)
    _add_proxy_parser(sub)
    from .scaffold import add_parser as add_scaffold_parser

    add_scaffold_parser(sub)
    from .inspect import add_parser as add_inspect_parser

    add_inspect_parser(sub)
    from .doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub)
    _add_entry_point_commands(sub)
    return p


def _add_entry_point_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Each `kvflow.commands` entry point is a function that adds its subcommand; one
    that fails to load still appears, and running it says why it cannot run."""
    for ep in sorted(entry_points(group="kvflow.commands"), key=lambda ep: ep.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not break the other commands
            why = f"kvflow {ep.name} ({ep.value}) could not load: {type(exc).__name__}: {exc}"
            broken = sub.add_parser(ep.name, help=f"unavailable: {why}")
            broken.set_defaults(fn=lambda _args, why=why: _unavailable(why))


def _unavailable(why: str) -> int:
    print(why, file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
