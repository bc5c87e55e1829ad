"""One assembly for ``generate``, ``bench`` and ``serve``: settings in, a loaded :class:`Stack` out.

Owns: loading the target with its tokenizer (every entry point handles text, so a model
without one is a ValueError), the draft head (the head shipped for the model unless a path
is given) when a method drafts, the model's index bundle when a method's vocabulary policy
reads it (``indices.default.ensure_indices``: loaded, or built once on first use), the tree
of each method (fixed, or tuned on this machine by ``decoding/tune.py``), and one decoder per
method (``decoding/methods.py: make_decoder``). What a method needs is read off its
:class:`~evospec.decoding.methods.MethodSpec`. Everything it loaded is listed in
``Stack.facts`` (the lines ``serve`` prints). Knows nothing about argparse or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evospec.adapt.config import AdaptConfig
from evospec.common import trim_heap
from evospec.decoding.methods import Decoder, MethodSpec, draft_format, make_decoder, method_spec
from evospec.decoding.pausable import Steps
from evospec.decoding.recording import record_steps
from evospec.decoding.tree_config import TreeConfig
from evospec.kernels.prefetch import mode_problem as prefetch_problem
from evospec.models.registry import DEFAULT_MODEL
from evospec.vocab.config import VocabConfig

if TYPE_CHECKING:
    from evospec.decoding.tune import Choice

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # a method name that resolves to the fastest lossless method measured here
# what a server says while a tuned tree is measured beside serving
TREE_FACT = (
    "serving a 1-token chain after context lookup while the shapes are timed against ar in the "
    "engine's idle time; the choice is cached for later starts"
)


@dataclass(frozen=True)
class StackSettings:
    """What to load and which decoders to build (the knobs shared by generate, bench, serve)."""

    model: str = DEFAULT_MODEL  # registered name, Hugging Face folder or .gguf file
    methods: tuple[str, ...] = ("ar",)  # decoders to build, by method name (or "auto")
    draft: str | None = None  # EAGLE-2 head folder; None: the head shipped for the model
    draft3: str | None = None  # EAGLE-3 head folder (the *-e3 methods); None: the one shipped, if any
    # n-gram table file (tree.table_lookup); None: the one built for the model, else the one
    # shipped, if any; "none": no table
    ngrams: str | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)  # the shape when not tuned
    tune_tree: bool = False  # True: the fastest shape measured on this machine (``--tree auto``)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)  # mode: each method's own
    verify_logits: str = "auto"  # see decoding/methods.py: VERIFY_LOGITS
    draft_weights: str = "auto"  # see decoding/methods.py: drafting_head
    prefetch: str = "auto"  # target weights' prefetch: "auto" (measured, cached) or HINT[:KIB]
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", "auto"
    dtype: str = "float32"  # one of DTYPES
    weights: str = "fp32"  # linear weight format: models/quant.py WEIGHT_FORMATS or "auto"
    pack_weights: bool = True  # CPU fp32: oneDNN-packed linears
    prefix_reuse: bool = True  # decoders keep the slots a prompt shares with the last request
    # and snapshots of earlier sequences in this much (None: prefix.STORE_MB)
    prefix_cache_mb: int | None = None

    def __post_init__(self) -> None:
        for spec in self.specs:  # unknown names: ValueError listing the methods
            problem = self.vocab.budget_problem(spec.policy) if spec.policy else None
            if problem:
                raise ValueError(problem)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if prefetch_problem(self.prefetch):
            raise ValueError(prefetch_problem(self.prefetch))

    @property
    def specs(self) -> list[MethodSpec]:
        """The named methods' specs; "auto" stands for its candidates."""
        from evospec.decoding.tune import AUTO_CANDIDATES

        names = [c for n in self.methods for c in (AUTO_CANDIDATES if n == AUTO else (n,))]
        return [method_spec(n) for n in dict.fromkeys(names)]


