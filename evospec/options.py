"""Command-line knobs shared by ``generate``, ``bench`` and ``serve``, and what they build.

Owns: the argument groups (model, draft tree, vocabulary, online adaptation, sampling) with
one set of names and defaults, and their conversion into the typed settings the rest of the
project reads: :func:`stack_settings` (-> ``assembly.StackSettings``) and
:func:`sampling_params`. The tree, vocabulary and adaptation flags are derived from the
``TreeConfig``, ``VocabConfig`` and ``AdaptConfig`` fields (``evospec/settings.py``), so their
names, types and defaults are the serve config's. Command modules register their own
sub-parsers and call these.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from evospec.adapt.config import AdaptConfig
from evospec.common import non_negative_int, positive_int
from evospec.decoding.tree_config import TreeConfig, names_a_shape
from evospec.kernels.prefetch import mode_problem
from evospec.models.registry import DEFAULT_MODEL, REGISTRY
from evospec.settings import add_section_flags, section_from_args
from evospec.vocab.config import VocabConfig

SECTIONS = {"tree": TreeConfig, "vocab": VocabConfig, "adapt": AdaptConfig}  # flag groups by config section
# Kept as text so --help does not import torch; tests/test_options.py checks it against METHODS.
METHOD_HELP = (
    "decoding method: ar | ngram (context lookup, no draft head: any model) | eagle2 | frspec | "
    "nanospec | evospec | nanospec+evospec | vocabtrim | dynaspec | "
    "specvocab | clora | osd | evospec-full | eagle3 | frspec-e3 | nanospec-e3 | evospec-e3 | "
    "nanospec+evospec-e3 | vocabtrim-e3 | dynaspec-e3 | specvocab-e3 | clora-e3 | osd-e3 | "
    "evospec-full-e3 (the *3 ones: an "
    "EAGLE-3 head, --draft3) | auto (the fastest lossless method measured on this machine, ar if none "
    "beats it)"
)
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8", "int4")  # models/quant.py WEIGHT_FORMATS + auto (tested)


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
        help="model dtype: activations, KV cache and unquantised weights (default float32)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_weights_arg(p)
    add_prefetch_arg(p)
    add_pack_arg(p)
    add_prefix_arg(p)


def add_weights_arg(p: argparse.ArgumentParser, default: str | None = "auto", *, note: str = "") -> None:
    p.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default=default,
        help="format of the target's linear weights on a CPU: int4 (a GGUF's own 4-bit codes, "
        "group 32), int8 (per row), bf16, fp32; auto = int4 on a CPU with float32 activations "
        "(int8 for gemma3-270m, whose GGUF is mostly 5-8-bit), "
        f"else fp32{note} (default: {default or 'auto'})",
    )


def prefetch_mode(text: str) -> str:
    """argparse type of ``--prefetch``: ``auto`` or ``HINT[:KIB]`` (kernels/prefetch.py)."""
    problem = mode_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_prefetch_arg(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    p.add_argument(
        "--prefetch",
        type=prefetch_mode,
        default=default,
        metavar="auto|HINT[:KIB]",
        help="how the CPU kernels prefetch the target's int4/int8 weights, read once a step: a hint "
        "-- t0/t1/t2 (into L1/L2/L3), nta (non-temporal), none (the hardware prefetchers alone) -- "
        "and how far ahead, KIB kibibytes (default 2.5); auto = the fastest one-token step of this "
        "model on this machine over 13 settings, measured once (~4 s) and cached under "
        "$EVOSPEC_HOME/tuning (on one Xeon VM nta made a step 2.6x as long as t1, and 10 KiB ahead "
        "~20%% shorter than 2.5; on a Zen 4 nta was a few %% faster). Never changes output "
        "(default: auto)",
    )


def add_pack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="keep plain fp32 CPU weights (default: reorder them once for oneDNN, which decodes "
        "and verifies faster at the cost of one extra copy of the weights)",
    )


def add_prefix_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole (default: a prompt that starts like the previous request's "
        "prompt and answer -- a chat's next turn, a shared system prompt -- keeps those cached slots "
        "and prefills the rest; output is bitwise the same either way; on where the model's forwards "
        "are row-exact: CPU, int4/int8/bf16 Llama-style models)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_int,
        default=None,
        metavar="MB",
        help="memory for the cached slots of earlier sequences besides the last one, so that a "
        "prompt sharing a long prefix with any recent request (alternating documents or system "
        "prompts) skips prefilling it (default 256; 0: the last request's only)",
    )


TREE_AUTO_DEFAULT = (
    "'auto' without measuring: the shape measured earlier on this machine, else a 1-token chain "
    "after context lookup; 'fixed' where tree flags give a shape"
)


def add_draft_args(
    p: argparse.ArgumentParser, *, overrides: bool = False, tree_default: str = TREE_AUTO_DEFAULT
) -> None:
    """The draft head, tree, verification and vocabulary flags. ``overrides`` (serve): every flag
    defaults to None, so only the flags given replace the config file's values. ``tree_default``:
    what ``--help`` says a missing ``--tree`` means (:func:`tunes_tree` decides)."""
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-2 head folder (config.json + model.safetensors or pytorch_model.bin); "
        "default: the head shipped for the model, if any",
    )
    p.add_argument(
        "--draft3",
        default=None,
        help="EAGLE-3 head folder in the public layout (config.json with draft_vocab_size + weights) for "
        "the eagle3 and *-e3 methods; default: the EAGLE-3 head shipped for the model, if any",
    )
    p.add_argument(
        "--ngrams",
        default=None,
        metavar="PATH",
        help="the model's n-gram table for --table-lookup (evospec build-ngrams makes one); 'none': "
        "no table; default: the table built for the model, else the one shipped, if any",
    )
    add_section_flags(p.add_argument_group("draft tree"), TreeConfig, "tree")
    p.add_argument(
        "--tree",
        choices=["fixed", "auto"],
        default=None,
        help="'fixed': the tree flags; 'auto': pick the fastest tree shape for this machine, "
        "model, head and method by a short calibration run on training-side prompts (cached under "
        f"$EVOSPEC_HOME/tuning). Default: {tree_default}",
    )
    p.add_argument(
        "--verify-logits",
        choices=["auto", "all", "lazy"],
        default=None if overrides else "auto",
        help="which tree nodes verification projects onto the vocabulary: 'all' (one call; best on "
        "a GPU), 'lazy' (the root, then only where the walk goes, prefetching nodes the draft "
        "expects to be accepted; best on a CPU), 'auto' = lazy on a CPU (default). Same output",
    )
    p.add_argument(
        "--draft-weights",
        choices=["auto", "fp32", "int8", "int4"],
        default=None if overrides else "auto",
        help="format of the draft head's linears for methods that do not adapt it: 'int4' = our "
        "int4 kernel with the draft step as one op (fused CPU ops, EAGLE-2 heads), 'int8' = torch's "
        "int8 kernels; 'auto' = int4 where the target runs the fused ops and the head qualifies, "
        "int8 where the target's weights are otherwise quantised, else the head's own; adapting "
        "methods keep fp32. Changes acceptance, never output",
    )
    v = p.add_argument_group("active vocabulary (frspec, nanospec, evospec, nanospec+evospec)")
    add_section_flags(v, VocabConfig, "vocab")


def add_adapt_args(p: argparse.ArgumentParser, *, debug: bool = True) -> None:
    """The adaptation flags (``debug``: also ``--adapt-sync``, inline updates)."""
    a = p.add_argument_group("online adaptation (clora, osd, evospec-full)")
    add_section_flags(a, AdaptConfig, "adapt", "adapt-")
    if debug:
        a.add_argument(
            "--adapt-sync",
            action="store_true",
            help="run gate and updates inline at the round end (debugging)",
        )


def adapt_config(args: argparse.Namespace) -> AdaptConfig:
    base = AdaptConfig(asynchronous=not getattr(args, "adapt_sync", False))
    return section_from_args(args, AdaptConfig, "adapt", base=base)


def add_sampling_args(p: argparse.ArgumentParser, max_new: int) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new, help=f"default {max_new}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same output")
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from the logit of every token generated before, -2..2 (default 0 = off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divides the positive logits (multiplies the negative ones) of every token in the prompt "
        "or generated before, 0.01..2 (vLLM's; default 1 = off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="times how often a token was generated before, -2..2 (default 0 = off)",
    )
    shape = p.add_mutually_exclusive_group()  # the output's shape: one JSON object, or a schema's
    shape.add_argument(
        "--json-mode",
        action="store_true",
        help="JSON mode: the output is one JSON object (the API's response_format json_object)",
    )
    shape.add_argument(
        "--json-schema",
        type=Path,
        metavar="PATH",
        help="the output follows the JSON schema in PATH (the API's response_format json_schema)",
    )


def sampling_params(args: argparse.Namespace):
    from evospec.decoding.penalties import Penalties
    from evospec.decoding.sampling import SamplingParams

    penalties = Penalties(args.presence_penalty, args.frequency_penalty, repetition=args.repetition_penalty)
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        penalties=penalties,
    )


def json_mode(args: argparse.Namespace, params, stack):
    """``params`` with the JSON grammar ``--json-mode`` or ``--json-schema`` asks for (a
    grammar needs the assembled ``stack``'s tokenizer, so it joins after :func:`sampling_params`);
    a schema file that cannot be read or honoured is a ValueError saying why."""
    from evospec.decoding.json_grammar import JsonGrammar
    from evospec.decoding.json_schema import OBJECT, SchemaError, compile_schema

    if args.json_schema is None and not args.json_mode:
        return params
    schema = OBJECT
    if args.json_schema is not None:
        try:
            schema = compile_schema(json.loads(args.json_schema.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:  # SchemaError and JSONDecodeError are ValueErrors
            kind = (
                "unsupported JSON schema" if isinstance(exc, SchemaError) else "cannot read the JSON schema"
            )
            raise ValueError(f"--json-schema {args.json_schema}: {kind}: {exc}") from None
    grammar = JsonGrammar(stack.json_tokens, schema)
    return replace(params, penalties=replace(params.penalties, grammar=grammar))


def vocab_config(args: argparse.Namespace) -> VocabConfig:
    return section_from_args(args, VocabConfig, "vocab")


def tree_config(args: argparse.Namespace) -> TreeConfig:
    return section_from_args(args, TreeConfig, "tree")


def section_overrides(args: argparse.Namespace) -> dict:
    """The tree / vocab / adapt keys given on the command line, as serve config overrides."""
    from evospec.settings import given_flags

    out = {name: given_flags(args, cls, name) for name, cls in SECTIONS.items()}
    return {name: keys for name, keys in out.items() if keys}


def tunes_tree(args: argparse.Namespace, *, by_default: bool) -> bool:
    """``--tree auto``, or (``by_default``) no ``--tree`` and no tree flag that gives a shape."""
    from evospec.settings import given_flags

    if args.tree is not None:
        return args.tree == "auto"
    return by_default and not names_a_shape(given_flags(args, TreeConfig, "tree"))


def stack_settings(
    args: argparse.Namespace, methods: list[str] | tuple[str, ...], *, tune_by_default: bool = False
):
    """The assembly's settings from parsed model/draft/vocabulary/adaptation flags (a missing
    ``--tree``: :func:`tunes_tree` with ``tune_by_default``)."""
    from evospec.assembly import StackSettings

    return StackSettings(
        model=args.model,
        methods=tuple(methods),
        draft=str(args.draft) if args.draft else None,
        draft3=str(args.draft3) if args.draft3 else None,
        ngrams=args.ngrams,
        tree=tree_config(args),
        tune_tree=tunes_tree(args, by_default=tune_by_default),
        vocab=vocab_config(args),
        adapt=adapt_config(args),
        verify_logits=args.verify_logits,
        draft_weights=args.draft_weights,
        prefetch=args.prefetch,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        pack_weights=not args.no_pack,
        prefix_reuse=not args.no_prefix_reuse,
        prefix_cache_mb=args.prefix_cache_mb,
    )
