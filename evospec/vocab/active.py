"""The active vocabulary of one speculative decoder: a policy driving a draft head.

Owns: :class:`ActiveVocab`, the glue the round loop calls at three points -- ``start`` (after
the prefill: seeds the policy, with the prompt's top target ids if it wants them),
``begin_round`` (before drafting: marks the active set stale; :meth:`ActiveVocab.draft_head`
loads the policy's active ids, plus the always-active EOS ids, into the reduced head at the
round's first LM-head call, after the draft backbone ran) and ``end_round`` (after
verification: coverage and the OOV flag are measured against the set the round drafted from,
and the policy observes the round). With ``policy=None`` the draft uses the full LM head
(EAGLE-2) and coverage is 1. The ``specvocab`` policy has no per-round set: its head
(``TwoStageHead``) picks candidates at every draft step, and the round's set is the union of
the candidates it used (``per_step``). Returns one :class:`VocabRoundStats` per round for the step event.

With ``overlap`` (the default when the LM head lives on CUDA) the next round's set is asked of
the policy at the end of ``end_round`` (and at ``start``) -- the accept boundary, where the
loop synchronises anyway -- and staged into the reduced head (``ReducedHead.stage``): its rows
are gathered on the copy stream while the next round's draft backbone runs, and the compute
stream waits for them only at that round's first LM-head call. Retrieval results that finish
after the accept boundary then make the round after. Off CUDA the default keeps the
load-at-first-head-call path; ``overlap=True`` there runs the staged path inline (same sets).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from evospec.models.quant import Int8Matmul
from evospec.vocab.head import Chooser, FullHead, Projection, ReducedHead, TwoStageHead
from evospec.vocab.policy import RoundFeedback, VocabPolicy
from evospec.vocab.routed import SpecVocabPolicy


@dataclass
class VocabRoundStats:
    """Vocabulary facts of one round (see the glossary in docs/engine.md)."""

    active_size: int  # ids the draft could propose this round
    verified: int  # accepted + bonus tokens of the round
    covered: int  # of those, how many were active
    oov: bool  # the bonus token was not active (an OOV event)
    lm_head_s: float = 0.0  # draft LM-head projection + top-k, summed over the round's calls
    gather_s: float = 0.0  # loading newly active rows into the packed head
    rows_gathered: int = 0
    policy_s: float = 0.0  # the policy's own bookkeeping after verification
    retrieval_s: list[float] = field(default_factory=list)  # latency of each result merged this round
    late: int = 0  # merged results that came after the round they were meant for
    errors: int = 0  # retrievals that raised
    dropped: int = 0  # OOV events not retrieved because the worker was saturated


@dataclass
class VocabTotals:
    """:class:`VocabRoundStats` summed over rounds (one request, a benchmark run, a server's life)."""

    rounds: int = 0  # rounds that reported vocabulary facts (every speculative round)
    verified: int = 0  # accepted + bonus tokens of those rounds (before clipping at a stop)
    covered: int = 0  # of those, how many were in the round's active vocabulary
    oov_events: int = 0  # rounds whose bonus token was not active
    active_size_sum: int = 0  # active vocabulary size, summed over rounds
    lm_head_s: float = 0.0
    gather_s: float = 0.0
    rows_gathered: int = 0
    policy_s: float = 0.0
    retrievals: int = 0  # retrieval results merged (late ones included)
    retrieval_s: float = 0.0  # their latencies, summed
    late: int = 0  # merged results that missed the round right after their OOV event
    errors: int = 0  # retrievals that raised
    dropped: int = 0  # OOV events not retrieved because the worker was saturated
    latencies: list[float] | None = None  # each merged result's latency, kept only when not None

    def add(self, st: VocabRoundStats) -> None:
        self.rounds += 1
        self.verified += st.verified
        self.covered += st.covered
        self.oov_events += st.oov
        self.active_size_sum += st.active_size
        self.lm_head_s += st.lm_head_s
        self.gather_s += st.gather_s
        self.rows_gathered += st.rows_gathered
        self.policy_s += st.policy_s
        self.retrievals += len(st.retrieval_s)
        self.retrieval_s += sum(st.retrieval_s)
        self.late += st.late
        self.errors += st.errors
        self.dropped += st.dropped
        if self.latencies is not None:
            self.latencies.extend(st.retrieval_s)

    def merge(self, other: VocabTotals) -> None:
        """Add ``other``'s totals to these (its latencies too, when these keep them)."""
        for f in fields(self):
            if f.name != "latencies":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        if self.latencies is not None:
            self.latencies.extend(other.latencies or ())

    def copy(self) -> VocabTotals:
        """An independent copy (the latency list is copied, not shared)."""
        return replace(self, latencies=None if self.latencies is None else list(self.latencies))

    @property
    def coverage(self) -> float | None:
        """Share of verified tokens that were active; None before the first round."""
        return self.covered / self.verified if self.verified else None

    @property
    def mean_active_size(self) -> float | None:
        return self.active_size_sum / self.rounds if self.rounds else None


_PREFILL_CHUNK = 64  # prompt positions per LM-head chunk when taking prefill top ids


class ActiveVocab:
    def __init__(
        self,
        policy: VocabPolicy | None,
        lm_head: torch.Tensor,
        always_ids: Sequence[int] = (),
        overlap: bool | None = None,
        project: Projection | None = None,
        *,
        prefill_project: Projection | None = None,
        row_ids: torch.Tensor | None = None,
        vocab_size: int | None = None,
        int4: bool = False,
    ) -> None:
        """``lm_head`` is the draft's LM head ([V, D]: the target's for EAGLE-2, an EAGLE-3
        head's own); ``project`` maps [n, D] draft features to its logits (default
        ``h @ lm_head.T``; pass :func:`evospec.models.packing.projection` of the LM head to share
        its packed copy). ``prefill_project``: the target's projection, for the prompt's top ids
        (default ``project``: the same head). ``row_ids`` [V_d]: the target id of each row of a
        reduced draft vocabulary (EAGLE-3 ``d2t``; only without a policy), ``vocab_size`` then
        the target's vocabulary. ``int4``: a reduced head over int8 LM-head rows projects them
        rounded to 4-bit groups (an int4 draft's; ``vocab/head.py``) where the policy is steady:
        a set change repacks whole tiles (~0.2 ms more for a few ids), too dear every round."""
        vocab = lm_head.shape[0] if row_ids is None else int(vocab_size)
        if row_ids is not None and policy is not None:
            raise ValueError(
                f"policy {policy.name} needs a draft head over the full vocabulary; this EAGLE-3 head drafts "
                f"over a fixed {lm_head.shape[0]}-id vocabulary (its d2t)"
            )
        self.policy = policy
        self.row_ids = row_ids
        self.lm_head = lm_head  # [V, D]
        self.project = project or (lambda h: h @ lm_head.T)
        self.prefill_project = prefill_project or self.project
        self.always = torch.zeros(vocab, dtype=torch.bool, device=lm_head.device)  # [V]
        self.always[[i for i in always_ids if 0 <= i < vocab]] = True
        self.head: FullHead | ReducedHead | TwoStageHead
        int8 = project if isinstance(project, Int8Matmul) else None  # gather the int8 codes
        if policy is None:
            self.head = FullHead(lm_head, self.project, row_ids)
        elif isinstance(policy, SpecVocabPolicy):  # candidates per draft step, not per round
            self.head = TwoStageHead(
                lm_head, policy.selector, policy.candidates, always=self.always, int8=int8
            )
        else:
            capacity = policy.capacity + int(self.always.sum())
            self.head = ReducedHead(lm_head, capacity, int8=int8, int4=int4 and policy.steady)
        self._round = 0
        self._stale = False  # the active set must be reloaded before the next head call
        self._mask = torch.ones(vocab, dtype=torch.bool, device=lm_head.device)  # [V] this round's set
        if row_ids is not None:  # a reduced draft vocabulary: it is the set every round drafts from
            self._mask = torch.zeros_like(self._mask)
            self._mask[row_ids] = True
        self.per_step = isinstance(self.head, TwoStageHead)
        self.overlap = (
            policy is not None and not self.per_step and (lm_head.is_cuda if overlap is None else overlap)
        )
        self._next_mask = self._mask  # [V] the set staged for the next round (overlap only)
        # the policy mask loaded, its version
        self._loaded: tuple[torch.Tensor | None, int | None] = (None, None)

    @property
    def observes(self) -> bool:
        """Whether :meth:`end_round` hands its policy the round (which then needs the path's target
        logits); coverage and OOV read the verified ids only."""
        return self.policy is not None and getattr(self.policy, "observes", True)

    @property
    def mask(self) -> torch.Tensor:
        """[V] bool: this round's active vocabulary (all True for the full head)."""
        return self._mask

    @property
    def name(self) -> str:
        if self.policy is None:
            return "full" if self.row_ids is None else "d2t"  # d2t: an EAGLE-3 head's fixed draft vocabulary
        return self.policy.name

    @torch.inference_mode()
    def prefill_top(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [P, D] -> the top-k target ids of every prompt position [P, k] (chunked)."""
        out = [
            torch.topk(self.prefill_project(hidden[i : i + _PREFILL_CHUNK]), k, dim=-1).indices
            for i in range(0, hidden.shape[0], _PREFILL_CHUNK)
        ]
        return torch.cat(out)

    def start(self, prompt: torch.Tensor, prefill_hidden: torch.Tensor) -> None:
        """prompt [P] ids; prefill_hidden [P, D] the target's features at the prompt positions."""
        self._round = 0
        self.head.take_timings()
        if self.policy is None:
            return
        k = self.policy.prefill_top_k
        self.policy.start(prompt, self.prefill_top(prefill_hidden, k) if k else None, prefill_hidden[-1])
        if self.overlap:
            self._stage_next()

    def _stage_next(self) -> None:
        """Ask the policy for round ``self._round``'s set now and start gathering its rows."""
        self._next_mask = self.policy.active_mask(self._round) | self.always
        self.head.stage(self._next_mask)

    def begin_round(self) -> None:
        """A round starts: the active set is refreshed at the round's first draft LM-head call."""
        self._stale = self.policy is not None
        if self.per_step:
            self.head.new_round()

    def draft_head(
        self, hidden: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's :class:`~evospec.decoding.drafter.DraftHeadFn`.

        The first call of a round loads the policy's active ids first. That call comes after the
        draft backbone has run over the newly verified tokens, so retrieval results that finish
        while the backbone runs still make this round (the paper's deadline: the reduced head).
        """
        if self._stale:
            self._stale = False
            if self.per_step:  # the head picks candidates itself; the round's set is what it saw
                self._mask = self.head.seen
            elif self.overlap:  # staged at the last accept boundary; the head waits for its rows
                self._mask = self._next_mask
            else:
                self._load(self.policy.active_mask(self._round))
        return self.head(hidden, k, choose)

    def _load(self, raw: torch.Tensor) -> None:
        """Make ``raw | always`` the head's set, unless ``raw`` is the very mask loaded last
        round, unmodified (a static table: FR-Spec, a fixed core): its merge and slot diff cost
        ~0.13 ms a round here for nothing."""
        version = _version(raw)
        if version is not None and raw is self._loaded[0] and version == self._loaded[1]:
            return
        self._mask = raw | self.always
        self.head.set_active(self._mask)
        self._loaded = (raw, version)

    def end_round(
        self,
        tree_tokens: torch.Tensor,  # [N] incl. the root
        path: torch.Tensor,  # [a + 1] node indices of the verified path, root first
        verified: Sequence[int],  # [a + 1] accepted ids then the bonus id
        path_logits: torch.Tensor | None,  # [a + 1, V] the target's logits along ``path`` (observes)
        hidden: torch.Tensor,  # [N, D] its features of every node
    ) -> VocabRoundStats:
        timings = self.head.take_timings()
        ids = list(verified)
        if self._mask.is_cpu:  # the round's few ids as Python bools off a numpy view: no torch op
            mask = self._mask.numpy()
            covered_mask = [mask.item(i) for i in ids]  # [a + 1]
        else:
            covered_mask = self._mask[torch.tensor(ids, device=self._mask.device)].tolist()
        oov = not covered_mask[-1]
        stats = VocabRoundStats(
            active_size=self.head.size,
            verified=len(ids),
            covered=sum(covered_mask),
            oov=oov,
            lm_head_s=timings.lm_head_s,
            gather_s=timings.gather_s,
            rows_gathered=timings.rows_gathered,
        )
        if self.observes:
            t0 = time.perf_counter()
            verified_t = torch.tensor(ids, dtype=torch.long, device=tree_tokens.device)  # [a + 1]
            fb = RoundFeedback(tree_tokens, verified_t, path_logits, hidden[path[-1]], oov, self._round)
            self.policy.observe(fb)
            extra = self.policy.take_stats()
            stats.policy_s = time.perf_counter() - t0
            stats.retrieval_s = extra.retrieval_s
            stats.late, stats.errors, stats.dropped = extra.late, extra.errors, extra.dropped
        self._round += 1
        if self.overlap:
            self._stage_next()
        return stats

    def state(self) -> dict:
        """JSON-able snapshot for the admin API."""
        out = {
            "policy": self.name,
            "active_size": self.head.size,
            "capacity": self.head.size if self.policy is None else self.head.capacity,
        }
        if self.policy is not None:
            out.update(self.policy.state())
        return out

    def reset_dynamic(self) -> dict | None:
        """Forget the policy's served-traffic state (ARC buffer); None if it keeps none."""
        return None if self.policy is None else self.policy.reset_dynamic()

    def dynamic_state(self) -> dict | None:
        """The policy's served-traffic state (ARC buffer), JSON-able; None if it keeps none."""
        return None if self.policy is None else self.policy.dynamic_state()

    def load_dynamic_state(self, state: dict) -> None:
        """Restore :meth:`dynamic_state` (ValueError, state untouched, if it does not fit)."""
        if self.policy is None:
            raise ValueError("the full vocabulary keeps no dynamic state")
        self.policy.load_dynamic_state(state)

    def close(self) -> None:
        if self.policy is not None:
            self.policy.close()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place modification counter, or None where it keeps none (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None