@dataclass
class Deferred:
    """A timing still to be made on this machine -- ``--method auto``'s, or ``--tree auto``'s for
    the method served -- while ``provisional`` serves: its pausable steps (``decoding/
    pausable.py``; a server's engine runs them in idle time, ``service/idle.py``) and how to
    build the decoder of what they choose."""

    label: str  # "method auto" or "tree auto for <method>": what the log lines start with
    timing: str  # what is timed: "the candidates" (methods) or "the shapes" (trees)
    provisional: str  # the method whose decoder serves meanwhile (stack.decoders' key)
    steps: Callable[[], Steps[Choice]]  # Tuner.method_steps over the candidates, or tree_steps
    build: Callable[[str, TreeConfig], Decoder]

    def finish(self, stack: Stack, choice: Choice) -> Decoder:
        """The chosen method's decoder (recorded, with the tree it was measured at), now in the
        stack's decoders; the decoder that served meanwhile is left to its user to close."""
        name, tree, _ = choice
        decoder = self.build(name, tree or stack.settings.tree)
        record_steps(stack.loaded.model, [decoder])
        stack.decoders.pop(self.provisional, None)
        stack.decoders[name] = decoder
        if stack.resolved.get(AUTO) == self.provisional:  # auto resolves to the choice now
            stack.resolved[AUTO] = name
        stack.deferred = None
        shape = f"; tree {tree}" if self.timing == "the shapes" else ""  # what a tree's timing chose
        stack.facts.append(f"{self.label}: {choice_fact(choice)}{shape}")
        trim_heap()  # the candidates' decoders, drafts and vocabularies timed and dropped: ~370 MB
        return decoder


@dataclass
class Stack:
    """A loaded target with one decoder per method, and what went into them."""

    settings: StackSettings
    loaded: Any  # evospec.models.loading.LoadedModel
    eos_ids: tuple[int, ...]
    draft: Any | None  # EagleHead shared by the speculative decoders (adaptive ones clone it)
    draft_path: Path | None
    indices: Any | None  # indices.IndexBundle
    decoders: dict[str, Decoder]  # by method name; "auto" is resolved (see ``resolved``)
    facts: list[str]  # one line per loaded part
    resolved: dict[str, str] = field(default_factory=dict)  # "auto" -> the method it chose
    ngrams: Any | None = None  # the model's n-gram table (decoding/ngram_table.py), if one was found
    deferred: Deferred | None = None  # a timing still to be made (assemble's defer_tuning)

    @property
    def codec(self):
        return self.loaded.codec

    @cached_property
    def json_tokens(self):
        """The model's tokens as bytes, for JSON grammars (``decoding/json_grammar.py``)."""
        from evospec.decoding.json_grammar import TokenTable

        return TokenTable.for_codec(self.codec, self.eos_ids, self.loaded.model.cfg.vocab_size)

    def decoder(self, name: str) -> Decoder:
        """The decoder of ``name`` ("auto": the method it resolved to)."""
        return self.decoders[self.resolved.get(name, name)]


