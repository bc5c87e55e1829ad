"""``evospec train-vocab``: train the DynaSpec router or the SpecVocab selector of a model.

Owns the sub-parser and its flow: load the target (fp32: the features it distils from are the
fp32 teacher's), find the cached features ``train-draft`` wrote (teacher-forcing training-side
answers first if there are none), train (``vocab_models.py``) and add the result to an index
directory (``indices/manifest.py: add_index_file``), which the ``dynaspec`` / ``specvocab``
policies then read. The router is bound to the directory's ``clusters.npy`` (built here when
missing: ``indices/clusters.py``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from evospec.common import DEFAULT_DATA, positive_int
from evospec.models.registry import DEFAULT_MODEL


def add_train_vocab_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train-vocab",
        help="train the DynaSpec router or the SpecVocab selector for a model",
        description="Distil a context-dependent vocabulary model from the target's cached features "
        "(the ones evospec train-draft caches; teacher-forced here from --data when there are none) "
        "and add it to the model's index directory: 'dynaspec' trains the MLP router over the "
        "indices' vocabulary clusters, 'specvocab' the low-rank selector that ranks candidates per "
        "draft step.",
    )
    t.add_argument("kind", choices=["dynaspec", "specvocab"], help="what to train")
    t.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="index directory to add it to (default: the model's, $EVOSPEC_HOME/indices/<model>)",
    )
    t.add_argument(
        "--work",
        type=Path,
        default=None,
        help="train-draft's work folder with the cached features (default: $EVOSPEC_HOME/train/<model>)",
    )
    t.add_argument(
        "--data",
        type=Path,
        nargs="+",
        default=[DEFAULT_DATA],
        metavar="PATH",
        help="training data to teacher-force when no features are cached (as train-draft --data)",
    )
    t.add_argument(
        "--dataset-tokens",
        type=positive_int,
        default=300_000,
        help="answer tokens to teacher-force when no features are cached (default 300k)",
    )
    t.add_argument(
        "--rows", type=positive_int, default=200_000, help="feature rows to train on (default 200k)"
    )
    t.add_argument("--epochs", type=positive_int, default=None, help="epochs (default: router 4, selector 2)")
    t.add_argument("--rank", type=positive_int, default=64, help="specvocab: selector rank (default 64)")
    t.add_argument("--hidden", type=positive_int, default=1024, help="dynaspec: router width (default 1024)")
    t.add_argument("--no-progress", action="store_true", help="hide progress bars")
    t.set_defaults(func=cmd_train_vocab)


def cmd_train_vocab(args: argparse.Namespace) -> int:
    import torch

    from evospec.common import evospec_home
    from evospec.models.loading import load_model
    from evospec.train.datagen import feature_shards
    from evospec.train.vocab_models import feature_rows, train_router, train_selector
    from evospec.vocab.config import VocabConfig
    from indices.default import ensure_indices
    from indices.manifest import CLUSTERS_FILE, DYNASPEC_FILE, SPECVOCAB_FILE, add_index_file

    progress = not args.no_progress
    loaded = load_model(args.model, progress=progress, weights="fp32")
    weight = loaded.model.lm_head.weight  # [V, D]
    if args.kind == "specvocab" and args.rank > min(weight.shape):  # before any data work
        raise ValueError(
            f"train-vocab: --rank must be at most {min(weight.shape)} (the hidden size), got {args.rank}"
        )
    need = [CLUSTERS_FILE] if args.kind == "dynaspec" else []
    bundle = ensure_indices(loaded, directory=args.out, need_hnsw=False, need_files=need, progress=progress)
    work = args.work or evospec_home() / "train" / loaded.name
    shards = feature_shards(work)
    if not shards:
        _teacher_force(loaded, args, work, progress)
        shards = feature_shards(work)
    rows = feature_rows(shards, args.rows)
    print(f"training on {rows.feats.shape[0]} feature rows from {work}", file=sys.stderr)
    defaults = VocabConfig()
    fingerprint = bundle.manifest.model_fingerprint
    with torch.inference_mode(False):
        if args.kind == "dynaspec":
            from evospec.vocab.router import save_router

            clusters = torch.as_tensor(bundle.clusters)
            model, log = train_router(
                rows,
                weight,
                clusters,
                hidden=args.hidden,
                budget=defaults.cluster_budget,
                epochs=args.epochs or 4,
                progress=progress,
            )
            name = DYNASPEC_FILE

            def write(tmp):
                save_router(model, tmp, clusters=bundle.clusters, fingerprint=fingerprint)
        else:
            from evospec.vocab.selector import save_selector

            model, log = train_selector(
                rows,
                weight,
                rank=args.rank,
                candidates=defaults.candidates,
                epochs=args.epochs or 2,
                progress=progress,
            )
            name = SPECVOCAB_FILE

            def write(tmp):
                save_selector(model, tmp, fingerprint=fingerprint)

    record = {
        "parameters": model.num_parameters(),
        "features": str(work),
        "train_log": log,
        "command": _command(args),
    }
    add_index_file(bundle.directory, weight, name, write, record, seconds=log["seconds"])
    final = log["epochs"][-1]["holdout"]
    print(
        f"added {bundle.directory / name} ({model.num_parameters():,} parameters, {log['seconds']} s; "
        f"holdout {final})",
        file=sys.stderr,
    )
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that trains this file again (from the parsed arguments, not sys.argv)."""
    parts = ["evospec", "train-vocab", args.kind, "--model", args.model, "--rows", str(args.rows)]
    if args.work is not None:
        parts += ["--work", str(args.work)]
    if args.epochs is not None:
        parts += ["--epochs", str(args.epochs)]
    parts += ["--rank", str(args.rank)] if args.kind == "specvocab" else ["--hidden", str(args.hidden)]
    return shlex.join(parts)


def _teacher_force(loaded, args: argparse.Namespace, work: Path, progress: bool) -> None:
    """Cache features for training: the datasets' own answers, teacher-forced (as train-draft)."""
    from evospec.train.conversations import training_conversations
    from evospec.train.datagen import teacher_force

    codec = loaded.codec
    if codec is None:
        raise ValueError(f"{loaded.source}: the target needs a tokenizer to render training conversations")
    eos = [*(codec.eos_ids or loaded.model.cfg.eos_token_ids)][:1]
    teacher_force(
        loaded.model,
        lambda c: (codec.encode_chat(list(c.history)), [*codec.encode_text(c.answer), *eos]),
        training_conversations(args.data),
        work,
        target_tokens=args.dataset_tokens,
        progress=progress,
    )
