"""`kvflow demo`, added to the `kvflow` command through the `kvflow.commands` entry point.

The core's CLI knows no vLLM: it asks each `kvflow.commands` entry point to add its
subcommand, as it finds transports through `kvflow.transports`. This module imports
no vLLM until the demo runs.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_demo_parser"]


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "demo",
        help="run a real vLLM engine cold, restart it, run it warm from kvflow's cache",
    )
    d.add_argument("--cache-dir", default="", help="fs cache directory (default: user cache)")
    d.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: a producer engine prefills, a consumer decodes",
    )
    d.add_argument("--transport", default="zmq", help="peer transport of --pd (default: zmq)")
    d.add_argument("--prompts", type=int, default=4)
    d.add_argument("--prompt-len", type=int, default=1000)
    d.add_argument("--max-tokens", type=int, default=16)
    d.set_defaults(fn=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401 - the demo's engines run in processes of their own

        from .demo import run_demo, run_pd_demo
    except ImportError as exc:
        print(f"kvflow demo needs vLLM: {exc}", file=sys.stderr)
        return 2
    if args.pd:
        return run_pd_demo(
            transport=args.transport,
            num_prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
        )
    return run_demo(
        cache_dir=args.cache_dir,
        num_prompts=args.prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
    )
