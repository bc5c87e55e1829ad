"""``evospec train-draft``: cache the target's features and distributions, train a head.

Owns: the ``train-draft`` sub-parser; turning its arguments into the data stage
(``datagen.py``: the target's own answers, generated, and/or the datasets' answers,
teacher-forced), the training run (``trainer.py``) and the saved head with its
``training.json`` record; stopping cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from evospec.common import (
    DEFAULT_DATA,
    check_output,
    non_negative_int,
    positive_float,
    positive_int,
    stop_cleanly_on_sigterm,
)
from evospec.models.registry import DEFAULT_MODEL, REGISTRY
from evospec.options import add_weights_arg


def add_train_draft_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``train-draft`` on the top-level sub-parsers."""
    t = sub.add_parser(
        "train-draft",
        help="train an EAGLE-2 draft head for a target",
        description="Cache the target's features and next-token distributions over training text -- its "
        "own greedy answers to training prompts (generated) and/or the datasets' own answers (one "
        "teacher-forced pass, several times faster per token) -- then train an EAGLE-2 draft head, "
        "optionally unrolled on its own features for several steps, and save it in the EAGLE-2 "
        "format (fp16). Both data stages are resumable.",
    )
    t.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    t.add_argument(
        "--out", type=Path, default=None, help="output folder for the head (required unless --generate-only)"
    )
    t.add_argument(
        "--data",
        type=Path,
        nargs="+",
        default=[DEFAULT_DATA],
        metavar="PATH",
        help="training data: the shared data folder (its training-side sets; evaluation sets are "
        'refused) and/or JSONL files of {"prompt": ...} records (prompts for generation) or '
        '{"messages": [..., {"role": "assistant", ...}]} conversations (teacher-forced answers; their '
        "last user turn is also a prompt) (default: ../shared/data next to the checkout)",
    )
    t.add_argument(
        "--work",
        type=Path,
        default=None,
        help="work folder for generations, features, checkpoints (default: $EVOSPEC_HOME/train/<target>, "
        "<target>+<weights> for quantised teachers)",
    )
    add_weights_arg(
        t,
        default="fp32",
        note="; the teacher's format: its features and distributions are what the head learns, so "
        "train with the format you serve (the shipped heads: fp32)",
    )
    t.add_argument(
        "--tokens", type=positive_int, default=200_000, help="response tokens to generate (default 200k)"
    )
    t.add_argument(
        "--sources",
        nargs="+",
        default=None,
        metavar="NAME",
        help="keep only these prompt sources of --data (e.g. arena_hard oasst; a JSONL file's source "
        "is its name without .jsonl), before --skip-prompts; default: all",
    )
    t.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=256,
        help="longest chat-formatted prompt answered; longer ones are skipped (default 256; "
        "raise it for long-document prompts: the generation cache grows to fit)",
    )
    t.add_argument(
        "--skip-prompts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="generate answers from the (N+1)-th prompt of the seeded training mix on: new prompts for a "
        "head continued with --init, whose own answers to the first N are not cached here (default 0)",
    )
    t.add_argument(
        "--source",
        choices=["generated", "dataset", "mix"],
        default="generated",
        help="training text: 'generated' (the target's greedy answers to training prompts, --tokens), "
        "'dataset' (the training sets' own answers, teacher-forced, --dataset-tokens), 'mix' (both; "
        "default: generated)",
    )
    t.add_argument(
        "--dataset-tokens",
        type=positive_int,
        default=1_000_000,
        help="answer tokens to teacher-force from the datasets' answers (default 1M)",
    )
    t.add_argument(
        "--arch",
        choices=["eagle2", "eagle3"],
        default="eagle2",
        help="head architecture: 'eagle2' (the target's final features; the public EAGLE-1/2 layout) or "
        "'eagle3' (three target layers fused, its own full-vocabulary LM head, token loss only; the "
        "public EAGLE-3 layout; trains on the target's stored top-k, so --loss-support topk+neg data) "
        "(default: eagle2)",
    )
    t.add_argument(
        "--lm-head",
        choices=["target", "own"],
        default="target",
        help="eagle3: 'target' drafts through the target's LM head (tied, frozen, not saved: a third the "
        "size; policies apply) or 'own' trains the head's own full-vocabulary LM head, initialised from "
        "the target's (default: target)",
    )
    t.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="K",
        help="eagle3: give the head its own LM head over a reduced draft vocabulary of the K target ids "
        "the target predicts most often in the training data (plus its EOS ids), saved as the public "
        "d2t/t2d buffers; the loss is the target's distribution restricted to those ids. Such a head "
        "drafts with the eagle3 method only (the vocabulary policies need a full-vocabulary head) "
        "(default: the full vocabulary)",
    )
    t.add_argument("--epochs", type=positive_int, default=4, help="training epochs (default 4)")
    t.add_argument(
        "--steps",
        type=positive_int,
        default=1,
        help="draft steps unrolled on the head's own features during training, each with a loss "
        "(HASS uses 3; default 1, the EAGLE-1 recipe)",
    )
    t.add_argument(
        "--step-decay", type=float, default=0.8, help="loss weight of step s is DECAY**(s-1) (default 0.8)"
    )
    t.add_argument(
        "--reg-weight",
        type=float,
        default=1.0,
        help="weight of the feature-regression loss (0 = token loss only; default 1.0, EAGLE's)",
    )
    t.add_argument(
        "--device",
        default="auto",
        help="torch device for generation and training: auto (cuda when present, else cpu), cpu, "
        "cuda, cuda:1 (default: auto)",
    )
    t.add_argument(
        "--generate-only",
        action="store_true",
        help="stop after the data stage (grow the cached answers and features, e.g. on a faster "
        "machine or over several sessions; a later run without it trains on all of them)",
    )
    t.add_argument(
        "--features",
        choices=["cached", "on-the-fly"],
        default="cached",
        help="'cached': the data stage stores the target's features (and top-k) on disk, ~2.5 GB per "
        "million answer tokens, and training reads them (fastest per epoch on a CPU); 'on-the-fly': "
        "it stores token ids only and training runs the target over each batch for its features and "
        "full next-token distribution (no cache; the better choice on a GPU, where that pass is cheap) "
        "(default: cached)",
    )
    t.add_argument(
        "--train-seconds",
        type=positive_float,
        default=None,
        metavar="S",
        help="on-the-fly: stop training after S seconds (the learning rate decays over them); "
        "default: --epochs only",
    )
    t.add_argument(
        "--tokens-per-batch",
        type=positive_int,
        default=2048,
        help="padded tokens per training batch (default 2048; larger on a GPU, e.g. 16384)",
    )
    t.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    t.add_argument(
        "--init",
        default=None,
        metavar="HEAD",
        help="start from this EAGLE-2 head folder ('shipped': the head shipped for the target) instead "
        "of a random one, e.g. to train an existing head on more data or for more steps",
    )
    t.add_argument(
        "--widen-mlp",
        type=positive_int,
        default=None,
        metavar="N",
        help="EAGLE-2 with --init: grow the head's MLP to N units before training, the new units "
        "starting silent (the grown head drafts exactly as --init does; training uses the room)",
    )
    t.add_argument("--batch-size", type=positive_int, default=16, help="generation batch size (default 16)")
    t.add_argument("--max-new-tokens", type=positive_int, default=192, help="answer length cap (default 192)")
    t.add_argument(
        "--loss-support",
        choices=["auto", "full", "data", "topk+neg"],
        default="auto",
        help="vocabulary rows of the soft cross-entropy: 'full'; 'data' (ids seen in the data); "
        "'topk+neg' (the target's top-k per pair plus sampled negatives, for huge vocabularies); "
        "'auto' = topk+neg for vocabularies >= 128k, else data (default)",
    )
    t.add_argument(
        "--support-k", type=positive_int, default=32, help="topk+neg: target top-k per pair (default 32)"
    )
    t.add_argument(
        "--negatives",
        type=positive_int,
        default=1024,
        help="topk+neg: uniformly sampled negative ids per step (default 1024)",
    )
    t.add_argument("--no-progress", action="store_true", help="hide progress bars")
    t.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from evospec.common import evospec_home
    from evospec.models.eagle import save_eagle
    from evospec.models.eagle3 import default_aux_layers, new_eagle3_for
    from evospec.models.loading import load_model, resolve_device
    from evospec.train.conversations import training_conversations
    from evospec.train.datagen import feature_shards, generate_responses, teacher_force
    from evospec.train.prompts import select_sources, training_prompts
    from evospec.train.support import resolve_support
    from evospec.train.trainer import TrainConfig, load_sequences, train_head

    if args.widen_mlp is not None and (args.arch != "eagle2" or args.init is None):
        raise ValueError("--widen-mlp N grows an EAGLE-2 head given as --init (add --init HEAD)")
    if args.draft_vocab and (args.arch != "eagle3" or args.lm_head != "own"):
        raise ValueError("--draft-vocab K needs --arch eagle3 --lm-head own (a reduced LM head of its own)")
    if args.out is None and not args.generate_only:
        raise ValueError("train-draft: --out is required (the head's folder) unless --generate-only")
    check_output(args.out, "--out", folder=True)
    onthefly = args.features == "on-the-fly"
    if onthefly and (args.arch != "eagle2" or args.loss_support not in ("auto", "full")):
        raise ValueError(
            "--features on-the-fly trains EAGLE-2 heads on the target's full distribution "
            "(drop --arch eagle3 and --loss-support, or use --features cached)"
        )
    if args.train_seconds is not None and not onthefly:
        raise ValueError("--train-seconds bounds on-the-fly training (--features on-the-fly)")
    stop_cleanly_on_sigterm()  # `kill` / `docker stop`: finished answers are flushed, not lost
    progress = not args.no_progress
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    cfg = TrainConfig(  # checked before anything loads
        epochs=args.epochs,
        lr=args.lr,
        loss_vocab=args.loss_support,
        support_k=args.support_k,
        negatives=args.negatives,
        steps=args.steps,
        step_decay=args.step_decay,
        w_reg=args.reg_weight,
        tokens_per_batch=args.tokens_per_batch,
    )
    loaded = load_model(args.target, device=device, progress=progress, weights=args.weights)
    from evospec.models.prefetch import choose_prefetch

    prefetch = choose_prefetch(loaded)  # answers are decoded: the machine's fastest weight prefetch
    if prefetch is not None:
        print(prefetch.describe(), file=sys.stderr)
    if loaded.codec is None:
        raise ValueError(f"{loaded.source}: the target needs a tokenizer to render training prompts")
    teacher = loaded.name if loaded.weights == "fp32" else f"{loaded.name}+{loaded.weights}"
    work = args.work or evospec_home() / "train" / teacher  # one teacher's data per folder
    vocab = loaded.model.cfg.vocab_size
    prompts = select_sources(training_prompts(args.data), args.sources)[args.skip_prompts :]
    codec = loaded.codec
    support = resolve_support(args.loss_support, vocab)
    have = taught = 0
    if args.source in ("generated", "mix"):
        have = generate_responses(
            loaded.model,
            lambda p: codec.encode_chat([{"role": "user", "content": p.text}]),
            codec.eos_ids,
            prompts,
            work,
            target_tokens=args.tokens,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            cache_len=args.max_prompt_tokens + 2 * args.max_new_tokens,
            # topk+neg training reads the target's top-k per answer row: keep it from the generation
            support_k=args.support_k if support == "topk+neg" else 0,
            store_features=not onthefly,
            progress=progress,
        )
    if onthefly:  # token ids only: dataset answers are read as they are, when training
        if args.generate_only:
            print(f"{have} generated answer tokens in {work}", file=sys.stderr)
            return 0
        return _train_onthefly(args, loaded, codec, work, cfg, progress, t0)
    if args.source in ("dataset", "mix"):
        eos = [*(codec.eos_ids or loaded.model.cfg.eos_token_ids)][:1]  # the answer ends as generated ones do
        taught = teacher_force(
            loaded.model,
            lambda c: (codec.encode_chat(list(c.history)), [*codec.encode_text(c.answer), *eos]),
            training_conversations(args.data),
            work,
            target_tokens=args.dataset_tokens,
            support_k=args.support_k,  # the agreement label and the top-k loss need it
            progress=progress,
        )
    if args.generate_only:
        print(f"{have} generated and {taught} teacher-forced answer tokens in {work}", file=sys.stderr)
        return 0
    shards = feature_shards(work, generated=args.source != "dataset", teacher=args.source != "generated")
    init = args.init
    if init == "shipped":
        from evospec.models.registry import default_head

        init = default_head(loaded.name, arch=args.arch)
        if init is None:
            raise ValueError(f"--init shipped: no {args.arch} head ships for {loaded.name}")
    if args.arch == "eagle3":
        # a new reduced-vocabulary head is made once its data is read: its rows come from it
        later = args.draft_vocab is not None and init is None
        head = (
            None
            if later
            else _eagle3_head(loaded.model, init, device, args.lm_head == "target", args.draft_vocab)
        )
        layers = default_aux_layers(loaded.model.cfg.num_layers) if later else head.aux_layers
        seqs = load_sequences(shards, cfg.max_seq_len, _aux_shards(loaded.model, shards, layers, progress))
        if later:  # its rows: the ids the target predicts most often here
            eos = tuple(codec.eos_ids or loaded.model.cfg.eos_token_ids)
            ids = frequent_targets(seqs, args.draft_vocab, loaded.model.cfg.vocab_size, eos)
            head = new_eagle3_for(loaded.model, aux_layers=layers, draft_ids=ids)
    else:
        seqs = load_sequences(shards, cfg.max_seq_len)
        head = _eagle2_head(loaded.model, init, device, args.widen_mlp)
    for p in head.parameters():
        p.requires_grad_(True)
    ckpt = work / ("ckpt" if args.arch == "eagle2" else f"ckpt-{args.arch}")
    log = train_head(head, loaded.model, seqs, ckpt, cfg, progress=progress)
    if args.arch == "eagle3":
        from evospec.models.eagle3 import save_eagle3

        save_eagle3(head, args.out)
    else:
        save_eagle(head, args.out)
    return _finish(args, loaded, device, init, t0, log, have, taught, len(seqs))