def assemble(settings: StackSettings, *, progress: bool = True, defer_tuning: bool = False) -> Stack:
    """Load everything ``settings`` names; bad paths, shapes or stale indices surface as
    ValueError / CheckpointError / IndexLoadError. ``defer_tuning`` (a server): where the
    timings ``auto`` or a tuned tree needs are not cached yet, serve ``ngram`` (``auto``) or the
    method at a small chain for now and leave the measuring to ``Stack.deferred`` instead of
    doing it here."""
    import torch

    from evospec.models.loading import load_model, resolve_device
    from evospec.models.prefetch import choose_prefetch

    dtype = getattr(torch, settings.dtype)
    device = resolve_device(settings.device)
    loaded = load_model(
        settings.model,
        dtype=dtype,
        device=device,
        progress=progress,
        pack=settings.pack_weights,
        weights=settings.weights,
    )
    if loaded.codec is None:
        raise ValueError(f"{loaded.source} has no tokenizer.json; EvoSpec needs one to handle text")
    weights = describe_weights(loaded)
    facts = [f"model: {loaded.name} from {loaded.source} ({settings.dtype} on {device}, {weights})"]
    prefetch = choose_prefetch(loaded, settings.prefetch)  # before any timing: tuning keys on it
    if prefetch is not None:
        facts.append(prefetch.describe())
    eos = tuple(loaded.codec.eos_ids or loaded.model.cfg.eos_token_ids)
    named = [method_spec(n) for n in settings.methods if n != AUTO]
    draft, draft_path = _load_draft(settings, loaded, named, dtype, device, facts)
    draft3, draft3_path = _load_draft3(settings, loaded, named, dtype, device, facts)
    needed = draft is not None or any(s.needs_indices for s in named)  # auto without a head: ar only
    indices = _load_indices(settings, loaded, named, facts, progress) if needed else None
    ngrams, ngrams_path = _load_ngrams(settings, loaded, facts)

    def build(name: str, tree: TreeConfig) -> Decoder:
        return make_decoder(
            name,
            loaded.model,
            eos_ids=eos,
            draft=draft3 if method_spec(name).head == "eagle3" else draft,
            tree=replace(tree, jump_forward=settings.tree.jump_forward),  # a tuned shape's too
            vocab=settings.vocab,
            indices=indices,
            adapt=settings.adapt,
            verify_logits=settings.verify_logits,
            draft_weights=settings.draft_weights,
            ngrams=ngrams,
            reuse_prefix=settings.prefix_reuse,
            prefix_cache_mb=settings.prefix_cache_mb,
        )

    resolved: dict[str, str] = {}
    auto_tree = None
    from evospec.decoding.tune import AUTO_CANDIDATES, Tuner

    drafts = f"{head_id(draft_path)}|draft-{draft_format(loaded.model, settings.draft_weights, draft)}"
    if draft3_path is not None:  # the *-e3 methods' shapes depend on the EAGLE-3 head
        drafts += f"|e3-{head_id(draft3_path)}"
    plain = "no-draft"  # ngram's shapes: the table's, whichever head was loaded beside it
    if ngrams_path is not None:  # the table's shapes join the candidates
        drafts += f"|ngrams-{head_id(ngrams_path)}"
        plain += f"|ngrams-{head_id(ngrams_path)}"
    tuner = Tuner(
        build, loaded, drafts, eos, settings.verify_logits, progress, table=ngrams is not None, plain_id=plain
    )
    deferred, auto_tree = None, None
    if AUTO in settings.methods:
        candidates = [
            n
            for n in AUTO_CANDIDATES
            if method_spec(n).head is None
            or (draft is not None and (indices is not None or not method_spec(n).needs_indices))
        ]
        resolved[AUTO], auto_tree, deferred = _resolve_auto(tuner, candidates, defer_tuning, facts)
    wanted = [resolved.get(n, n) for n in settings.methods]
    decoders: dict[str, Decoder] = {}
    for spec in [method_spec(n) for n in dict.fromkeys(wanted)]:
        tree = settings.tree
        if spec.name == resolved.get(AUTO) and auto_tree is not None:
            tree = auto_tree  # the shape the choice was measured with
        elif settings.tune_tree and spec.speculative:
            tree, later = _tuned_tree(tuner, spec, defer_tuning and deferred is None, facts)
            deferred = deferred or later
        decoders[spec.name] = build(spec.name, tree)
        facts += _decoder_facts(spec, decoders[spec.name], settings.adapt)
    record_steps(loaded.model, decoders.values())
    trim_heap()  # what loading freed (the float weights quantisation replaced) back to the system
    return Stack(
        settings, loaded, eos, draft, draft_path, indices, decoders, facts, resolved, ngrams, deferred
    )


def _resolve_auto(tuner, candidates: list[str], defer: bool, facts: list[str]):
    """``auto``'s method and tree, and the :class:`Deferred` timing where ``defer`` and the
    cache has none (``ngram`` serves meanwhile); the ``method auto:`` line goes to ``facts``."""
    from evospec.decoding.tune import candidates_for

    choice = tuner.cached_method(candidates) if defer else tuner.method(candidates)
    if choice is not None:
        facts.append(f"method auto: {choice_fact(choice)}")
        return choice[0], choice[1], None

    def steps() -> Steps[Choice]:
        return replace(tuner, progress=False).method_steps(candidates)

    facts.append(
        "method auto: serving ngram (context lookup: no draft, lossless) while the candidates are "
        "timed against ar in the engine's idle time (a few minutes of idle CPU); the choice is "
        "cached for later starts"
    )
    return (
        "ngram",
        candidates_for("ngram", tuner.table)[0],
        Deferred("method auto", "the candidates", "ngram", steps, tuner.build),
    )


