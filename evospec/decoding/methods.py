"""Decoding methods by name: the one place that maps ``--method NAME`` to a decoder.

Owns: the method table (:data:`METHOD_SPECS`, one :class:`MethodSpec` per name, resolved by
:func:`method_spec`: what a method is made of, which inputs it needs, what state it keeps --
every consumer reads these fields instead of testing names), the :class:`Decoder` protocol
(``generate(prompt_ids, params) -> Iterator[StepEvent]``) and the factory :func:`make_decoder`.
Each decoder keeps its preallocated state (KV caches, tree buffers) between requests. Knows
token ids only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from evospec.adapt.config import AdaptConfig
from evospec.adapt.online import OnlineAdapter
from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.budget import plan_budget
from evospec.decoding.drafter import Drafter, EagleDrafter
from evospec.decoding.events import StepEvent
from evospec.decoding.lookup import check_table
from evospec.decoding.ngram_table import NgramTable
from evospec.decoding.node_logits import calibrate_prefetch
from evospec.decoding.prefix import STORE_MB, PrefixCache
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.speculative import generate_speculative
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import EagleHead, clone_head, quantised_head
from evospec.models.fused import enable_fused_draft, fused_draft_applies
from evospec.models.kv_cache import KVCache
from evospec.models.packing import projection
from evospec.models.quant import Int8Matmul, QuantLinear, kernels_available
from evospec.models.transformer import Transformer
from evospec.vocab.active import ActiveVocab
from evospec.vocab.config import SHARED_BUDGET
from evospec.vocab.factory import (
    HAS_ARC,
    NEEDS_COUNTS,
    NEEDS_FILES,
    NEEDS_RETRIEVAL,
    POLICIES,
    VocabConfig,
    make_policy,
)


@dataclass(frozen=True)
class MethodSpec:
    """What one decoding method is made of (a row of :data:`METHOD_SPECS`)."""

    name: str
    speculative: bool  # proposes tokens and verifies them (a draft head's tree, or context lookup)
    policy: str | None  # active-vocabulary policy the draft proposes over; None: full vocabulary
    adapt: str | None  # online adaptation mode ("clora" | "osd"); None: the draft is frozen
    # the draft head's architecture: "eagle2" (--draft) or "eagle3" (--draft3); None: no head
    # (ngram: only context lookup proposes tokens)
    head: str | None = "eagle2"

    @property
    def needs_counts(self) -> bool:  # the frequency table of the model's indices
        return self.policy in NEEDS_COUNTS

    @property
    def needs_hnsw(self) -> bool:  # the HNSW index over the LM head and the bigram graph
        return self.policy in NEEDS_RETRIEVAL

    @property
    def needs_files(self) -> tuple[str, ...]:  # the indices' optional files it reads (vocabtrim, router...)
        return NEEDS_FILES.get(self.policy, ()) if self.policy else ()

    @property
    def needs_indices(self) -> bool:
        return self.needs_counts or self.needs_hnsw or bool(self.needs_files)

    @property
    def has_arc(self) -> bool:  # keeps an ARC buffer of retrieved ids (resettable, inspectable)
        return self.policy in HAS_ARC

    @property
    def shares_budget(self) -> bool:  # window and ARC buffer split vocab.w_max
        return self.policy in SHARED_BUDGET

    @property
    def drafts_like(self) -> str:
        """The method whose drafting cost this one has (an adaptive method drafts like its
        vocabulary policy): what the tree tuner measures and caches."""
        if self.head == "eagle3":
            return f"{self.policy}-e3" if self.policy else self.name
        return self.policy or self.name


def _table() -> dict[str, MethodSpec]:
    rows = [MethodSpec("ar", False, None, None, head=None), MethodSpec("eagle2", True, None, None)]
    rows += [MethodSpec("ngram", True, None, None, head=None)]  # context lookup alone, any model
    rows += [MethodSpec(p, True, p, None) for p in POLICIES]
    rows += [
        MethodSpec("clora", True, "frspec", "clora"),
        MethodSpec("osd", True, "frspec", "osd"),
        MethodSpec("evospec-full", True, "evospec", "clora"),
    ]
    # the same drafting on an EAGLE-3 head (its own LM head; policies need a full-vocabulary one)
    rows += [MethodSpec("eagle3", True, None, None, head="eagle3")]
    rows += [MethodSpec(f"{p}-e3", True, p, None, head="eagle3") for p in POLICIES]
    rows += [
        MethodSpec("clora-e3", True, "frspec", "clora", head="eagle3"),
        MethodSpec("osd-e3", True, "frspec", "osd", head="eagle3"),
        MethodSpec("evospec-full-e3", True, "evospec", "clora", head="eagle3"),
    ]
    return {r.name: r for r in rows}


METHOD_SPECS: dict[str, MethodSpec] = _table()
METHODS = tuple(METHOD_SPECS)


def method_spec(name: str) -> MethodSpec:
    """The table row of ``name``; ValueError naming the available methods otherwise."""
    spec = METHOD_SPECS.get(name)
    if spec is None:
        raise ValueError(
            f"unknown method {name!r}; available: {', '.join(METHODS)}, "
            "or auto (where a command takes it: the fastest lossless method measured on this machine)"
        )
    return spec


# which tree nodes the verify forward projects onto the vocabulary (see node_logits.py):
# "all" every node (one big call; right on a GPU), "lazy" on demand with prefetch, "auto"
# lazy on a CPU, all elsewhere
VERIFY_LOGITS = ("auto", "all", "lazy")
_PREFETCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> calibrated threshold


class Decoder(Protocol):
    """What the engine, the bench and the CLI may read of a decoder, and nothing more."""

    name: str
    tree: TreeConfig | None  # the draft tree's shape; None: no drafting (ar)
    vocab: ActiveVocab | None  # the active draft vocabulary (eagle2: the full one); None for ar
    adapt: OnlineAdapter | None  # the online adapter of the adaptive methods; else None
    prefix: PrefixCache  # what its KV cache keeps between requests (prefix reuse)
    model: Transformer  # the target
    eos_ids: tuple[int, ...]  # its stop ids besides a request's own
    # the target's KV cache (None before the first request): after a request's generator is
    # closed between rounds, slots [0, P + E - 1) hold its prompt and emitted tokens but the
    # last (the engine's handover to its batch copies them)
    cache: KVCache | None

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]: ...

    def close(self) -> None:
        """Stop background work (retrieval, adapter worker); the decoder is not used after."""


class ARDecoder:
    """Plain decoding with a KV cache reused across requests (grown when a request needs more)."""

    name = "ar"
    tree = None
    vocab = None
    adapt = None

    def __init__(self, model: Transformer, eos_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.cache: KVCache | None = None
        self.prefix = PrefixCache(model)  # what the cache holds between requests

    def close(self) -> None:
        pass

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        budget = plan_budget(self.model, len(prompt), params, eos_ids=self.eos_ids)
        self.cache, reuse = self.prefix.prepare(self.cache, prompt, budget.slots)
        events = generate_ar(
            self.model, prompt, params, eos_ids=self.eos_ids, cache=self.cache, budget=budget, reuse=reuse
        )
        return self.prefix.track(prompt, events)


class SpeculativeDecoder:
    """Draft-tree speculative decoding with any :class:`Drafter` (None: context lookup only);
    lossless by construction."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        drafter: Drafter | None,
        tree: TreeConfig,
        eos_ids: Sequence[int] = (),
        vocab: ActiveVocab | None = None,
        adapt: OnlineAdapter | None = None,
        prefetch: float | None = None,
        draft_layers: tuple[int, ...] = (),
        ngrams: NgramTable | None = None,
    ) -> None:
        check_table(tree, ngrams)  # at construction, not at a request
        self.name = name
        self.ngrams = ngrams  # the model's n-gram table (tree.table_lookup)
        self.draft_layers = draft_layers  # target layers the draft reads (EAGLE-3); (): final features
        self.prefetch = prefetch  # None: project every tree node; else lazy rows (node_logits.py)
        self.vocab = vocab  # owns the drafter's head function when given
        self.adapt = adapt  # tunes the drafter's head weights from verification feedback
        self.model = model
        self.drafter = drafter
        self.tree = tree
        self.eos_ids = tuple(eos_ids)
        self.cache: KVCache | None = None
        self.prefix = PrefixCache(model)  # what the cache holds between requests
        self.prefix.needs_features = drafter is not None  # a drafted decoder reuses features too

    def close(self) -> None:
        if self.adapt is not None:
            self.adapt.close()
        if self.vocab is not None:
            self.vocab.close()

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        budget = plan_budget(self.model, len(prompt), params, eos_ids=self.eos_ids, slack=self.tree.max_nodes)
        self.cache, reuse = self.prefix.prepare(self.cache, prompt, budget.slots)
        events = generate_speculative(
            self.model,
            self.drafter,
            prompt,
            params,
            self.tree,
            eos_ids=self.eos_ids,
            cache=self.cache,
            vocab=self.vocab,
            adapt=self.adapt,
            prefetch=self.prefetch,
            budget=budget,
            draft_layers=self.draft_layers,
            ngrams=self.ngrams,
            prefix_cache=self.prefix,
            reuse=reuse,
        )
        return self.prefix.track(prompt, events)