def _finish(
    args, loaded, device: str, init, t0: float, log: dict, have: int, taught: int, sequences: int
) -> int:
    """Write ``training.json`` (and the model's NOTICE where its terms ask for one) beside the
    saved head and report its held-out agreement."""
    import torch

    info = {
        "command": "evospec " + " ".join(sys.argv[1:]),
        "target": loaded.name,
        "arch": args.arch,
        "lm_head": args.lm_head if args.arch == "eagle3" else "target",
        "teacher_weights": loaded.weights,
        "features": args.features,
        "source": args.source,
        "init": str(init) if init else None,
        "sources": args.sources,
        "skip_prompts": args.skip_prompts,
        "response_tokens": have,
        "teacher_forced_tokens": taught,
        "sequences": sequences,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "hardware": _hardware(device),
        "torch": torch.__version__,
        "train_log": log,
    }
    entry = REGISTRY.get(loaded.name)
    if entry is not None and entry.notice:  # e.g. Gemma: derivatives carry the terms' notice
        (args.out / "NOTICE").write_text(entry.notice)
    (args.out / "training.json").write_text(json.dumps(info, indent=2))
    print(f"saved {args.out} (holdout top-1 {log['epochs'][-1]['holdout']['top1']:.3f})", file=sys.stderr)
    return 0


