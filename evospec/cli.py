"""The ``evospec`` command line: generate, bench, train-draft, serve, models.

Owns: argument parsing and the text edge (tokenizer, chat template, printing). Contract of
``generate``: stdout carries the completion text only; one final stats line goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from evospec.common import DEFAULT_DATA, positive_int
from evospec.models.registry import DEFAULT_MODEL, REGISTRY
from evospec.train.command import add_train_draft_parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registered name ({', '.join(REGISTRY)}), a Hugging Face folder or a .gguf file "
        f"(default: {DEFAULT_MODEL})",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_pack_arg(p)


def _add_pack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="keep plain fp32 CPU weights (default: reorder them once for oneDNN, which decodes "
        "and verifies faster at the cost of one extra copy of the weights)",
    )


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-2 head folder (config.json + model.safetensors or pytorch_model.bin); "
        "default: the head shipped for the model, if any",
    )
    p.add_argument(
        "--top-k-tree",
        type=positive_int,
        default=10,
        dest="tree_top_k",
        help="tree: children per expanded node and frontier width (default 10)",
    )
    p.add_argument("--depth", type=positive_int, default=5, help="tree: draft levels per round (default 5)")
    p.add_argument(
        "--total-tokens",
        type=positive_int,
        default=60,
        help="tree: draft tokens verified per round (default 60)",
    )
    p.add_argument(
        "--tree",
        choices=["fixed", "auto"],
        default="fixed",
        help="'fixed': the three flags above; 'auto': pick the fastest tree shape for this machine, "
        "model, head and method by a short calibration run on training-side prompts (cached under "
        "$EVOSPEC_HOME/tuning)",
    )
    p.add_argument(
        "--verify-logits",
        choices=["auto", "all", "lazy"],
        default="auto",
        help="which tree nodes verification projects onto the vocabulary: 'all' (one call; best on "
        "a GPU), 'lazy' (the root, then only where the walk goes, prefetching nodes the draft "
        "expects to be accepted; best on a CPU), 'auto' = lazy on a CPU (default). Same output",
    )
    v = p.add_argument_group("active vocabulary (frspec, nanospec, evospec, nanospec+evospec)")
    v.add_argument(
        "--frspec-k",
        type=positive_int,
        default=None,
        help="static frequency table size (frspec; evospec's core); default 32768 for vocabularies "
        ">= 128k, else V/4 rounded up to 256",
    )
    v.add_argument(
        "--core-k",
        type=positive_int,
        default=None,
        help="evospec's static core alone (evospec, evospec-full), e.g. a smaller core than the "
        "frspec table it is compared with; default: --frspec-k",
    )
    v.add_argument("--w-max", type=positive_int, default=3072, help="NanoSpec window (default 3072)")
    v.add_argument(
        "--arc-capacity", type=positive_int, default=256, help="EvoSpec dynamic buffer (default 256)"
    )
    v.add_argument(
        "--indices",
        type=Path,
        default=None,
        help="index folder from evospec-index build (default: $EVOSPEC_HOME/indices/<model>, built on "
        "first use from the training-side data)",
    )


def _add_adapt_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("online adaptation (clora, osd, evospec-full)")
    a.add_argument("--adapt-lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    a.add_argument(
        "--adapt-buffer", type=positive_int, default=32, help="admitted positions per update (default 32)"
    )
    a.add_argument("--adapt-rank", type=positive_int, default=32, help="LoRA rank = alpha (default 32)")
    a.add_argument(
        "--adapt-context",
        type=positive_int,
        default=1024,
        help="committed pairs replayed before each round's root when training (default 1024)",
    )
    a.add_argument(
        "--adapt-temperature",
        type=float,
        default=1.0,
        help="distillation temperature T_KD of the KL objective (default 1.0)",
    )
    a.add_argument(
        "--adapt-gate",
        type=float,
        default=0.1,
        help="admit a covered position when KL(target || draft) exceeds this (default 0.1)",
    )
    a.add_argument(
        "--adapt-steps", type=positive_int, default=1, help="optimizer steps per full buffer (default 1)"
    )
    a.add_argument("--adapt-seed", type=int, default=0, help="seed of the LoRA initialisation (default 0)")
    a.add_argument(
        "--adapt-sync", action="store_true", help="run gate and updates inline at the round end (debugging)"
    )


def _adapt_config(args: argparse.Namespace):
    from evospec.adapt.config import AdaptConfig

    return AdaptConfig(
        lr=args.adapt_lr,
        buffer_size=args.adapt_buffer,
        rank=args.adapt_rank,
        alpha=float(args.adapt_rank),
        context=args.adapt_context,
        temperature=args.adapt_temperature,
        gate_kl=args.adapt_gate,
        steps_per_update=args.adapt_steps,
        seed=args.adapt_seed,
        asynchronous=not args.adapt_sync,
    )


def _add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new, help=f"default {max_new}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evospec",
        description="Speculative decoding with an adaptive draft. Output is identical to plain decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
        help="decoding method: ar | eagle2 | frspec | nanospec | evospec | nanospec+evospec | clora | osd | "
        "evospec-full (default: ar)",
    )
    _add_model_args(g)
    _add_draft_args(g)
    _add_adapt_args(g)
    _add_sampling_args(g, 128)

    b = sub.add_parser(
        "bench",
        help="run decoding methods side by side on the same prompts",
        description="Benchmark methods in one process on the same prompts; prints a table "
        "and optionally writes JSON. 'hf' is transformers' generate on the same weights.",
    )
    b.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods: ar, hf, eagle2, frspec, nanospec, evospec, nanospec+evospec, clora, "
        "osd, evospec-full (default: ar,hf; topic-shift: frspec,clora,osd,evospec-full)",
    )
    b.add_argument(
        "--scenario",
        choices=["spec-bench", "topic-shift"],
        default="spec-bench",
        help="'spec-bench': prompts from --data, methods side by side; 'topic-shift': HumanEval requests "
        "then law/medicine requests from the shared data folder, per-request MAL of each method with "
        "its adapter carried across the stream (frspec is the frozen baseline)",
    )
    b.add_argument(
        "--shift-requests",
        type=positive_int,
        default=12,
        help="topic-shift: requests before and after the shift (default 12 + 12)",
    )
    b.add_argument(
        "--shared-data", type=Path, default=DEFAULT_DATA, help="topic-shift: the shared data folder"
    )
    b.add_argument(
        "--adapt-key",
        choices=["none", "category"],
        default="none",
        help="topic-shift: 'none' shares one adapter across the stream; 'category' keeps one per domain "
        "(code, law, medicine), as a server keyed by tenant would (default none)",
    )
    b.add_argument(
        "--replay",
        action="store_true",
        help="topic-shift: record the target's greedy answers once, then replay every method's rounds "
        "over them (same acceptance and adapter feedback, no verify forwards, MAL only: no timings; "
        "updates run inline)",
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run for CI: 2 prompts and 16 new tokens unless --limit/--max-new-tokens say otherwise",
    )
    b.add_argument("--markdown", type=Path, default=None, help="also write the tables as markdown here")
    b.add_argument(
        "--plots", type=Path, default=None, help="write PNG plots (speed, acceptance, draft split) here"
    )
    b.add_argument(
        "--data",
        nargs="+",
        default=[str(DEFAULT_DATA / "spec_bench" / "question.jsonl")],
        metavar="FILE",
        help="prompt files, read in order: Spec-Bench question.jsonl, HumanEval prompts.jsonl, PubMedQA "
        'pqal.jsonl or {"prompt": ...} JSONL (default: Spec-Bench from the shared data)',
    )
    b.add_argument("--per-category", type=positive_int, default=None, help="at most N prompts per category")
    b.add_argument("--limit", type=positive_int, default=None, help="at most N prompts in all")
    b.add_argument("--json", type=Path, default=None, help="write the results JSON here")
    _add_model_args(b)
    _add_draft_args(b)
    _add_adapt_args(b)
    _add_sampling_args(b, 64)
    b.set_defaults(max_new_tokens=None)

    add_train_draft_parser(sub)

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
        help="decoding method: ar | eagle2 | frspec | nanospec | evospec | nanospec+evospec | clora | osd "
        "| evospec-full (default: ar)",
    )
    s.add_argument("--host", default=None, help="listen address (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="listen port (default: 8000)")
    s.add_argument("--device", default=None, help="torch device: cpu, cuda, cuda:1, auto (default: cpu)")
    s.add_argument(
        "--verify-logits",
        choices=["auto", "all", "lazy"],
        default=None,
        help="tree nodes projected onto the vocabulary when verifying: all | lazy | auto (lazy on a "
        "CPU; default)",
    )
    s.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_pack_arg(s)

    m = sub.add_parser("models", help="list or prepare registered models")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("list", help="registered model names and their cache state")
    pull = msub.add_parser("pull", help="verify and convert a registered model into $EVOSPEC_HOME")
    pull.add_argument("name", choices=sorted(REGISTRY))
    return parser


def _sampling(args: argparse.Namespace):
    from evospec.decoding.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _load(args: argparse.Namespace):
    from evospec.models.loading import load_model

    loaded = load_model(args.model, progress=not args.no_progress, pack=not args.no_pack)
    if loaded.codec is None:
        raise SystemExit(f"error: {loaded.source} has no tokenizer.json; the CLI needs one")
    return loaded


def _indices(names: list[str], args: argparse.Namespace, loaded):
    """The model's index bundle if any method needs one (loaded or built once per process)."""
    from evospec.decoding.methods import ADAPTIVE
    from evospec.vocab.factory import NEEDS_COUNTS, NEEDS_RETRIEVAL

    names = [ADAPTIVE[n][0] if n in ADAPTIVE else n for n in names]
    if not any(n in NEEDS_COUNTS or n in NEEDS_RETRIEVAL for n in names):
        return None
    from indices.default import ensure_indices

    return ensure_indices(
        loaded,
        directory=args.indices,
        need_hnsw=any(n in NEEDS_RETRIEVAL for n in names),
        progress=not args.no_progress,
    )


