"""``evospec bench``: the Spec-Bench side-by-side run and the topic-shift scenario.

Owns: turning parsed ``bench`` arguments into decoders (through the shared helpers of
``evospec/cli.py``), running them (``runner.py`` / ``topic_shift.py``) and writing the table,
JSON and plots. The argument parser itself lives in ``evospec/cli.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from evospec.cli import _adapt_config, _decoders, _load, _sampling, _vocab_config


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from evospec.bench.prompts import load_prompts
    from evospec.bench.runner import format_table, run_side_by_side, summarise

    if args.scenario == "topic-shift":
        return _bench_topic_shift(args)
    if args.methods is None:
        args.methods = "ar,hf"
    if args.quick and args.limit is None:
        args.limit = 2
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    params = _sampling(args)
    prompts = load_prompts(args.data, per_category=args.per_category, limit=args.limit)
    if not prompts:
        raise SystemExit(f"error: no prompts selected from {', '.join(map(str, args.data))}")
    loaded = _load(args)
    codec = loaded.codec
    eos = codec.eos_ids or loaded.model.cfg.eos_token_ids
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    ours = _decoders([n for n in names if n != "hf"], args, loaded, eos)
    decoders = {}
    for name in names:
        if name == "hf":
            from evospec.bench.hf_baseline import HFGenerateDecoder

            decoders[name] = HFGenerateDecoder(loaded.source, eos)
        else:
            decoders[name] = ours[name]

    def encode(p):
        return codec.encode_chat([{"role": "user", "content": p.text}]) if p.chat else codec.encode(p.text)

    records = run_side_by_side(decoders, prompts, encode, params, progress=not args.no_progress)
    import torch

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
        "tree": {n: asdict(d.tree) for n, d in decoders.items() if hasattr(d, "tree")},
        "vocab": asdict(_vocab_config(args)),
        "quick": args.quick,
        "torch_threads": torch.get_num_threads(),
        "packed_weights": not args.no_pack,
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
        raise SystemExit("error: --replay replays greedy answers; it does not take --temperature")
    n = 2 if args.quick else args.shift_requests
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 64
    stream = topic_shift_stream(args.shared_data, n, n)
    loaded = _load(args)
    codec = loaded.codec
    eos = codec.eos_ids or loaded.model.cfg.eos_token_ids
    names = [m.strip() for m in (args.methods or "frspec,clora,osd,evospec-full").split(",") if m.strip()]
    if "hf" in names:
        raise SystemExit("error: 'hf' is not part of the topic-shift scenario")
    if args.replay:  # replay rounds are fast: an update inline stands for a worker that keeps up
        args.adapt_sync = True
    decoders = _decoders(names, args, loaded, eos)

    def encode(p):  # a base model without a chat template gets the plain text
        if codec.has_chat_template:
            return codec.encode_chat([{"role": "user", "content": p.text}])
        return codec.encode(p.text)

    params = _sampling(args)
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
        "adapt": asdict(_adapt_config(args)),
        "tree": {k: asdict(d.tree) for k, d in decoders.items() if hasattr(d, "tree")},
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
        if getattr(dec, "adapt", None) is not None:
            dec.adapt.close()
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
