"""The ``evospec-index`` command line (also ``python -m indices``): build, package, info, check.

Owns: argument parsing, choosing the corpus (training-side shared data and/or corpus files),
``package`` (the tables shipped inside the package, ``packaged.py``), and printing. Exit codes:
0 ok, 2 a usage, data, model or index error (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evospec.common import DEFAULT_DATA, check_output, positive_int
from evospec.models.registry import DEFAULT_MODEL, REGISTRY
from indices.bigram import BigramParams
from indices.corpus import REDISTRIBUTABLE, TRAINING_SOURCES, check_sources
from indices.hnsw import DEFAULT_EF, HnswParams
from indices.manifest import Manifest


def _source_list(text: str) -> list[str]:
    """argparse type: comma-separated training source names, checked."""
    try:
        return check_sources(n.strip() for n in text.split(",") if n.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--model",
        default=default,
        required=default is None,
        help=f"registered name ({', '.join(REGISTRY)}), a Hugging Face folder or a .gguf file"
        + (f" (default: {default})" if default else ""),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evospec-index",
        description="Offline indices for dynamic draft vocabularies: token frequencies, a bigram "
        "successor graph and an HNSW index over LM-head rows, bound to a model by a manifest.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "build",
        help="count a corpus and index a model's LM head into a directory",
        description="Build frequency.npy, bigram.npz, hnsw.bin and manifest.json in --out. The corpus "
        "is --training-data (training-side sets of the shared data) and/or --corpus files; "
        "evaluation sets are refused. An existing index directory at --out is replaced when the "
        "build completes.",
    )
    _model_arg(b, DEFAULT_MODEL)
    b.add_argument(
        "--corpus",
        nargs="+",
        type=Path,
        default=[],
        metavar="PATH",
        help=".txt (split at blank lines), .jsonl/.json (a record's 'text' field or all its strings) "
        "files, or folders searched recursively",
    )
    b.add_argument(
        "--training-data",
        nargs="?",
        type=Path,
        const=DEFAULT_DATA,
        default=None,
        metavar="DIR",
        help=f"add the training-side sets of a shared data folder (bare flag: {DEFAULT_DATA})",
    )
    b.add_argument(
        "--sources",
        type=_source_list,
        default=None,
        metavar="NAME,...",
        help=f"with --training-data: only these sets (default: all of {', '.join(TRAINING_SOURCES)})",
    )
    b.add_argument("--out", type=Path, required=True, help="index directory to write")
    b.add_argument(
        "--hnsw-m",
        type=positive_int,
        default=HnswParams.m,
        help=f"HNSW graph degree M (default: {HnswParams.m})",
    )
    b.add_argument(
        "--ef-construction",
        type=positive_int,
        default=HnswParams.ef_construction,
        help=f"HNSW build beam (default: {HnswParams.ef_construction})",
    )
    b.add_argument(
        "--ef",
        type=positive_int,
        default=DEFAULT_EF,
        help=f"HNSW search beam stored as the default (default: {DEFAULT_EF})",
    )
    b.add_argument(
        "--min-count",
        type=positive_int,
        default=BigramParams.min_count,
        help=f"bigram: min count(u,v) (default: {BigramParams.min_count})",
    )
    b.add_argument(
        "--min-prob",
        type=float,
        default=BigramParams.min_prob,
        help=f"bigram: min p(v|u) (default: {BigramParams.min_prob:g})",
    )
    b.add_argument(
        "--max-degree",
        type=positive_int,
        default=BigramParams.max_degree,
        help=f"bigram: successors kept per u (default: {BigramParams.max_degree})",
    )
    b.add_argument("--no-hnsw", action="store_true", help="skip the HNSW index (frequency + bigram only)")
    b.add_argument(
        "--max-tokens", type=positive_int, default=None, help="stop counting after N tokens (default: all)"
    )
    b.add_argument("--threads", type=int, default=-1, help="HNSW build threads (default: -1, every core)")
    b.add_argument("--no-progress", action="store_true", help="hide progress bars")

    k = sub.add_parser(
        "package",
        help="rebuild the index tables shipped inside the package for a model",
        description="Count the training-side sets whose licenses allow redistribution ("
        + ", ".join(REDISTRIBUTABLE)
        + ") into frequency.npy and bigram.npz (no HNSW: it is built on first use), with a "
        "manifest listing each set's license, upstream, commit and counts, the sets left out and "
        "why, and an attribution NOTICE. Default --out: the package's indices/packaged/<model>.",
    )
    _model_arg(k, DEFAULT_MODEL)
    k.add_argument(
        "--training-data",
        type=Path,
        default=DEFAULT_DATA,
        metavar="DIR",
        help=f"the shared data folder (default: {DEFAULT_DATA})",
    )
    k.add_argument(
        "--out", type=Path, default=None, help="folder to write (default: indices/packaged/<model>)"
    )
    k.add_argument("--no-progress", action="store_true", help="hide progress bars")

    v = sub.add_parser(
        "vocabtrim",
        help="add the vocabtrim table (the target's own token counts) to an index directory",
        description="Count the response_ids of generations JSONL files -- the generations.jsonl that "
        "`evospec train-draft` writes while generating the target's answers to training prompts -- into "
        "vocabtrim.npy and list it in the manifest of DIRECTORY (default: the model's index directory "
        "under $EVOSPEC_HOME). The vocabtrim policy keeps that table's top ids (VocabTrim, Goel et al. "
        "2025).",
    )
    _model_arg(v, DEFAULT_MODEL)
    v.add_argument("--generations", type=Path, nargs="+", required=True, metavar="JSONL")
    v.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="index directory to add the table to"
    )
    v.add_argument("--no-progress", action="store_true", help="hide progress bars")

    cl = sub.add_parser(
        "clusters",
        help="add the vocabulary clusters (spherical k-means over LM-head rows) to an index directory",
        description="Cluster the model's LM-head rows by spherical k-means into clusters.npy and list it "
        "in the manifest of DIRECTORY (default: the model's index directory under $EVOSPEC_HOME). The "
        "dynaspec policy activates the clusters its router picks per round; a router trained on other "
        "clusters is refused (retrain it: evospec train-vocab dynaspec).",
    )
    _model_arg(cl, DEFAULT_MODEL)
    cl.add_argument("--k", type=int, default=256, help="number of clusters (default 256, NanoSpec's)")
    cl.add_argument("--iterations", type=int, default=25, help="k-means iterations (default 25)")
    cl.add_argument("--seed", type=int, default=0, help="seed of the initial centroids (default 0)")
    cl.add_argument("--out", type=Path, default=None, metavar="DIR", help="index directory to add them to")
    cl.add_argument("--no-progress", action="store_true", help="hide progress bars")

    i = sub.add_parser("info", help="print the manifest of an index directory")
    i.add_argument("directory", type=Path)
    i.add_argument("--json", action="store_true", help="print manifest.json as is")

    c = sub.add_parser(
        "check",
        help="verify an index directory against a model (exit 0 ok, 2 with the error)",
        description="Check that DIRECTORY was built for --model (vocab size, hidden size, "
        "fingerprint) and that every file listed in its manifest is intact (size and sha256).",
    )
    _model_arg(c, None)
    c.add_argument("directory", type=Path)
    c.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def _describe(args: argparse.Namespace) -> str:
    parts = []
    if args.training_data is not None:
        chosen = f" ({', '.join(args.sources)})" if args.sources else ""
        parts.append(f"training-side sets of {args.training_data}{chosen}")
    parts += [str(p) for p in args.corpus]
    text = "; ".join(parts)
    return text + (f" (first {args.max_tokens} tokens)" if args.max_tokens else "")


def cmd_build(args: argparse.Namespace) -> int:
    from evospec.models.loading import load_model
    from indices.build import CorpusPart, build_from_texts
    from indices.corpus import corpus_files, read_corpus_files, training_texts
    from indices.default import model_source

    if args.training_data is None and not args.corpus:
        raise ValueError("nothing to count: give --training-data [DIR] and/or --corpus PATH...")
    if args.sources and args.training_data is None:
        raise ValueError("--sources picks training-side sets: give --training-data [DIR] too")
    files = corpus_files(args.corpus)  # checked before the model loads
    check_output(args.out, "--out", folder=True)
    if args.training_data is not None and not Path(args.training_data).is_dir():
        raise FileNotFoundError(f"{args.training_data}: shared data folder not found")
    progress = not args.no_progress
    loaded = load_model(args.model, progress=progress)
    if loaded.codec is None:
        raise ValueError(f"{args.model}: the model carries no tokenizer, cannot tokenize a corpus")
    parts: list[CorpusPart] = []
    if args.training_data is not None:
        data = Path(args.training_data)
        for name in args.sources or TRAINING_SOURCES:
            s = TRAINING_SOURCES[name]
            parts.append(
                CorpusPart(name, training_texts(data, [name]), s.license, f"{s.upstream}; {data / s.folder}")
            )
    if files:
        parts.append(
            CorpusPart("corpus files", read_corpus_files(files), origin=", ".join(map(str, args.corpus)))
        )
    manifest = build_from_texts(
        loaded.model.lm_head.weight,
        loaded.codec,
        parts,
        args.out,
        max_tokens=args.max_tokens,
        progress=progress,
        model_name=loaded.name,
        model_source=model_source(loaded),
        corpus_description=_describe(args),
        bigram_params=BigramParams(args.min_count, args.min_prob, args.max_degree),
        hnsw_params=HnswParams(m=args.hnsw_m, ef_construction=args.ef_construction, ef=args.ef),
        hnsw=not args.no_hnsw,
        hnsw_threads=args.threads,
    )
    print(f"wrote {args.out}")
    print(summary(manifest))
    return 0


def summary(m: Manifest) -> str:
    hnsw = (
        f"M={m.hnsw.params.m} ef_construction={m.hnsw.params.ef_construction} ef={m.hnsw.params.ef} "
        f"max_norm={m.hnsw.max_norm:.4g}"
        if m.hnsw
        else "none (built with --no-hnsw)"
    )
    lines = [
        f"model:    {m.model_name} ({m.model_source}), vocab {m.vocab_size} x hidden {m.hidden_size}",
        f"          fingerprint {m.model_fingerprint}",
        f"corpus:   {m.corpus.description}",
        f"          {m.corpus.num_documents} documents, {m.corpus.num_tokens} tokens",
        *(
            f"          - {x.name}: {x.num_documents} documents, {x.num_tokens} tokens"
            + (f" ({x.license})" if x.license else "")
            for x in m.corpus.sources
        ),
        *(f"          left out {name}: {why}" for name, why in m.corpus.left_out.items()),
        f"bigram:   {m.num_edges} edges (min_count={m.bigram.min_count} min_prob={m.bigram.min_prob:g} "
        f"max_degree={m.bigram.max_degree})",
        f"hnsw:     {hnsw}",
        "files:    " + ", ".join(f"{name} {e.size / 1e6:.2f} MB" for name, e in m.files.items()),
        "seconds:  " + ", ".join(f"{k} {v:.1f}" for k, v in m.build_seconds.items()),
        f"created:  {m.created} (format {m.format_version})",
    ]
    if m.corpus.command:
        lines.append(f"rebuild:  {m.corpus.command}")
    return "\n".join(lines)


def cmd_package(args: argparse.Namespace) -> int:
    from evospec.models.loading import load_model
    from indices.default import model_source
    from indices.packaged import PACKAGED_ROOT, build_packaged

    if not Path(args.training_data).is_dir():
        raise FileNotFoundError(f"{args.training_data}: shared data folder not found")
    progress = not args.no_progress
    loaded = load_model(args.model, progress=progress)
    if loaded.codec is None:
        raise ValueError(f"{args.model}: the model carries no tokenizer, cannot tokenize a corpus")
    out = args.out if args.out is not None else PACKAGED_ROOT / loaded.name
    manifest = build_packaged(
        loaded.model.lm_head.weight,
        loaded.codec,
        args.training_data,
        out,
        model_name=loaded.name,
        model_source=model_source(loaded),
        command=_package_command(args),
        progress=progress,
    )
    print(f"wrote {out}")
    print(summary(manifest))
    return 0


def _package_command(args: argparse.Namespace) -> str:
    out = f" --out {args.out}" if args.out is not None else ""
    return f"evospec-index package --model {args.model} --training-data {args.training_data}{out}"


def cmd_vocabtrim(args: argparse.Namespace) -> int:
    from evospec.models.loading import load_model
    from indices.default import default_index_dir
    from indices.vocabtrim import add_vocabtrim, count_generations

    loaded = load_model(args.model, progress=not args.no_progress)
    weight = loaded.model.lm_head.weight
    directory = args.out or default_index_dir(loaded.name)
    counts, info = count_generations(args.generations, weight.shape[0])
    add_vocabtrim(directory, weight, counts, info)
    print(
        f"{directory}: vocabtrim table of {info['tokens']} tokens in {info['sequences']} answers "
        f"({info['distinct_ids']} distinct ids)"
    )
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from evospec.models.loading import load_model
    from indices.clusters import add_clusters
    from indices.default import default_index_dir

    loaded = load_model(args.model, progress=not args.no_progress)
    directory = args.out or default_index_dir(loaded.name)
    command = f"evospec-index clusters --model {args.model} --k {args.k} --iterations {args.iterations}"
    m = add_clusters(
        directory,
        loaded.model.lm_head.weight,
        args.k,
        iterations=args.iterations,
        seed=args.seed,
        command=command,
    )
    rec = m.extras["clusters.npy"]
    print(f"{directory}: {args.k} clusters of {rec['smallest']}..{rec['largest']} ids")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from indices.manifest import MANIFEST_NAME, read_manifest

    manifest = read_manifest(args.directory)
    if args.json:
        print((Path(args.directory) / MANIFEST_NAME).read_text(), end="")
    else:
        print(summary(manifest))
    return 0


def _check_trained(bundle) -> None:
    """The trained files load against what the bundle holds now (ValueError naming a mismatch): a
    DynaSpec router against the clusters it was trained on (``evospec-index clusters`` rebuilt
    them since: a stale router), a SpecVocab selector against the vocabulary and hidden sizes."""
    fingerprint = bundle.manifest.model_fingerprint
    if bundle.dynaspec is not None:
        from evospec.vocab.router import load_router

        if bundle.clusters is None:
            raise ValueError("the DynaSpec router is there but clusters.npy is not (evospec-index clusters)")
        load_router(bundle.dynaspec, clusters=bundle.clusters, fingerprint=fingerprint)
    if bundle.specvocab is not None:
        from evospec.vocab.selector import load_selector

        vocab_size, dim = bundle.counts.size, bundle.manifest.hidden_size
        load_selector(bundle.specvocab, vocab_size=vocab_size, dim=dim, fingerprint=fingerprint)


def cmd_check(args: argparse.Namespace) -> int:
    from evospec.models.loading import load_model
    from indices.manifest import load_indices, read_manifest

    manifest = read_manifest(args.directory)  # a missing directory fails before the model loads
    loaded = load_model(args.model, progress=not args.no_progress)
    bundle = load_indices(args.directory, loaded.model.lm_head.weight, need_hnsw=manifest.hnsw is not None)
    _check_trained(bundle)
    print(
        f"ok: {args.directory} matches {args.model} ({len(bundle.manifest.files)} files verified, "
        f"hnsw {'present' if bundle.hnsw is not None else 'absent'})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evospec.models.config import UnsupportedModelError
    from evospec.models.errors import CheckpointError

    commands = {
        "build": cmd_build,
        "package": cmd_package,
        "vocabtrim": cmd_vocabtrim,
        "clusters": cmd_clusters,
        "info": cmd_info,
        "check": cmd_check,
    }
    try:
        return commands[args.command](args)
    except (CheckpointError, UnsupportedModelError, ValueError, OSError) as exc:  # OSError: an unusable path
        print(f"evospec-index: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