def make_decoder(
    name: str,
    model: Transformer,
    *,
    eos_ids: Sequence[int] = (),
    draft: EagleHead | None = None,
    tree: TreeConfig | None = None,
    vocab: VocabConfig | None = None,
    indices=None,
    adapt: AdaptConfig | None = None,
    verify_logits: str = "auto",
    prefetch: float | None = None,
    draft_weights: str = "auto",
    ngrams: NgramTable | None = None,
    reuse_prefix: bool = True,
    prefix_cache_mb: int | None = None,
) -> Decoder:
    """``ar``; or a speculative method (needs ``draft``, an EAGLE-2 head for ``model``):
    ``eagle2`` drafts over the full vocabulary, the others over a policy's active vocabulary
    (``frspec``/``evospec`` also need ``indices``, an ``indices.IndexBundle`` for ``model``).
    Methods whose spec has an ``adapt`` mode also tune a private copy of ``draft`` online
    (``adapt`` settings; the ``mode`` is the spec's). ``verify_logits`` (:data:`VERIFY_LOGITS`) and
    ``prefetch`` (a fixed threshold in [0, 1]; default: calibrated once per target) choose how
    verification projects tree nodes onto the vocabulary; the output is the same either way.
    ``draft_weights`` (:func:`drafting_head`): ``auto`` drafts with int8 linears where the
    target's are quantised, ``fp32`` keeps the head's own; adapting methods always keep fp32.
    ``ngrams``: the model's n-gram table, which ``tree.table_lookup`` reads (``ngram_table.py``).
    ``reuse_prefix``: a prompt keeps the cached slots it shares with the decoder's last request,
    or with one of the earlier sequences kept in ``prefix_cache_mb`` MiB of snapshots (None:
    ``prefix.STORE_MB``), where that is exact (``prefix.py``)."""
    args = (eos_ids, draft, tree, vocab, indices, adapt, verify_logits, prefetch, draft_weights, ngrams)
    dec = _build_decoder(name, model, *args)
    dec.prefix.enabled = dec.prefix.enabled and reuse_prefix
    dec.prefix.store_bytes = (STORE_MB if prefix_cache_mb is None else prefix_cache_mb) << 20
    return dec