def _tuned_tree(tuner, spec: MethodSpec, defer: bool, facts: list[str]) -> tuple[TreeConfig, Deferred | None]:
    """``--tree auto``'s shape for ``spec``: cached or measured now; with ``defer`` and nothing
    cached, a 1-token chain after context lookup (and the table's guesses) and the
    :class:`Deferred` timing that replaces it (its line goes to ``facts``)."""
    cached = tuner.cached_tree(spec.drafts_like) if defer else tuner.tree(spec.drafts_like)
    label = f"tree auto for {spec.name}"
    if cached is not None:
        facts.append(f"{label}: {cached} (the shape measured fastest on this machine)")
        return cached, None
    facts.append(f"{label}: {TREE_FACT}")
    small = TreeConfig(1, 1, 1, lookup=3, table_lookup=int(tuner.table))
    return small, Deferred(label, "the shapes", spec.name, _tree_steps(tuner, spec), tuner.build)


def _tree_steps(tuner, spec: MethodSpec) -> Callable[[], Steps[Choice]]:
    """``--tree auto``'s timing of ``spec`` as pausable steps that give a :data:`Choice`."""
    from evospec.decoding.tune import speedup_of

    def steps() -> Steps[Choice]:
        res = yield from replace(tuner, progress=False).tuning_steps(spec.drafts_like)
        return spec.name, TreeConfig(**res["tree"]), {spec.name: speedup_of(res)}

    return steps


def choice_fact(choice: Choice) -> str:
    """The line that reports what ``--method auto`` (or a deferred ``--tree auto``) chose."""
    table = ", ".join(f"{n} {x:.2f}x" for n, x in choice[2].items())
    return f"{choice[0]} (measured speedup over ar: {table})"


def _load_draft(settings: StackSettings, loaded, named: list[MethodSpec], dtype, device, facts: list[str]):
    """(head, its folder) when a method drafts; (None, None) otherwise, and for ``auto`` without
    a head (it then serves ar)."""
    from evospec.models.eagle import load_eagle
    from evospec.models.registry import default_head

    if not any(s.head == "eagle2" for s in settings.specs if s.speculative):
        return None, None
    path = Path(settings.draft).expanduser() if settings.draft else default_head(loaded.name)
    if path is None:
        if any(s.speculative and s.head == "eagle2" for s in named):
            raise ValueError(
                f"speculative methods need a draft head (--draft PATH): none ships for {loaded.name}"
            )
        facts.append(f"no draft head ships for {loaded.name}: auto chooses between ar and ngram")
        return None, None
    facts.append(f"draft head: {path}")
    return load_eagle(path, dtype=dtype, device=device), path


def _load_draft3(settings: StackSettings, loaded, named: list[MethodSpec], dtype, device, facts: list[str]):
    """(EAGLE-3 head, its folder) when a named method drafts with one; (None, None) otherwise."""
    from evospec.models.eagle3 import load_eagle3
    from evospec.models.registry import default_head

    if not any(s.head == "eagle3" for s in named):
        return None, None
    path = Path(settings.draft3).expanduser() if settings.draft3 else default_head(loaded.name, arch="eagle3")
    if path is None:
        raise ValueError(
            f"the *-e3 methods need an EAGLE-3 head (--draft3 PATH): none ships for {loaded.name}"
        )
    head = load_eagle3(path, target_layers=loaded.model.cfg.num_layers, dtype=dtype, device=device)
    vocab = "full vocabulary" if head.draft_ids() is None else f"{head.draft_vocab}-id draft vocabulary"
    facts.append(f"EAGLE-3 head: {path} (target layers {list(head.aux_layers)}, {vocab})")
    return head, path


def _load_ngrams(settings: StackSettings, loaded, facts: list[str]):
    """(the model's n-gram table, its file) -- the one named, else the one ``build-ngrams`` made
    for the model, else the one shipped -- or (None, None): "none", or no table at all."""
    from evospec.decoding.ngram_table import load_ngram_table, user_table_path
    from evospec.models.registry import default_ngrams

    if settings.ngrams == "none":
        return None, None
    if settings.ngrams:
        path = Path(settings.ngrams).expanduser()
    else:
        built = user_table_path(loaded.name)
        path = built if built.is_file() else default_ngrams(loaded.name)
        if path is None:
            return None, None
    table = load_ngram_table(path, vocab_size=loaded.model.cfg.vocab_size)
    facts.append(
        f"n-gram table: {path} ({len(table):,} contexts from {table.info.tokens:,} tokens of answers)"
    )
    return table, path


