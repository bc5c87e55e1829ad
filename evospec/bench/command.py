"""``evospec bench``: the Spec-Bench side-by-side run, the topic-shift and conversation scenarios.

Owns: the ``bench`` sub-parser; turning its arguments into decoders (``options.py`` ->
``assembly.py``), running them (``runner.py`` / ``topic_shift.py``) and writing the table,
JSON and plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evospec import options
from evospec.common import DEFAULT_DATA, check_output, positive_int


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="run decoding methods side by side on the same prompts",
        description="Benchmark methods in one process on the same prompts; prints a table "
        "and optionally writes JSON. 'hf' is transformers' generate on the model's float32 weights "
        "(the converted folder: with --weights int4/int8 ours run the quantised ones, so hf's "
        "outputs and speed compare formats, not only engines).",
    )
    b.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods: hf (transformers' generate on the float32 weights) and "
        + options.METHOD_HELP.removeprefix("decoding method: ")
        + " (default: ar,hf; topic-shift: frspec,clora,osd,evospec-full; conversation: "
        "ar,frspec,specvocab,evospec,evospec-full)",
    )
    b.add_argument(
        "--scenario",
        choices=["spec-bench", "topic-shift", "conversation"],
        default="spec-bench",
        help="'spec-bench': prompts from --data, methods side by side; 'topic-shift': HumanEval requests "
        "then law/medicine requests from the shared data folder, per-request MAL of each method with "
        "its adapter carried across the stream (frspec is the frozen baseline); 'conversation': "
        "multi-turn Topical-Chat conversations replayed with the model's own answers in the context, "
        "learnt state reset per conversation, mean ± std across conversations",
    )
    b.add_argument(
        "--conversations",
        type=positive_int,
        default=4,
        help="conversation: conversations replayed (default 4)",
    )
    b.add_argument(
        "--max-turns",
        type=positive_int,
        default=8,
        help="conversation: user turns per conversation (default 8)",
    )
    b.add_argument(
        "--shift-requests",
        type=positive_int,
        default=12,
        help="topic-shift: requests before and after the shift (default 12 + 12)",
    )
    b.add_argument(
        "--shared-data",
        type=Path,
        default=DEFAULT_DATA,
        help="topic-shift, conversation: the shared data folder",
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
        "--plots",
        type=Path,
        default=None,
        help="write PNG plots (speed, acceptance, acceptance by depth, draft split) here",
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
    options.add_model_args(b)
    options.add_draft_args(b, tree_default="'fixed' (a benchmark measures the shape it is given)")
    options.add_adapt_args(b)
    options.add_sampling_args(b, 64)
    b.set_defaults(max_new_tokens=None)
    b.set_defaults(func=cmd_bench)


def _method_names(methods: str | None, default: str) -> list[str]:
    """``--methods`` as a list (``default`` where it is not given); ValueError where it names none."""
    names = [m.strip() for m in (default if methods is None else methods).split(",") if m.strip()]
    if not names:
        raise ValueError(f"--methods {methods!r} names no method (e.g. --methods {default})")
    return names


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from evospec.bench.prompts import load_prompts
    from evospec.bench.runner import format_table, run_side_by_side, summarise

    check_output(args.json, "--json")
    check_output(args.markdown, "--markdown")
    check_output(args.plots, "--plots", folder=True)
    if args.scenario == "topic-shift":
        return _bench_topic_shift(args)
    if args.scenario == "conversation":
        return _bench_conversation(args)
    if args.methods is None:
        args.methods = "ar,hf"
    if args.quick and args.limit is None:
        args.limit = 2
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    from evospec.assembly import assemble

    params = options.sampling_params(args)
    prompts = load_prompts(args.data, per_category=args.per_category, limit=args.limit)
    if not prompts:
        raise ValueError(f"no prompts selected from {', '.join(map(str, args.data))}")
    names = _method_names(args.methods, "ar,hf")
    if (args.json_mode or args.json_schema) and "hf" in names:
        raise ValueError("--json-mode / --json-schema: the hf baseline has no JSON grammar")
    stack = assemble(
        options.stack_settings(args, [n for n in names if n != "hf"]), progress=not args.no_progress
    )
    loaded, codec, eos = stack.loaded, stack.codec, stack.eos_ids
    params = options.json_mode(args, params, stack)
    decoders = {}
    for name in names:
        if name == "hf":
            from evospec.bench.hf_baseline import HFGenerateDecoder

            decoders[name] = HFGenerateDecoder(loaded.source, eos, progress=not args.no_progress)
        else:  # "auto" is listed under the method it resolved to
            decoders[stack.resolved.get(name, name)] = stack.decoder(name)

    records = run_side_by_side(
        decoders, prompts, lambda p: p.token_ids(codec), params, progress=not args.no_progress
    )
    import torch

    from evospec.kernels.int4_matmul import kernel_isa
    from evospec.kernels.prefetch import current as prefetch_setting
    from evospec.kernels.prefetch import hints as prefetch_hints

    config = {
        "model": loaded.name,
        "data": [str(p) for p in args.data],
        "prompts": len(prompts),
        "per_category": args.per_category,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "methods": list(decoders),
        "draft": args.draft,
        "draft3": args.draft3,
        "tree": {n: asdict(d.tree) for n, d in decoders.items() if d.tree is not None},
        "vocab": asdict(stack.settings.vocab),
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "packed_weights": not args.no_pack,
        "prefix_reuse": any(getattr(d, "prefix", None) and d.prefix.enabled for d in decoders.values()),
        "weights": stack.loaded.weights,
        "step_graph": stack.loaded.model.step_graph is not None,
        "fused_ops": bool(getattr(stack.loaded.model, "fused_ops", False)),
        "kernel_isa": kernel_isa(),
        "draft_weights": args.draft_weights,
        "prefetch": f"{prefetch_setting()}/{prefetch_hints()[1]}",  # streamed HINT:KIB / kept hint
        "verify_logits": args.verify_logits,
        "torch": torch.__version__,
    }
    result = summarise(records, config)
    table = format_table(result)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.plots:
        from evospec.bench.plots import write_plots

        for path in write_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_topic_shift(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    import torch

    from evospec.bench.topic_shift import (
        format_stream_table,
        plot_stream,
        replay_stream,
        run_stream,
        summarise_stream,
        topic_shift_stream,
    )

    if args.replay and args.temperature > 0:
        raise ValueError("--replay replays greedy answers; it does not take --temperature")
    n = 2 if args.quick else args.shift_requests
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    stream = topic_shift_stream(args.shared_data, n, n)
    names = _method_names(args.methods, "frspec,clora,osd,evospec-full")
    if "hf" in names:
        raise ValueError("'hf' is not part of the topic-shift scenario")
    if args.replay:  # replay rounds are fast: an update inline stands for a worker that keeps up
        args.adapt_sync = True
    # the adapting methods draft with the head's own fp32 weights: the frozen baseline drafts with
    # the same, so that what the comparison shows is the updates, not a quantised copy's rounding
    if args.draft_weights == "auto":
        args.draft_weights = "fp32"
    elif args.draft_weights != "fp32":
        print(
            f"note: --draft-weights {args.draft_weights} applies to frspec only; the adapting methods "
            "draft with fp32 weights, so the frozen comparison mixes the two",
            file=sys.stderr,
        )
    from evospec.assembly import assemble

    stack = assemble(options.stack_settings(args, names), progress=not args.no_progress)
    loaded, codec, eos, decoders = stack.loaded, stack.codec, stack.eos_ids, stack.decoders

    def encode(p):  # a base model without a chat template gets the plain text
        if codec.has_chat_template:
            return codec.encode_chat([{"role": "user", "content": p.text}])
        return codec.encode(p.text)

    params = options.json_mode(args, options.sampling_params(args), stack)
    keyed = args.adapt_key == "category"
    if args.replay:
        from evospec.bench.replay import record_requests

        print("recording the target's answers for the replay ...", file=sys.stderr)
        recorded = record_requests(loaded.model, [encode(p) for p in stream], args.max_new_tokens, eos)
        records = replay_stream(decoders, stream, recorded, progress=not args.no_progress, keyed=keyed)
        mismatches = dict.fromkeys(decoders, 0)  # replayed outputs are the recording by construction
    else:
        records, mismatches = run_stream(
            decoders, stream, encode, params, progress=not args.no_progress, keyed=keyed
        )
    config = {
        "scenario": "topic-shift",
        "replay": args.replay,
        "adapt_key": args.adapt_key,
        "model": loaded.name,
        "code_requests": n,
        "shift_requests": n,
        "max_new_tokens": args.max_new_tokens,
        "methods": names,
        "frozen": "frspec" if "frspec" in names else None,
        "draft_weights": args.draft_weights,
        "adapt": asdict(stack.settings.adapt),
        "tree": {k: asdict(d.tree) for k, d in decoders.items() if d.tree is not None},
        "outputs_differing_from_first_method": mismatches,
        "torch_threads": torch.get_num_threads(),
        "packed_weights": not args.no_pack,
        "verify_logits": args.verify_logits,
        "torch": torch.__version__,
    }
    result = summarise_stream(records, n, decoders, config)
    table = format_stream_table(result)
    print(table)
    for dec in decoders.values():
        dec.close()
    if any(mismatches.values()):
        print(f"error: outputs differ between methods: {mismatches}", file=sys.stderr)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.plots:
        print(f"wrote {plot_stream(result, args.plots)}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if any(mismatches.values()) else 0


def _bench_conversation(args: argparse.Namespace) -> int:
    import torch

    from evospec.assembly import assemble
    from evospec.bench.conversation import (
        format_conversation_table,
        load_conversations,
        run_conversations,
        summarise_conversations,
    )

    n = 1 if args.quick else args.conversations
    turns = 2 if args.quick else args.max_turns
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    conversations = load_conversations(args.shared_data, n, turns)
    names = _method_names(args.methods, "ar,frspec,specvocab,evospec,evospec-full")
    if "hf" in names:
        raise ValueError("'hf' is not part of the conversation scenario")
    stack = assemble(options.stack_settings(args, names), progress=not args.no_progress)
    if stack.codec is None or not stack.codec.has_chat_template:
        raise ValueError("the conversation scenario needs a model with a chat template")
    decoders = {stack.resolved.get(name, name): stack.decoder(name) for name in names}
    records, mismatches = run_conversations(
        decoders,
        conversations,
        stack.codec,
        options.json_mode(args, options.sampling_params(args), stack),
        progress=not args.no_progress,
    )
    config = {
        "scenario": "conversation",
        "model": stack.loaded.name,
        "conversations": n,
        "max_turns": turns,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "methods": list(decoders),
        "weights": stack.loaded.weights,
        "prefix_reuse": any(getattr(d, "prefix", None) and d.prefix.enabled for d in decoders.values()),
        "outputs_differing_from_first_method": mismatches,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    result = summarise_conversations(records, config)
    table = format_conversation_table(result)
    print(table)
    for dec in decoders.values():
        dec.close()
    if any(mismatches.values()) and args.temperature == 0:
        print(f"error: answers differ between methods: {mismatches}", file=sys.stderr)
    _write_outputs(args, table, result)
    return 1 if any(mismatches.values()) and args.temperature == 0 else 0


def _write_outputs(args: argparse.Namespace, table: str, result: dict) -> None:
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
