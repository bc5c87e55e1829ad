"""``--tree auto`` and ``--method auto``: the draft-tree shape, and the method, that decode
fastest on this machine.

Owns: the candidate shapes, the calibration prompts, the calibration run and its cache, and
the method choice (:meth:`Tuner.method`: each method calibrated alone, then its leaders timed
again interleaved with AR in a :func:`final`; the fastest of those, or ``ar`` itself when none
beats it). Verifying many tree tokens is not free on a CPU (PERF_NOTES: a 60-token verify
costs several AR steps), while on a GPU it nearly is, so the best (top_k, depth, total_tokens)
depends on the machine, the model, the draft head and the vocabulary method. The tuner
measures instead of modelling: it decodes a few calibration prompts
(:data:`CALIBRATION_TEXTS`, written for this purpose: no data set, so a fresh install can
tune) with every candidate shape and plain AR between them, in two passes (each keeps its best
run); the leading shapes then meet AR again in one interleaved :func:`final` over more prompts
(:data:`TREE_FINALISTS`), which picks the shape; the choice is cached in
``$EVOSPEC_HOME/tuning/trees.json`` under a key naming all of those. If no shape beats AR the
result says so (``beats_ar: false``) and the fastest shape is still returned.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from evospec.common import machine_key, replace_json
from evospec.decoding.methods import METHOD_SPECS, ARDecoder, Decoder
from evospec.decoding.pausable import Steps, checkpoint, drive, rate, timed, warm
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig

CANDIDATES = (
    # one drafted token: a 2-row verify costs ~1.1 AR steps on a CPU (3 rows: ~1.4), so with a
    # first-token acceptance of ~0.3 this is the shape closest to paying (docs/benchmarks.md, wave 6)
    TreeConfig(top_k=1, depth=1, total_tokens=1),
    TreeConfig(top_k=1, depth=2, total_tokens=2),
    TreeConfig(top_k=1, depth=4, total_tokens=4),
    # a chain that stops where the draft's probability of it falls below 0.3: up to 4 tokens
    # where the head is sure, none (a plain step) where it is not (docs/benchmarks.md, wave 13)
    TreeConfig(top_k=1, depth=4, total_tokens=4, min_prob=0.3),
    # a fan: the draft's 2 most likely first tokens from one draft step, verified as one recorded
    # tree forward where the target's graphs take trees (3 lost to 2 here: docs/benchmarks.md, wave 44)
    TreeConfig(top_k=2, depth=1, total_tokens=2),
    TreeConfig(top_k=2, depth=3, total_tokens=6),
    TreeConfig(top_k=3, depth=4, total_tokens=10),
    TreeConfig(top_k=4, depth=4, total_tokens=16),
    TreeConfig(top_k=6, depth=5, total_tokens=30),
    TreeConfig(top_k=10, depth=5, total_tokens=60),
    # the chains with context lookup: a round whose context repeats an n-gram verifies its
    # continuation instead of a draft (decoding/lookup.py; docs/benchmarks.md, wave 7)
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=1),
    TreeConfig(top_k=1, depth=2, total_tokens=2, lookup=3),
    TreeConfig(top_k=2, depth=1, total_tokens=2, lookup=3),
)
# ngram has no draft: only the lookup's length and shortest match matter
NGRAM_CANDIDATES = (
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=2),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=1),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=3),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=2, lookup_ngram=2),
)
# where the model has an n-gram table (decoding/ngram_table.py; docs/benchmarks.md, wave 8): a
# round whose context finds nothing verifies the table's guesses instead of drafting
# (and with guesses down to a share of 0.12: more rounds verify a guess instead of drafting or
# stepping plainly, each right less often -- on the Xeon VM of wave 47 frspec gained 2.4% with it,
# its drafted rounds not paying there, and ngram lost 1.5%: the machine decides)
TABLE_CANDIDATES = (
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, table_lookup=1),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, table_lookup=1, table_min_share=0.12),
    TreeConfig(top_k=1, depth=2, total_tokens=2, lookup=3, table_lookup=1),
    TreeConfig(top_k=1, depth=4, total_tokens=4, lookup=3, table_lookup=1, min_prob=0.3),
    TreeConfig(top_k=2, depth=1, total_tokens=2, lookup=3, table_lookup=1),
)
NGRAM_TABLE_CANDIDATES = (
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=2, table_lookup=1),
    TreeConfig(
        top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=2, table_lookup=1, table_min_share=0.12
    ),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=2, table_lookup=2),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=3, table_lookup=1),
    TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=2),
)
CALIBRATION_TEXTS = (
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Show your working.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    # a request that answers from its context, as summaries, extraction and RAG do
    'Here is a note from a customer: "I ordered the blue kettle on March 3 and it arrived on March 9 '
    "with a cracked lid. The replacement lid I was sent does not fit the kettle. I would like a refund "
    "for the kettle or a replacement kettle with a lid that fits.\" List the customer's problems and "
    "what the customer asks for.",
)
CALIBRATION_PROMPTS = len(CALIBRATION_TEXTS)
CALIBRATION_TOKENS = 48
# methods --method auto considers: frozen drafts (an adaptive draft's speed drifts as it learns),
# and context lookup alone (it needs no head)
AUTO_CANDIDATES = ("frspec", "evospec", "nanospec", "eagle2", "ngram")
# --method auto switches away from ar only for a calibrated speedup above this: the calibration
# is short (4 prompts x 48 tokens), and here a 1.03x calibration came out 0.94x in the full bench
AUTO_MARGIN = 1.05
# The final of --method auto: each method's calibration keeps its best run against its own AR
# runs, minutes apart from the other methods', and a machine that drifts ~20% from minute to
# minute (docs/benchmarks.md, wave 29) can reorder methods a few percent apart. So the leading
# candidates (at most FINALISTS, each calibrated at or above FINAL_FLOOR x AR) meet AR again in
# one interleaved run over more prompts (FINAL_TEXTS), and that run decides.
FINALISTS = 2
FINAL_FLOOR = 0.95
FINAL_ROUNDS = 3
FINAL_TOKENS = 64
FINAL_TEXTS = (
    *CALIBRATION_TEXTS,
    'Translate into English: "Der Zug nach Hamburg hat heute wegen eines Sturms zwei Stunden '
    'Verspätung, und viele Fahrgäste warten noch am Bahnhof."',
    "Summarize in two sentences: The town council met on Tuesday to discuss the new bus routes. "
    "Residents of the north side said the changes would add twenty minutes to their commute, while "
    "the transport office argued that the new routes serve two schools and the hospital. The council "
    "agreed to test the routes for three months and to collect feedback from riders.",
    "Write a short, friendly email to a colleague asking to move our Thursday meeting to Friday morning.",
    "What are three common causes of a slow laptop, and how can each be fixed?",
)


def candidates_for(method: str, table: bool = False) -> tuple[TreeConfig, ...]:
    """The shapes ``--tree auto`` measures for ``method``; ``table``: the model has an n-gram table."""
    if method == "ngram":
        return NGRAM_TABLE_CANDIDATES if table else NGRAM_CANDIDATES
    return CANDIDATES + TABLE_CANDIDATES if table else CANDIDATES


AR_EVERY = 3  # AR is timed before every third shape of a pass
PRUNE = 0.4  # later passes skip a shape whose best run is below this share of the leader's
# The tree final: the leading shapes of a calibration (at most TREE_FINALISTS, each calibrated at
# TREE_FINAL_SHARE of the leader's speed or more) meet AR again in one interleaved final over
# FINAL_TEXTS, which picks the shape. A calibration keeps each shape's best of two runs over 4
# prompts: on a host that drifts 20% from minute to minute the best of a dozen such maxima is a
# lucky run as often as a fast shape (wave 40: frspec's calibration chose a 2-token chain
# without context lookup, 0.99x AR in the bench, where the shape it chose a run earlier made 1.17x).
TREE_FINALISTS = 3
TREE_FINAL_SHARE = 0.9


@contextlib.contextmanager
def _live_cache_only(decoders: Iterable[Decoder]) -> Iterator[None]:
    """Calibration visits its prompts many times: a decoder that copied an earlier visit's slots
    back from its prefix store (``prefix.py``) would skip prefills a first visit pays, and AR,
    timed most often, would gain most. So timings keep only the live cache, as each prompt's
    first visit has it."""
    stores = [(d.prefix, d.prefix.store_bytes) for d in decoders if getattr(d, "prefix", None) is not None]
    for prefix, _ in stores:
        prefix.store_bytes = 0
    try:
        yield
    finally:
        for prefix, room in stores:
            prefix.store_bytes = room


def calibrate(
    build: Callable[[TreeConfig], Decoder], ar: Decoder, prompts: Sequence[list[int]], **options
) -> dict:
    """:func:`calibrate_steps` run to its end at once (``pausable.drive``)."""
    return drive(calibrate_steps(build, ar, prompts, **options))


def calibrate_steps(
    build: Callable[[TreeConfig], Decoder],
    ar: Decoder,
    prompts: Sequence[list[int]],
    *,
    candidates: Sequence[TreeConfig] = CANDIDATES,
    max_new_tokens: int = CALIBRATION_TOKENS,
    passes: int = 2,
    progress: bool = True,
    final_prompts: Sequence[list[int]] = (),
) -> Steps[dict]:
    """Time every candidate on ``prompts`` (greedy), with AR timed on the same prompts before
    every :data:`AR_EVERY`-th of them; the shape with the best speedup over AR, and the table.
    With ``final_prompts``, the leading shapes then play a final on them (:func:`_tree_final`),
    which picks the shape.

    Noise on a shared machine only ever slows a run down, and here it comes in bursts (one
    calibration saw AR runs anywhere from 83 to 175 tok/s; the ratio of neighbouring runs
    swung from 0.66x to 2.08x for near-identical shapes). So each side keeps its best run: a
    candidate's speedup is its best tok/s over the best AR run, and AR, timed all through the
    calibration, is measured at the machine's best state during it. Passes
    after the first skip shapes slower than :data:`PRUNE` times the leader (big trees on a CPU:
    they would take most of the calibration's time and cannot win), and any run is stopped
    once it has taken 1 / :data:`PRUNE` times the leader's time (every candidate writes the
    same greedy tokens, so it cannot reach PRUNE x the leader's speed any more).

    Pausable steps (``pausable.py``): a run a pause interrupts is timed again.
    """
    decoders = {}
    try:
        for i, tree in enumerate(candidates):
            decoders[i] = build(tree)
            yield from checkpoint()
        # no candidate's timing pays for recording a graph
        record_steps(getattr(ar, "model", None), decoders.values())
        with _live_cache_only([ar, *decoders.values()]):
            timing = _time_candidates(ar, decoders, candidates, prompts, max_new_tokens, passes, progress)
            result = yield from timing
        if final_prompts:
            result = yield from _tree_final(ar, decoders, result, final_prompts, progress)
        return result
    finally:
        _release(decoders.values())


def _tree_final(ar: Decoder, decoders: dict, result: dict, prompts, progress: bool) -> Steps[dict]:
    """``result`` (a calibration of ``decoders``, one per row of its table) after its leading
    shapes -- :data:`TREE_FINALISTS` at most, calibrated at :data:`TREE_FINAL_SHARE` of the
    leader's speed or more -- play :func:`final_steps` on ``prompts``: the final's fastest is the
    tree, its speedup the result's (each finalist's row gains ``final_speedup``)."""
    rows = result["table"]
    lead = max(row["tok_per_s"] for row in rows)
    ranked = sorted(range(len(rows)), key=lambda i: rows[i]["tok_per_s"], reverse=True)
    finalists = [i for i in ranked[:TREE_FINALISTS] if rows[i]["tok_per_s"] >= TREE_FINAL_SHARE * lead]
    if len(finalists) < 2:
        return result
    played = yield from final_steps(
        ar, {str(i): decoders[i] for i in finalists}, prompts, progress=progress, desc="tree final"
    )
    for i in finalists:
        rows[i]["final_speedup"] = played[str(i)]
    best = max(finalists, key=lambda i: played[str(i)])
    speedup = played[str(best)]
    return {
        **result,
        "tree": rows[best]["tree"],
        "tok_per_s": speedup * result["ar_tok_per_s"],  # in the calibration's AR units
        "speedup": speedup,
        "beats_ar": speedup > 1.0,
    }


def _release(decoders: Iterable[Decoder]) -> None:
    """Close the decoders a timing built (an evospec decoder's retrieval worker among what
    they hold) and free them now rather than whenever the cyclic collector runs: a
    calibration builds a dozen per method, and the final and the serving that follow it run
    in the same process."""
    for dec in decoders:
        close = getattr(dec, "close", None)
        if close is not None:
            close()
    gc.collect()


def _time_candidates(ar, decoders, candidates, prompts, max_new_tokens, passes, progress) -> Steps[dict]:
    """:func:`calibrate`'s timing loop over the recorded ``decoders`` (one per candidate)."""
    from tqdm.auto import tqdm

    params = SamplingParams(max_new_tokens=max_new_tokens)
    for dec in [ar, *decoders.values()]:
        yield from warm(dec, prompts[0], SamplingParams(max_new_tokens=4))
    # a first AR run: the tokens every full run writes (every decoder writes AR's), the unit a
    # leader's time is counted in
    total_tokens, seconds = yield from timed(ar, prompts, params)
    ar_speed = total_tokens / seconds
    speed = {key: 0.0 for key in decoders}
    with tqdm(total=passes * len(decoders), desc="tune tree", unit="shape", disable=not progress) as bar:
        for p in range(passes):
            for i, (key, dec) in enumerate(decoders.items()):
                leader = max(speed.values())  # the best run so far, of any shape
                if p and speed[key] < PRUNE * leader:  # hopeless: noise only slows, never speeds up
                    bar.update(1)
                    continue
                if i % AR_EVERY == 0:
                    ar_speed = max(ar_speed, (yield from rate(ar, prompts, params)))
                # every candidate writes the same tokens (greedy), so one that is still running
                # after 1 / PRUNE times the leader's time is below PRUNE x its speed: stop it there
                deadline = total_tokens / (PRUNE * leader) if leader > 0 and total_tokens else math.inf
                speed[key] = max(speed[key], (yield from rate(dec, prompts, params, deadline)))
                bar.update(1)
    table = [
        {"tree": asdict(tree), "tok_per_s": speed[i], "speedup": speed[i] / ar_speed}
        for i, tree in enumerate(candidates)
    ]
    best = max(table, key=lambda row: row["tok_per_s"])
    return {
        "tree": best["tree"],
        "tok_per_s": best["tok_per_s"],
        "ar_tok_per_s": ar_speed,
        "speedup": best["speedup"],
        "beats_ar": best["speedup"] > 1.0,
        "table": table,
    }


