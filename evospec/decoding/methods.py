"""Decoding methods by name: the one place that maps ``--method NAME`` to a decoder.

Owns: the :class:`Decoder` protocol (``generate(prompt_ids, params) -> Iterator[StepEvent]``)
and the factory :func:`make_decoder`. Each decoder keeps its preallocated state (KV caches,
tree buffers) between requests. Knows token ids only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol

from evospec.adapt.config import AdaptConfig
from evospec.adapt.online import OnlineAdapter
from evospec.decoding.autoregressive import generate_ar, plan_budget
from evospec.decoding.drafter import Drafter, EagleDrafter
from evospec.decoding.events import StepEvent
from evospec.decoding.node_logits import calibrate_prefetch
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.speculative import generate_speculative
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import EagleHead, clone_head
from evospec.models.kv_cache import KVCache
from evospec.models.packing import projection
from evospec.models.transformer import Transformer
from evospec.vocab.active import ActiveVocab
from evospec.vocab.factory import POLICIES, VocabConfig, make_policy

# online-adaptive methods: name -> (vocabulary policy, adaptation mode)
ADAPTIVE = {"clora": ("frspec", "clora"), "osd": ("frspec", "osd"), "evospec-full": ("evospec", "clora")}
METHODS = ("ar", "eagle2", *POLICIES, *ADAPTIVE)
SPECULATIVE = ("eagle2", *POLICIES, *ADAPTIVE)  # methods that need an EAGLE-2 draft head
# which tree nodes the verify forward projects onto the vocabulary (see node_logits.py):
# "all" every node (one big call; right on a GPU), "lazy" on demand with prefetch, "auto"
# lazy on a CPU, all elsewhere
VERIFY_LOGITS = ("auto", "all", "lazy")
_PREFETCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> calibrated threshold


class Decoder(Protocol):
    name: str

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]: ...


class ARDecoder:
    """Plain decoding with a KV cache reused across requests (grown when a request needs more)."""

    name = "ar"

    def __init__(self, model: Transformer, eos_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.cache: KVCache | None = None

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        _, slots = plan_budget(self.model, len(prompt), params)
        if self.cache is None or self.cache.max_len < slots:
            self.cache = self.model.new_cache(slots)
        return generate_ar(self.model, prompt, params, eos_ids=self.eos_ids, cache=self.cache)


class SpeculativeDecoder:
    """Draft-tree speculative decoding with any :class:`Drafter`; lossless by construction."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        drafter: Drafter,
        tree: TreeConfig,
        eos_ids: Sequence[int] = (),
        vocab: ActiveVocab | None = None,
        adapt: OnlineAdapter | None = None,
        prefetch: float | None = None,
    ) -> None:
        self.name = name
        self.prefetch = prefetch  # None: project every tree node; else lazy rows (node_logits.py)
        self.vocab = vocab  # owns the drafter's head function when given
        self.adapt = adapt  # tunes the drafter's head weights from verification feedback
        self.model = model
        self.drafter = drafter
        self.tree = tree
        self.eos_ids = tuple(eos_ids)
        self.cache: KVCache | None = None

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        _, slots = plan_budget(self.model, len(prompt), params, slack=self.tree.max_nodes)
        if self.cache is None or self.cache.max_len < slots:
            self.cache = self.model.new_cache(slots)
        return generate_speculative(
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
        )


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
) -> Decoder:
    """``ar``; or a speculative method (needs ``draft``, an EAGLE-2 head for ``model``):
    ``eagle2`` drafts over the full vocabulary, the others over a policy's active vocabulary
    (``frspec``/``evospec`` also need ``indices``, an ``indices.IndexBundle`` for ``model``).
    The :data:`ADAPTIVE` methods also tune a private copy of ``draft`` online (``adapt``
    settings; its ``mode`` is the method's). ``verify_logits`` (:data:`VERIFY_LOGITS`) and
    ``prefetch`` (a fixed threshold in [0, 1]; default: calibrated once per target) choose how
    verification projects tree nodes onto the vocabulary; the output is the same either way."""
    if name == "ar":
        return ARDecoder(model, eos_ids)
    if name not in SPECULATIVE:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    if draft is None:
        raise ValueError(f"method {name} needs a draft head (--draft PATH)")
    tree = tree or TreeConfig()
    if tree.top_k > model.cfg.vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the vocabulary ({model.cfg.vocab_size})")
    weight = model.lm_head.weight
    policy_name, online = ADAPTIVE.get(name, (name, None))
    policy = None
    if policy_name != "eagle2":
        policy = make_policy(
            policy_name,
            model.cfg.vocab_size,
            cfg=vocab or VocabConfig(),
            indices=indices,
            device=weight.device,
        )
    active = ActiveVocab(policy, weight, always_ids=eos_ids, project=projection(model.lm_head))
    adapter = None
    if online is not None:
        draft = clone_head(draft)  # its weights will move: never share them with another decoder
        adapter = OnlineAdapter(draft.attach(model), weight, replace(adapt or AdaptConfig(), mode=online))
    drafter = EagleDrafter(draft.attach(model), active.draft_head)
    threshold = verify_prefetch(model, verify_logits, prefetch)
    return SpeculativeDecoder(
        name, model, drafter, tree, eos_ids, vocab=active, adapt=adapter, prefetch=threshold
    )


def verify_prefetch(
    model: Transformer, verify_logits: str = "auto", prefetch: float | None = None
) -> float | None:
    """The prefetch threshold for lazy verification of ``model`` (None: project every node)."""
    if verify_logits not in VERIFY_LOGITS:
        raise ValueError(f"verify_logits must be one of {', '.join(VERIFY_LOGITS)}, got {verify_logits!r}")
    if prefetch is not None and not 0.0 <= prefetch <= 1.0:
        raise ValueError(f"prefetch must be in [0, 1], got {prefetch}")
    device = model.lm_head.weight.device
    if verify_logits == "all" or (verify_logits == "auto" and device.type != "cpu"):
        return None
    if prefetch is None:
        if model not in _PREFETCH:
            w = model.lm_head.weight
            _PREFETCH[model] = calibrate_prefetch(
                model.project_logits, w.shape[1], device=w.device, dtype=w.dtype
            )
        prefetch = _PREFETCH[model]
    return prefetch