def _vocab_config(args: argparse.Namespace):
    from evospec.vocab.factory import VocabConfig

    return VocabConfig(
        frspec_k=args.frspec_k, core_k=args.core_k, w_max=args.w_max, arc_capacity=args.arc_capacity
    )


def _decoders(names: list[str], args: argparse.Namespace, loaded, eos) -> dict:
    """One decoder per method name, sharing the draft head and the index bundle."""
    from evospec.decoding.methods import METHODS, SPECULATIVE, make_decoder
    from evospec.decoding.tree import TreeConfig

    for name in names:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    draft = None
    if any(n in SPECULATIVE for n in names):
        from evospec.models.eagle import load_eagle
        from evospec.models.registry import default_head

        path = args.draft or default_head(loaded.name)
        if path is None:
            raise ValueError(f"speculative methods need --draft PATH: no head ships for {loaded.name}")
        draft = load_eagle(path)
    indices = _indices(names, args, loaded)
    vocab = _vocab_config(args)
    adapt = _adapt_config(args) if hasattr(args, "adapt_lr") else None
    fixed = TreeConfig(top_k=args.tree_top_k, depth=args.depth, total_tokens=args.total_tokens)

    def build(name: str, tree: TreeConfig):
        return make_decoder(
            name,
            loaded.model,
            eos_ids=eos,
            draft=draft,
            tree=tree,
            vocab=vocab,
            indices=indices,
            adapt=adapt,
            verify_logits=args.verify_logits,
        )

    out = {}
    for name in names:
        tree = fixed
        if args.tree == "auto" and name in SPECULATIVE:
            from evospec.bench.tune import tuned_tree
            from evospec.decoding.methods import ADAPTIVE

            tree = tuned_tree(  # an adaptive method drafts like its vocabulary policy: tune that
                ADAPTIVE[name][0] if name in ADAPTIVE else name,
                build,
                loaded,
                draft_id=str(args.draft or "shipped"),
                eos=eos,
                progress=not args.no_progress,
                verify_logits=args.verify_logits,
            )
        out[name] = build(name, tree)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from evospec.tokenizer import IncrementalDecoder

    params = _sampling(args)
    loaded = _load(args)
    codec = loaded.codec
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = codec.encode_chat([{"role": "user", "content": text}]) if args.chat else codec.encode(text)
    decoder = _decoders([args.method], args, loaded, codec.eos_ids or loaded.model.cfg.eos_token_ids)[
        args.method
    ]
    detok = IncrementalDecoder(codec)
    n_tok = rounds = 0
    t0 = time.perf_counter()
    for ev in decoder.generate(ids, params):
        n_tok += len(ev.tokens)
        rounds += not ev.prefill
        sys.stdout.write(detok.push(ev.tokens))
        sys.stdout.flush()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    stats = (
        f"[evospec] method={args.method} prompt_tokens={len(ids)} tokens={n_tok} "
        f"seconds={dt:.2f} tok_per_s={n_tok / dt:.2f}"
    )
    if args.method != "ar":
        stats += f" mal={(n_tok - 1) / max(rounds, 1):.2f}"
    print(stats, file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from evospec.bench.command import cmd_bench

    return cmd_bench(args)


def cmd_models(args: argparse.Namespace) -> int:
    from evospec.models.registry import cache_dir, ensure_converted, is_converted

    if args.models_command == "list":
        for name, entry in REGISTRY.items():
            folder = cache_dir(entry)
            state = f"converted at {folder}" if is_converted(folder, entry) else "not converted yet"
            pins = " ".join(f"{p}=={v}" for p, v in entry.packages)
            print(f"{name}\t{pins}\t{entry.license}\t{state}")
        return 0
    print(ensure_converted(REGISTRY[args.name]))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from service.config import ServeConfig, load_config
    from service.server import serve

    base = load_config(args.config) if args.config else ServeConfig()
    names = ("model", "draft", "method", "host", "port", "device", "verify_logits")
    flags = {k: getattr(args, k) for k in names}
    if args.no_pack:
        flags["pack_weights"] = False
    serve(base.with_overrides(**flags), progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evospec.models.errors import CheckpointError

    try:
        commands = {
            "generate": cmd_generate,
            "bench": _cmd_bench,
            "models": cmd_models,
            "serve": cmd_serve,
        }
        run = getattr(args, "func", None) or commands[args.command]  # modules that own a sub-parser
        return run(args)
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