def final(
    ar: Decoder, decoders: dict[str, Decoder], prompts: Sequence[list[int]], **options
) -> dict[str, float]:
    """:func:`final_steps` run to its end at once (``pausable.drive``)."""
    return drive(final_steps(ar, decoders, prompts, **options))


def final_steps(
    ar: Decoder,
    decoders: dict[str, Decoder],
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int = FINAL_TOKENS,
    rounds: int = FINAL_ROUNDS,
    progress: bool = True,
    desc: str = "method final",
) -> Steps[dict[str, float]]:
    """Speedup over AR of each of ``decoders`` (greedy), timed interleaved with AR: in every
    round each prompt is decoded once by every entrant, AR among them, in an order that rotates
    by one from prompt to prompt, so a slow minute of the machine falls on all of them alike.
    Each entrant keeps its fastest run of every prompt (noise only slows), and its speed is its
    tokens over the sum of those times. Pausable steps (``pausable.py``): a run a pause
    interrupts is timed again."""
    from tqdm.auto import tqdm

    entrants = {"ar": ar, **decoders}
    names = list(entrants)
    record_steps(getattr(ar, "model", None), decoders.values())
    params = SamplingParams(max_new_tokens=max_new_tokens)
    best = {name: [math.inf] * len(prompts) for name in names}
    tokens = {name: [0] * len(prompts) for name in names}
    with _live_cache_only(entrants.values()):
        for dec in entrants.values():
            yield from warm(dec, prompts[0], SamplingParams(max_new_tokens=4))
        total = rounds * len(prompts) * len(names)
        with tqdm(total=total, desc=desc, unit="run", disable=not progress) as bar:
            for r in range(rounds):
                for j, ids in enumerate(prompts):
                    turn = (r * len(prompts) + j) % len(names)
                    for name in names[turn:] + names[:turn]:
                        tokens[name][j], seconds = yield from timed(entrants[name], [ids], params)
                        best[name][j] = min(best[name][j], seconds)
                        bar.update(1)
    speed = {name: sum(tokens[name]) / max(sum(best[name]), 1e-9) for name in names}
    return {name: speed[name] / max(speed["ar"], 1e-9) for name in decoders}