def _build_decoder(
    name, model, eos_ids, draft, tree, vocab, indices, adapt, verify_logits, prefetch, draft_weights, ngrams
) -> Decoder:
    spec = method_spec(name)
    if not spec.speculative:
        return ARDecoder(model, eos_ids)
    if spec.head is None:
        return _ngram_decoder(spec, model, tree, eos_ids, verify_logits, prefetch, ngrams)
    kind, flag = ("EAGLE-3", "--draft3") if spec.head == "eagle3" else ("EAGLE-2", "--draft")
    if draft is None:
        raise ValueError(f"method {name} needs a draft head: an {kind} head ({flag} PATH)")
    if draft.arch != spec.head:
        raise ValueError(f"method {name} drafts with an {kind} head ({flag}), got an {draft.arch} one")
    tree = tree or TreeConfig()
    if tree.top_k > model.cfg.vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the vocabulary ({model.cfg.vocab_size})")
    if spec.head == "eagle3":
        draft = draft.attach(model)  # a tied head needs the target's LM head
        if spec.adapt is not None:
            draft = clone_head(draft).attach(model)  # its weights will move: never share them
        else:
            draft = drafting_head(draft, model, draft_weights)
        return _eagle3_decoder(
            spec, model, draft, tree, eos_ids, vocab, indices, verify_logits, prefetch, adapt, ngrams
        )
    policy = _policy(spec, model, vocab, indices, model.device)
    # an int4 draft projects its reduced LM head through 4-bit rows too (vocab/head.py: _SlotTiles4)
    int4 = spec.adapt is None and draft_format(model, draft_weights, draft) == "int4"
    project = projection(model.lm_head)
    active = ActiveVocab(policy, _head_rows(model, project), always_ids=eos_ids, project=project, int4=int4)
    adapter = None
    if spec.adapt is not None:
        draft = clone_head(draft)  # its weights will move: never share them with another decoder
        config = replace(adapt or AdaptConfig(), mode=spec.adapt)
        adapter = OnlineAdapter(draft.attach(model), model.lm_head.weight, config)  # float rows: its KL
    else:
        draft = drafting_head(draft, model, draft_weights)
    drafter = EagleDrafter(draft.attach(model), active.draft_head, record=adapter is None)
    threshold = verify_prefetch(model, verify_logits, prefetch)
    return SpeculativeDecoder(
        name, model, drafter, tree, eos_ids, vocab=active, adapt=adapter, prefetch=threshold, ngrams=ngrams
    )


