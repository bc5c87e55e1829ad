"""Command-line knobs shared by ``generate``, ``bench`` and ``serve``, and what they build.

Owns: the argument groups (model, draft tree, vocabulary, online adaptation, sampling) with
one set of names and defaults, and their conversion into the typed settings the rest of the
project reads: :func:`stack_settings` (-> ``assembly.StackSettings``) and
:func:`sampling_params`. Command modules register their own sub-parsers and call these.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evospec.common import positive_int
from evospec.models.registry import DEFAULT_MODEL, REGISTRY

# Kept as text so --help does not import torch; tests/test_options.py checks it against METHODS.
METHOD_HELP = (
    "decoding method: ar | eagle2 | frspec | nanospec | evospec | nanospec+evospec | clora | osd | "
    "evospec-full | auto (the fastest lossless method measured on this machine, ar if none beats it)"
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registered name ({', '.join(REGISTRY)}), a Hugging Face folder or a .gguf file "
        f"(default: {DEFAULT_MODEL})",
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, auto (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="weights dtype (default float32; the fastest on a CPU)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_pack_arg(p)


def add_pack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="keep plain fp32 CPU weights (default: reorder them once for oneDNN, which decodes "
        "and verifies faster at the cost of one extra copy of the weights)",
    )


def add_draft_args(p: argparse.ArgumentParser) -> None:
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


def add_adapt_args(p: argparse.ArgumentParser) -> None:
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


def adapt_config(args: argparse.Namespace):
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


def add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new, help=f"default {max_new}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")


def sampling_params(args: argparse.Namespace):
    from evospec.decoding.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def vocab_config(args: argparse.Namespace):
    from evospec.vocab.factory import VocabConfig

    return VocabConfig(
        frspec_k=args.frspec_k, core_k=args.core_k, w_max=args.w_max, arc_capacity=args.arc_capacity
    )


def tree_config(args: argparse.Namespace):
    from evospec.decoding.tree import TreeConfig

    return TreeConfig(top_k=args.tree_top_k, depth=args.depth, total_tokens=args.total_tokens)


def stack_settings(args: argparse.Namespace, methods: list[str] | tuple[str, ...]):
    """The assembly's settings from parsed model/draft/vocabulary/adaptation flags."""
    from evospec.adapt.config import AdaptConfig
    from evospec.assembly import StackSettings

    return StackSettings(
        model=args.model,
        methods=tuple(methods),
        draft=str(args.draft) if args.draft else None,
        tree=tree_config(args),
        tune_tree=args.tree == "auto",
        vocab=vocab_config(args),
        indices=str(args.indices) if args.indices else None,
        adapt=adapt_config(args) if hasattr(args, "adapt_lr") else AdaptConfig(),
        verify_logits=args.verify_logits,
        device=args.device,
        dtype=args.dtype,
        pack_weights=not args.no_pack,
    )