def _load_indices(settings: StackSettings, loaded, named: list[MethodSpec], facts: list[str], progress: bool):
    """The index bundle when a method's policy reads it (built on first use); for methods only
    ``auto`` considers, None when it cannot be had (auto then leaves them out)."""
    if not any(s.needs_indices for s in settings.specs):
        return None
    from indices.default import ensure_indices

    folder = settings.vocab.indices
    try:
        indices = ensure_indices(
            loaded,
            directory=Path(folder).expanduser() if folder else None,
            corpus=[Path(c).expanduser() for c in settings.vocab.corpus_paths] or None,
            need_hnsw=any(s.needs_hnsw for s in settings.specs),
            need_files=sorted({f for s in settings.specs for f in s.needs_files}),
            progress=progress,
        )
    except (FileNotFoundError, ValueError) as exc:
        if any(s.needs_indices for s in named):
            raise
        facts.append(f"indices unavailable ({exc}): auto leaves out the methods that read them")
        return None
    facts.append(f"indices: {describe_indices(indices)}")
    return indices


def head_id(path: Path | None) -> str:
    """A draft head's identity for tuning caches: its folder name and a hash of its weights (a
    retrained head, shipped under the same name, is tuned afresh); of a file (an n-gram table),
    its name and a hash of its bytes."""
    import hashlib

    if path is None:
        return "none"
    path = Path(path)
    weights = [path] if path.is_file() else sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    digest = hashlib.sha1()
    for w in weights:
        digest.update(w.read_bytes())
    return f"{path.name}@{digest.hexdigest()[:12]}"


def _decoder_facts(spec: MethodSpec, decoder: Decoder, adapt: AdaptConfig) -> list[str]:
    out = []
    vocab = decoder.vocab
    if vocab is not None:
        out.append(f"draft vocabulary: {describe_vocab(vocab.state())}")  # names the policy
    if spec.adapt is not None:
        out.append(f"online adaptation: {spec.adapt} lr={adapt.lr:g} buffer={adapt.buffer_size}")
    return out


def describe_indices(bundle) -> str:
    """One line about an ``indices.IndexBundle``: where it is, what it holds, what it counted."""
    m = bundle.manifest
    parts = [f"frequency table ({m.corpus.num_tokens:,} tokens of {m.corpus.description})"]
    parts.append(f"bigram graph ({m.num_edges:,} edges)")
    if bundle.hnsw is not None:
        parts.append("HNSW over the LM head")
    return f"{bundle.directory}: " + ", ".join(parts) + f"; built {m.created}"


def describe_vocab(state: dict) -> str:
    """One line from ``ActiveVocab.state()``: policy and sizes."""
    keys = ("capacity", "static_size", "window", "arc_size")
    sizes = " ".join(f"{k}={state[k]}" for k in keys if state.get(k) is not None)
    if "arc" in state:
        sizes += f" arc_capacity={state['arc']['config']['capacity']}"
    return f"policy={state['policy']} {sizes}"


def describe_weights(loaded) -> str:
    """``weights int4 (211 linears, 210 from the checkpoint's 4-bit codes, 95 MB, ...)`` or
    ``weights fp32``; an int4 load that rounded weights to 4 bits says how many, and what keeps
    them closer to the checkpoint."""
    q = loaded.quant
    if q is None:
        return f"weights {loaded.weights}"
    codes = f"{q.from_codes} from the checkpoint's 4-bit codes, " if loaded.weights == "int4" else ""
    if loaded.weights == "int4" and q.requantised:
        codes += f"{q.requantised} rounded to 4 bits from its floats (--weights int8 keeps 8), "
    fused = ", fused CPU ops" if getattr(loaded.model, "fused_ops", False) else ""
    huge = ", in 2 MB pages" if getattr(loaded, "huge_page_bytes", 0) else ""
    emb = getattr(loaded, "embedding_bytes_freed", 0)
    emb = f"; token embedding as int8 codes, exact ({emb / 1e6:.0f} MB freed)" if emb else ""
    return f"weights {loaded.weights} ({q.linears} linears, {codes}{q.nbytes / 1e6:.0f} MB{huge}{fused}){emb}"
