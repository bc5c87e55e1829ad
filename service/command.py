"""``evospec serve``: the sub-parser and its command (flags override the YAML preset).

Imports nothing heavy at module level, so ``evospec --help`` stays fast; the server and its
assembly are loaded when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evospec import options
from evospec.models.registry import DEFAULT_MODEL


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over HTTP (OpenAI completions/chat, /health, /metrics, admin API). "
        "Options come from --config (configs/*.yaml); flags given here override the file.",
    )
    s.add_argument("--config", type=Path, default=None, help="YAML preset, e.g. configs/eagle2.yaml")
    s.add_argument("--model", default=None, help=f"model to serve (default: {DEFAULT_MODEL})")
    s.add_argument("--draft", default=None, help="EAGLE-2 head folder (speculative methods)")
    s.add_argument(
        "--method",
        default=None,
        help=options.METHOD_HELP + " (default: ar)",
    )
    s.add_argument("--host", default=None, help="listen address (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: 8000)")
    s.add_argument("--device", default=None, help="torch device: cpu, cuda, cuda:1, auto (default: cpu)")
    s.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights dtype (default float32)",
    )
    s.add_argument(
        "--verify-logits",
        choices=["auto", "all", "lazy"],
        default=None,
        help="tree nodes projected onto the vocabulary when verifying: all | lazy | auto (lazy on a "
        "CPU; default)",
    )
    s.add_argument("--no-progress", action="store_true", help="hide progress bars")
    options.add_pack_arg(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.config import ServeConfig, load_config
    from service.server import serve

    base = load_config(args.config) if args.config else ServeConfig()
    names = ("model", "draft", "method", "host", "port", "device", "dtype", "verify_logits")
    flags = {k: getattr(args, k) for k in names}
    if args.no_pack:
        flags["pack_weights"] = False
    serve(base.with_overrides(**flags), progress=not args.no_progress)
    return 0
