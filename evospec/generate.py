"""``evospec generate``: one prompt, one completion, streamed to stdout.

Owns: the ``generate`` sub-parser and its command. Contract: stdout carries the completion
text only; one final stats line (tokens, seconds, tok/s, and MAL for speculative methods, as
``decoding/stats.py`` defines it) goes to stderr, after one note where a drafted method's tree
shape has not been measured on this machine yet (a one-shot run measures none unless asked:
``--tree auto``). The decoder comes from ``assembly.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

from evospec import options

UNTUNED = (
    "no shape measured on this machine yet: a 1-token chain after context lookup (--tree auto, "
    "`evospec bench --tree auto` or a server's idle time measures one and caches it)"
)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate text. stdout: the completion only; stderr: one stats line.",
    )
    g.add_argument("prompt", help="the prompt text ('-' reads stdin)")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    g.add_argument(
        "--method",
        default="ar",
        help=options.METHOD_HELP + " (default: ar)",
    )
    options.add_model_args(g)
    options.add_draft_args(g)
    options.add_adapt_args(g)
    options.add_sampling_args(g, 128)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from evospec.assembly import assemble
    from evospec.decoding.stats import RequestStats
    from evospec.tokenizer import IncrementalDecoder

    params = options.sampling_params(args)
    settings = options.stack_settings(args, [args.method], tune_by_default=True)
    # one completion measures no tree it was not asked to (--tree auto): with no --tree, the
    # shape measured earlier on this machine, else a 1-token chain after context lookup
    defer = args.tree is None and args.method != "auto"
    stack = assemble(settings, progress=not args.no_progress, defer_tuning=defer)
    if stack.deferred is not None:
        print(f"[evospec] {stack.deferred.label}: {UNTUNED}", file=sys.stderr)
    params = options.json_mode(args, params, stack)
    codec = stack.codec
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = codec.encode_chat([{"role": "user", "content": text}]) if args.chat else codec.encode(text)
    decoder = stack.decoder(args.method)
    detok = IncrementalDecoder(codec)
    stats = RequestStats()
    t0 = time.perf_counter()
    for ev in decoder.generate(ids, params):
        stats.add(ev)
        sys.stdout.write(detok.push(ev.tokens))
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    decoder.close()
    sys.stdout.write(detok.flush() + "\n")  # a character the last tokens left unfinished: U+FFFD
    line = (
        f"[evospec] method={decoder.name} prompt_tokens={len(ids)} tokens={stats.tokens} "
        f"seconds={dt:.2f} tok_per_s={stats.tokens / dt:.2f}"
    )
    if decoder.tree is not None and stats.mal is not None:
        line += f" mal={stats.mal:.2f}"
    print(line, file=sys.stderr)
    return 0
