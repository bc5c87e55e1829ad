"""``evospec train-draft``: generate the target's answers, cache features, train a head.

Owns: turning parsed ``train-draft`` arguments into the data stage (``datagen.py``), the
training run (``trainer.py``) and the saved head with its ``training.json`` record, and
stopping cleanly on SIGTERM. The argument parser itself lives in ``evospec/cli.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from evospec.models.registry import REGISTRY


def _stop_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (and SIGINT where a background shell ignores it) into ``SystemExit`` in the
    main thread, so ``finally`` blocks run: long jobs keep what they finished."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, stop)


def cmd_train_draft(args: argparse.Namespace) -> int:
    import platform

    import torch

    from evospec.models.eagle import new_eagle_for, save_eagle
    from evospec.models.loading import load_model, resolve_device
    from evospec.models.registry import evospec_home
    from evospec.train.datagen import feature_shards, generate_responses
    from evospec.train.prompts import training_prompts
    from evospec.train.support import resolve_support
    from evospec.train.trainer import TrainConfig, load_sequences, train_head

    if args.out is None and not args.generate_only:
        raise ValueError("train-draft: --out is required (the head's folder) unless --generate-only")
    _stop_cleanly_on_sigterm()  # `kill` / `docker stop`: finished answers are flushed, not lost
    progress = not args.no_progress
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    loaded = load_model(args.target, device=device, progress=progress)
    if loaded.codec is None:
        raise ValueError(f"{loaded.source}: the target needs a tokenizer to render training prompts")
    work = args.work or evospec_home() / "train" / loaded.name
    vocab = loaded.model.cfg.vocab_size
    prompts = training_prompts(args.data)
    codec = loaded.codec
    have = generate_responses(
        loaded.model,
        lambda p: codec.encode_chat([{"role": "user", "content": p.text}]),
        codec.eos_ids,
        prompts,
        work,
        target_tokens=args.tokens,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        # topk+neg training reads the target's top-k per answer row: keep it from the generation
        support_k=args.support_k if resolve_support(args.loss_support, vocab) == "topk+neg" else 0,
        progress=progress,
    )
    if args.generate_only:
        print(f"{have} response tokens in {work}", file=sys.stderr)
        return 0
    shards = feature_shards(work)
    cfg = TrainConfig(
        epochs=args.epochs,
        lr=args.lr,
        loss_vocab=args.loss_support,
        support_k=args.support_k,
        negatives=args.negatives,
    )
    seqs = load_sequences(shards, cfg.max_seq_len)
    head = new_eagle_for(loaded.model)
    for p in head.parameters():
        p.requires_grad_(True)
    log = train_head(head, loaded.model, seqs, work / "ckpt", cfg, progress=progress)
    save_eagle(head, args.out)
    entry = REGISTRY.get(loaded.name)
    if entry is not None and entry.notice:  # e.g. Gemma: derivatives carry the terms' notice
        (args.out / "NOTICE").write_text(entry.notice)
    info = {
        "command": "evospec " + " ".join(sys.argv[1:]),
        "target": loaded.name,
        "response_tokens": have,
        "sequences": len(seqs),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "hardware": (
            torch.cuda.get_device_name(device)
            if device.startswith("cuda")
            else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        ),
        "torch": torch.__version__,
        "train_log": log,
    }
    (args.out / "training.json").write_text(json.dumps(info, indent=2))
    print(f"saved {args.out} (holdout top-1 {log['epochs'][-1]['holdout']['top1']:.3f})", file=sys.stderr)
    return 0
