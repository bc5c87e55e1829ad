"""``evospec serve``: the sub-parser and its command (flags override the YAML preset).

Imports nothing heavy at module level, so ``evospec --help`` stays fast; the server and its
assembly are loaded when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evospec import options
from evospec.models.registry import DEFAULT_MODEL

# --tree's default on serve (service/config.py: ServeConfig.tunes_tree decides)
SERVE_TREE_DEFAULT = (
    "'auto', measured in the engine's idle time while a 1-token chain after context lookup serves, "
    "unless tree flags or the config give a shape ('fixed' then)"
)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over HTTP (OpenAI completions/chat, /health, /metrics, admin API). "
        "Options come from --config (configs/*.yaml); flags given here override the file.",
    )
    s.add_argument("--config", type=Path, default=None, help="YAML preset, e.g. configs/eagle2.yaml")
    s.add_argument("--model", default=None, help=f"model to serve (default: {DEFAULT_MODEL})")
    s.add_argument(
        "--method",
        default=None,
        help=options.METHOD_HELP + " (default: ar)",
    )
    s.add_argument("--host", default=None, help="listen address (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: 8000)")
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; larger ones get 413 (default: 4194304 = 4 MiB)",
    )
    s.add_argument(
        "--body-read-timeout",
        type=float,
        default=None,
        help="seconds a request body may take to arrive; slower ones get 408 (default: 30)",
    )
    s.add_argument(
        "--max-batch",
        type=_max_batch,
        default=None,
        metavar="N|auto",
        help="most requests generated together once several wait: plain decoding, one token each per "
        "step, where the model can (int4 Llama-style on the CPU ops); 1 = one at a time; auto = as "
        "many as one pass of the int4 kernel over a weight takes: 8 on AVX-512 CPUs, 4 elsewhere "
        "(default: auto)",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens a request joining the batch prefills between two steps of the running "
        "ones: smaller keeps their streams smoother, larger prefills a little faster (default: 128)",
    )
    s.add_argument("--device", default=None, help="torch device: cpu, cuda, cuda:1, auto (default: cpu)")
    s.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="model dtype: activations, KV cache and unquantised weights (default float32)",
    )
    options.add_weights_arg(s, default=None)
    options.add_prefetch_arg(s, default=None)
    s.add_argument("--adapter-dir", default=None, help="adapter folder (default: $EVOSPEC_HOME/adapters)")
    s.add_argument(
        "--persist-state",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the ARC buffer and online adapters across restarts (default: yes)",
    )
    s.add_argument("--state-dir", default=None, help="restart snapshots (default: $EVOSPEC_HOME/state)")
    s.add_argument(
        "--snapshot-minutes",
        type=float,
        default=None,
        help="minutes between restart snapshots; 0: only at shutdown (default: 10)",
    )
    options.add_draft_args(s, overrides=True, tree_default=SERVE_TREE_DEFAULT)
    options.add_adapt_args(s, debug=False)
    s.add_argument("--no-progress", action="store_true", help="hide progress bars")
    options.add_pack_arg(s)
    options.add_prefix_arg(s)
    s.set_defaults(func=cmd_serve)


def serve_config(args: argparse.Namespace):
    """The ``ServeConfig`` a parsed ``serve`` command runs: the file (or defaults), then the flags given."""
    from service.config import ServeConfig, load_config

    base = load_config(args.config) if args.config else ServeConfig()
    names = ("model", "draft", "draft3", "ngrams", "method", "host", "port", "device", "dtype", "weights")
    names += ("verify_logits", "draft_weights", "prefetch", "prefix_cache_mb")
    names += ("max_body_bytes", "body_read_timeout", "max_batch", "prefill_chunk")
    names += ("adapter_dir", "persist_state", "state_dir", "snapshot_minutes")
    flags = {k: getattr(args, k) for k in names} | options.section_overrides(args)
    if args.tree is not None:
        flags["tune_tree"] = args.tree == "auto"
    if args.no_pack:
        flags["pack_weights"] = False
    if args.no_prefix_reuse:
        flags["prefix_reuse"] = False
    return base.with_overrides(**flags)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.server import serve

    serve(serve_config(args), progress=not args.no_progress)
    return 0


def _max_batch(text: str) -> int | str:
    """argparse type of ``--max-batch``: ``auto`` or an integer (checked with the config)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or auto, got {text!r}") from None