def _hardware(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def _train_onthefly(args, loaded, codec, work: Path, cfg, progress: bool, t0: float) -> int:
    """Train on the token ids of ``work``'s answers (and the datasets' answers with ``--source
    dataset|mix``), the target's features computed per batch (``onthefly.py``)."""
    from evospec.models.eagle import save_eagle
    from evospec.models.registry import default_head
    from evospec.train.conversations import training_conversations
    from evospec.train.datagen import generated_records
    from evospec.train.onthefly import Budget, token_seq, train_head_onthefly

    seqs, have, taught = [], 0, 0
    if args.source in ("generated", "mix"):
        for r in generated_records(work):
            if len(r["response_ids"]) >= 2:
                seqs.append(token_seq(r["prompt_ids"], r["response_ids"], cfg.max_seq_len))
                have += len(r["response_ids"])
    if args.source in ("dataset", "mix"):
        eos = [*(codec.eos_ids or loaded.model.cfg.eos_token_ids)][:1]
        for c in training_conversations(args.data):
            if taught >= args.dataset_tokens:
                break
            answer = [*codec.encode_text(c.answer), *eos]
            if len(answer) >= 2:
                seqs.append(
                    token_seq(codec.encode_chat(list(c.history)), answer, cfg.max_seq_len, greedy=False)
                )
                taught += len(answer)
    if not seqs:
        raise ValueError(f"{work}: no answers to train on (run the data stage first, or --source dataset)")
    init = default_head(loaded.name) if args.init == "shipped" else args.init
    if args.init == "shipped" and init is None:
        raise ValueError(f"--init shipped: no eagle2 head ships for {loaded.name}")
    device = str(loaded.model.device)
    head = _eagle2_head(loaded.model, init, device, args.widen_mlp)
    head = head.to(device)
    for p in head.parameters():
        p.requires_grad_(True)
    log = train_head_onthefly(
        head,
        loaded.model,
        seqs,
        cfg,
        Budget(epochs=args.epochs, seconds=args.train_seconds),
        progress=progress,
    )
    save_eagle(head, args.out)
    return _finish(args, loaded, device, init, t0, log, have, taught, len(seqs))


def _eagle2_head(target, init, device: str, widen: int | None = None):
    """A new EAGLE-2 head for ``target``, or ``init``'s, its MLP grown to ``widen`` units."""
    from evospec.models.eagle import load_eagle, new_eagle_for, widen_mlp

    if init is None:
        return new_eagle_for(target)
    head = load_eagle(init, device=device).attach(target)
    return head if widen is None else widen_mlp(head, widen)


def _eagle3_head(target, init, device: str, tied: bool, draft_vocab: int | None = None):
    """A new EAGLE-3 head for ``target`` (its LM head the target's, or its own initialised from
    the target's rows), or ``init``'s (its draft vocabulary must be ``draft_vocab`` ids when given)."""
    from evospec.models.eagle3 import load_eagle3, new_eagle3_for

    if init is None:
        return new_eagle3_for(target, tied=tied)
    head = load_eagle3(init, target_layers=target.cfg.num_layers, device=device).attach(target)
    have = head.draft_vocab if head.draft_ids() is not None else None
    if draft_vocab is not None and have != draft_vocab:
        raise ValueError(
            f"--init {init}: its draft vocabulary is {have or 'the full one'}, "
            f"not --draft-vocab {draft_vocab}"
        )
    return head


def frequent_targets(seqs, k: int, vocab_size: int, always: tuple[int, ...] = ()):
    """The ``k`` target ids that are most often the target's next token over ``seqs`` (its greedy
    token where stored, else the data's next token), ``always`` included; sorted [k] int64."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:  # the answer rows' next tokens: what a draft must propose
        labels = s.greedy if s.greedy is not None else s.tokens[s.prompt_len :]
        counts += torch.bincount(labels.long(), minlength=vocab_size).double()
    counts[list(always)] = float("inf")  # EOS ends answers: a draft must be able to propose it
    k = min(k, vocab_size)
    return counts.topk(k).indices.sort().values


def _aux_shards(target, shards: list[Path], layers: tuple[int, ...], progress: bool) -> list[Path]:
    """The aux shard of every feature shard (written where missing: ``aux_features.py``)."""
    from evospec.train.aux_features import aux_dir, write_aux_features

    works = list(dict.fromkeys(s.parent.parent for s in shards))  # the generated and teacher stages
    for w in works:
        write_aux_features(target, w, layers, progress=progress)
    return [aux_dir(s.parent.parent, layers) / s.name for s in shards]