def _cache_file() -> Path:
    from evospec.common import evospec_home

    return evospec_home() / "tuning" / "trees.json"


# what --method auto chose: (method, the tree it was measured with or None for ar, speedup over AR
# by candidate)
Choice = tuple[str, TreeConfig | None, dict[str, float]]


def speedup_of(result: dict) -> float:
    """A calibration's speedup over AR (older cache entries hold only the two speeds)."""
    return result.get("speedup", result["tok_per_s"] / max(result["ar_tok_per_s"], 1e-9))


class NotTuned(LookupError):
    """A timing the cache does not hold, asked of a ``cache_only`` :class:`Tuner`."""


@dataclass(frozen=True)
class Tuner:
    """What every tuning run of one stack shares: how to build a decoder for (method, tree),
    the loaded model, the head's id, EOS ids, how verification projects (``verify_logits``
    changes what a big tree costs, so it is part of the cache key) and whether to print."""

    build: Callable[[str, TreeConfig], Decoder]
    loaded: Any  # evospec.models.loading.LoadedModel
    draft_id: str  # the heads and the n-gram table a drafted method's timings depend on
    eos: Sequence[int] = ()
    verify_logits: str = "auto"
    progress: bool = True
    table: bool = False  # the model has an n-gram table: the candidates include its shapes
    cache_only: bool = False  # read timings from the cache only; a missing one raises NotTuned
    # what a method that drafts nothing (ngram) depends on: the n-gram table alone, so that its
    # shape is found whether or not a head was loaded beside it (None: draft_id)
    plain_id: str | None = None

    def _key(self, method: str) -> str:
        from evospec.models.packing import PackedLinear

        packed = isinstance(getattr(self.loaded.model, "lm_head", None), PackedLinear)
        kernels = "onednn-packed" if packed else "dense"  # packing changes what a verify costs
        weights = self.loaded.weights
        if weights != "fp32":  # quantised weights: another cost curve (int4's verify is ~flat to 4 rows)
            kernels = f"weights-{weights}"
        if weights in ("int4", "int8"):  # int8 activations (VNNI) or torch's bf16 ones: other costs per row
            from evospec.models.quant import quant_kernel

            kernels += f"-{quant_kernel(16)}"
            if quant_kernel(16) == "vnni":  # the weights' prefetch: 2.6x a step on some machines
                from evospec.kernels.prefetch import current

                kernels += f"-pf-{current()}"
        if getattr(self.loaded, "huge_page_bytes", 0):
            kernels += "-huge-pages"  # the weights in 2 MB pages: steps ~8% shorter on some machines
        if getattr(self.loaded.model, "step_graph", None) is not None:
            kernels += "+step-graph"  # a cheaper AR step: the bar speculation must clear
        if getattr(self.loaded.model, "fused_ops", False):
            from evospec.kernels.cpu_ops import build_key

            kernels += f"+fused-ops-{build_key()}"  # cheaper still, its own rounding; a new build: new costs
        drafts = self.draft_id
        if self.plain_id is not None and method in METHOD_SPECS and METHOD_SPECS[method].head is None:
            drafts = self.plain_id
        parts = [self.loaded.name, drafts, method, machine_key(), torch.__version__, kernels]
        # v1 read training data; v3: the candidates gained the 1-token chain; v4: context lookup
        # and a prompt that answers from its context (older entries never tried them); v6: AR timed
        # beside every shape; the n-gram table's shapes are in the candidates where draft_id names one;
        # v7: every graph recorded and warmed before timing, stopping chains among the candidates;
        # v8: the leading shapes play a final (TREE_FINALISTS); v9: fans (depth-1 trees) among
        # the candidates, verified through recorded tree graphs
        return "|".join([*parts, f"verify-{self.verify_logits}", "prompts-v9"])

    def _cached(self, key: str, measure: Callable[[], Steps[dict]]) -> Steps[dict]:
        """The cache's entry ``key``, measured by ``measure`` and stored first if missing (the
        file is read again before the write: another process may have tuned meanwhile); with
        ``cache_only``, a missing entry raises :class:`NotTuned` instead."""
        path = _cache_file()
        cache = json.loads(path.read_text()) if path.exists() else {}
        if key not in cache:
            if self.cache_only:
                raise NotTuned(key)
            result = yield from measure()
            cache = json.loads(path.read_text()) if path.exists() else {}
            cache[key] = result
            replace_json(path, cache)
        return cache[key]

    def _prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """``texts`` as one-turn chats, token ids."""
        codec = self.loaded.codec
        if codec is None:
            raise ValueError("auto tuning needs a model with a tokenizer for its calibration prompts")
        return [codec.encode_chat([{"role": "user", "content": t}]) for t in texts]

    def tuning(self, method: str) -> dict:
        """The cached (or freshly measured) calibration of ``method``: ``calibrate``'s result."""
        return drive(self.tuning_steps(method))

    def tuning_steps(self, method: str) -> Steps[dict]:
        """:meth:`tuning` as pausable steps."""

        def measure() -> Steps[dict]:
            return calibrate_steps(
                lambda t: self.build(method, t),
                ARDecoder(self.loaded.model, self.eos),
                self._prompts(CALIBRATION_TEXTS),
                candidates=candidates_for(method, self.table),
                progress=self.progress,
                final_prompts=self._prompts(FINAL_TEXTS),
            )

        return (yield from self._cached(self._key(method), measure))

    def cached_tree(self, method: str) -> TreeConfig | None:
        """:meth:`tree` where its timing is cached; None where it is not (nothing is measured)."""
        try:
            return TreeConfig(**drive(replace(self, cache_only=True).tuning_steps(method))["tree"])
        except NotTuned:
            return None

    def tree(self, method: str) -> TreeConfig:
        """The fastest measured shape for ``method`` (``--tree auto``); prints it."""
        result = self.tuning(method)
        tree = TreeConfig(**result["tree"])
        if self.progress:
            verdict = "beats" if result["beats_ar"] else "does NOT beat"
            lookup = f" lookup={tree.lookup} lookup_ngram={tree.lookup_ngram}" if tree.lookup else ""
            lookup += f" table_lookup={tree.table_lookup}" if tree.table_lookup else ""
            lookup += f" min_prob={tree.min_prob:g}" if tree.min_prob else ""
            print(
                f"[evospec] --tree auto for {method}: top_k={tree.top_k} depth={tree.depth} "
                f"total_tokens={tree.total_tokens}{lookup} ({result['tok_per_s']:.2f} tok/s; {verdict} AR at "
                f"{result['ar_tok_per_s']:.2f} tok/s on this machine)",
                file=sys.stderr,
            )
        return tree

    def final(self, finalists: Sequence[str], trees: dict[str, TreeConfig]) -> dict[str, float]:
        """The cached (or freshly measured) :func:`final` of ``finalists`` at their tuned trees:
        speedup over AR by name. The key names the trees too: a calibration measured again to
        another shape plays a new final."""
        return drive(self.final_steps(finalists, trees))

    def final_steps(self, finalists: Sequence[str], trees: dict[str, TreeConfig]) -> Steps[dict[str, float]]:
        """:meth:`final` as pausable steps."""

        def measure() -> Steps[dict]:
            prompts = self._prompts(FINAL_TEXTS)
            decoders = {}
            try:
                for name in finalists:
                    decoders[name] = self.build(name, trees[name])
                    yield from checkpoint()
                ar = ARDecoder(self.loaded.model, self.eos)
                speedups = yield from final_steps(ar, decoders, prompts, progress=self.progress)
            finally:
                _release(decoders.values())
            return {"speedups": speedups}

        shapes = ";".join(f"{n}={json.dumps(asdict(trees[n]), sort_keys=True)}" for n in finalists)
        version = f"final-v1-{FINAL_ROUNDS}x{len(FINAL_TEXTS)}"
        key = "|".join([self._key("final:" + ",".join(finalists)), version, shapes])
        return (yield from self._cached(key, measure))["speedups"]

    def method(self, candidates: Sequence[str]) -> Choice:
        """The fastest lossless method here (``--method auto``): (name, its tuned tree, speedup
        over AR per candidate). Each candidate is calibrated at its best tree shape; the leading
        ones (:data:`FINALISTS`, calibrated at :data:`FINAL_FLOOR` x AR or more) then meet AR in
        one interleaved :func:`final`, whose speedups replace their calibrations'. The faster
        finalist wins, and ``ar`` (tree None) when its speedup does not exceed :data:`AUTO_MARGIN`
        or no candidate reached the final."""
        return drive(self.method_steps(candidates))

    def cached_method(self, candidates: Sequence[str]) -> Choice | None:
        """:meth:`method`'s answer where every timing it needs is cached; None where one is not
        (nothing is measured)."""
        try:
            return drive(replace(self, cache_only=True, progress=False).method_steps(candidates))
        except NotTuned:
            return None

    def method_steps(self, candidates: Sequence[str]) -> Steps[Choice]:
        """:meth:`method` as pausable steps."""
        speedups: dict[str, float] = {}
        trees: dict[str, TreeConfig] = {}
        for name in candidates:
            res = yield from self.tuning_steps(name)
            speedups[name] = speedup_of(res)
            trees[name] = TreeConfig(**res["tree"])
        ranked = sorted(speedups, key=speedups.__getitem__, reverse=True)
        finalists = [n for n in ranked[:FINALISTS] if speedups[n] >= FINAL_FLOOR]
        calibrated = dict(speedups)
        if finalists:
            speedups.update((yield from self.final_steps(finalists, trees)))
        # only a finalist can win: the others' calibrations are what the final corrects
        best = max(finalists, key=speedups.__getitem__, default=None)
        chosen = best if best is not None and speedups[best] > AUTO_MARGIN else "ar"
        if self.progress:
            table = ", ".join(f"{n} {x:.2f}x" for n, x in calibrated.items())
            played = ", ".join(f"{n} {speedups[n]:.2f}x" for n in finalists) or "none at the floor"
            print(
                f"[evospec] --method auto: {chosen} (speedup over AR on this machine, calibrated: {table}; "
                f"final, interleaved with AR: {played})",
                file=sys.stderr,
            )
        return chosen, trees.get(chosen), speedups