NGRAM_LOOKUP = 3  # tokens an ngram round verifies after a match, unless the tree's lookup says
NGRAM_TABLE = 1  # ... and after a guess of the model's n-gram table, where it has one


def _ngram_decoder(spec, model, tree, eos_ids, verify_logits, prefetch, ngrams=None) -> Decoder:
    """Context lookup alone (vLLM's ``ngram``, llama.cpp's lookup decoding): a round verifies
    the tokens that followed the context's last n-gram where it occurred before, else the n-gram
    table's guess where the model has a table, else it is a plain decode step. Needs no draft
    head, so it serves any model."""
    tree = tree or TreeConfig()
    if not tree.lookup:
        tree = replace(tree, lookup=NGRAM_LOOKUP)
    if ngrams is not None and not tree.table_lookup:
        tree = replace(tree, table_lookup=NGRAM_TABLE)
    threshold = verify_prefetch(model, verify_logits, prefetch)
    return SpeculativeDecoder(spec.name, model, None, tree, eos_ids, prefetch=threshold, ngrams=ngrams)


def _eagle3_decoder(
    spec, model, draft, tree, eos_ids, vocab, indices, verify_logits, prefetch, adapt=None, ngrams=None
) -> Decoder:
    """A speculative decoder drafting with an EAGLE-3 head: its own LM head (after its final
    norm), over the full vocabulary, a policy's active set, or its fixed d2t vocabulary. An
    adaptive spec tunes the head (a private fp32 copy) online, as for EAGLE-2 heads."""
    draft = draft.attach(model)
    lm = draft.lm_head
    weight = lm.weight  # [V or V_d, D]: kept dense in every drafting format (the reduced head gathers it)
    if spec.policy is not None and draft.draft_ids() is not None:
        raise ValueError(
            f"method {spec.name} needs a full-vocabulary EAGLE-3 head; this one drafts over a fixed "
            f"{draft.draft_vocab}-id vocabulary (d2t): use eagle3"
        )
    policy = _policy(spec, model, vocab, indices, weight.device)
    active = ActiveVocab(
        policy,
        weight,
        always_ids=eos_ids if draft.draft_ids() is None else (),
        project=projection(lm),
        prefill_project=projection(model.lm_head),
        row_ids=draft.draft_ids(),
        vocab_size=model.cfg.vocab_size,
    )
    adapter = None
    if spec.adapt is not None:
        adapter = OnlineAdapter(draft, weight, replace(adapt or AdaptConfig(), mode=spec.adapt))
    drafter = EagleDrafter(draft.attach(model), _NormedHead(draft, active.draft_head), record=adapter is None)
    threshold = verify_prefetch(model, verify_logits, prefetch)
    return SpeculativeDecoder(
        spec.name,
        model,
        drafter,
        tree,
        eos_ids,
        vocab=active,
        adapt=adapter,
        prefetch=threshold,
        draft_layers=draft.aux_layers,
        ngrams=ngrams,
    )


def _policy(spec: MethodSpec, model: Transformer, vocab: VocabConfig | None, indices, device):
    """The method's vocabulary policy (None: the full vocabulary)."""
    if spec.policy is None:
        return None
    return make_policy(
        spec.policy, model.cfg.vocab_size, cfg=vocab or VocabConfig(), indices=indices, device=device
    )


class _NormedHead:
    """An EAGLE-3 head's LM-head step: its final norm, then the vocabulary's top-k."""

    def __init__(self, draft, head_fn) -> None:
        self.draft, self.head_fn = draft, head_fn

    def __call__(self, hidden: torch.Tensor, k: int, choose=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head_fn(self.draft.logit_input(hidden), k, choose)


_DRAFT_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> {format: its copy}
DRAFT_WEIGHTS = ("auto", "fp32", "int8", "int4")


def drafting_head(draft: EagleHead, model: Transformer, draft_weights: str = "auto") -> EagleHead:
    """The head a non-adapting method drafts with: ``draft`` itself (fp32) or a quantised copy
    (one per head and format, shared by every decoder). ``int4``: its linears on our int4 kernel
    and its step as one op run by one team of threads (``models/fused.py: enable_fused_draft``);
    ``int8``: torch's int8 kernels. ``auto`` (:func:`draft_format`) picks by the target."""
    fmt = draft_format(model, draft_weights, draft)
    if fmt == "fp32":
        return draft
    copies = _DRAFT_COPIES.setdefault(draft, {})
    if fmt not in copies:
        copies[fmt] = quantised_head(draft, fmt)
        if fmt == "int4" and not enable_fused_draft(copies[fmt]):
            raise ValueError("--draft-weights int4 needs the fused CPU ops and an EAGLE-2 head they take")
    return copies[fmt]


def draft_format(model: Transformer, draft_weights: str = "auto", draft=None) -> str:
    """What ``draft_weights`` resolves to for drafting against ``model``: ``fp32``, ``int8`` or
    ``int4``. ``auto``: where the target's linears are quantised (a CPU serving int4/int8/bf16
    weights, where a step's cost is the bytes it reads and the ops it starts: the draft layer
    reads 4.2M weights), int4 on the fused draft step when the target runs the fused ops and
    the head qualifies (``draft`` given and an EAGLE-2 head), else int8; fp32 elsewhere."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {draft_weights!r}")
    if draft_weights in ("int8", "int4") and not kernels_available(draft_weights):
        raise ValueError(f"this torch build has no CPU kernel for {draft_weights} weights")
    if draft_weights != "auto":
        return draft_weights
    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        return "fp32"
    if getattr(model, "fused_ops", False) and draft is not None and fused_draft_applies(draft):
        return "int4"
    return "int8" if kernels_available("int8") else "fp32"


def _head_rows(model: Transformer, project) -> torch.Tensor:
    """[V, D] the target LM head's rows as an active vocabulary takes them: its float weight; or,
    where the head is an int8 matmul (``project``), whose rows the vocabulary heads gather
    themselves (``Int8Matmul.weight_rows``) and of this tensor read only the shape and device, a
    view of one zero byte -- so that neither a compact embedding's float table
    (``models/embedding.py``) nor the head's row-major codes are built for them."""
    if isinstance(project, Int8Matmul):
        return torch.zeros((), dtype=torch.int8, device=model.device).expand(*project.shape)
    return model.lm_head.weight


def verify_prefetch(
    model: Transformer, verify_logits: str = "auto", prefetch: float | None = None
) -> float | None:
    """The prefetch threshold for lazy verification of ``model`` (None: project every node)."""
    if verify_logits not in VERIFY_LOGITS:
        raise ValueError(f"verify_logits must be one of {', '.join(VERIFY_LOGITS)}, got {verify_logits!r}")
    if prefetch is not None and not 0.0 <= prefetch <= 1.0:
        raise ValueError(f"prefetch must be in [0, 1], got {prefetch}")
    device = model.device
    if verify_logits == "all" or (verify_logits == "auto" and device.type != "cpu"):
        return None
    if prefetch is None:
        if model not in _PREFETCH:
            _PREFETCH[model] = calibrate_prefetch(
                model.project_logits, model.cfg.hidden_size, device=device, dtype=model.norm.weight.dtype
            )
        prefetch = _PREFETCH[model]
    return prefetch
