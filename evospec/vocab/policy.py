"""Vocabulary policies: which target ids the draft head may propose in the next round.

Owns: the :class:`VocabPolicy` protocol, the per-round :class:`RoundFeedback` it observes, and
the four policies of the two papers. A policy sees token ids, target logits and target hidden
states; it never touches the draft head's buffers (``head.py`` does) nor the decode loop.

- ``frspec`` (:class:`StaticVocab`): the top-K ids by corpus token frequency (FR-Spec, Zhao et
  al. 2025), fixed for the whole request.
- ``vocabtrim`` (:class:`StaticVocab` too): the top-K ids by how often the target itself writes
  them in its answers to training prompts (VocabTrim, Goel et al. 2025; ``indices/vocabtrim.py``),
  at FR-Spec's size, so the two compare at equal budgets.
- ``nanospec`` (:class:`NanoSpecVocab`): NanoSpec's candidate stream. Prefill appends the
  prompt tokens, then the top-K_pre ids of every prompt position's target logits; every round
  appends the unique draft-tree tokens, then the top-K_ver ids of the target logits at each
  node of the verified path (the accepted nodes and the node that produced the bonus token).
  Active = the unique ids among the last W_max stream entries (``window.py``).
- ``evospec`` (:class:`EvoSpecVocab`): a static core (the frequency table) plus an ARC buffer
  (``arc.py``). On an OOV event (the bonus token was outside the active set) the target's top
  ids at that position and its hidden state go to the asynchronous retrieval pool
  (``retrieval.py``); finished results are admitted through ARC at the start of the first round
  after they are ready. Verified tokens that sit in the buffer count as ARC hits. The buffer
  lives as long as the decoder (server scope: it adapts to the traffic) unless
  ``persist=False`` resets it per request; in-flight retrievals never cross requests.
- ``nanospec+evospec`` (:class:`NanoSpecEvoVocab`): the NanoSpec window and the ARC buffer fed
  by the same retrieval, sharing one size budget (window entries = budget - ARC capacity).

Glossary (docs/engine.md): an *OOV event* is a round whose bonus token was not active;
*coverage* is the share of verified tokens (accepted + bonus) that were active.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from evospec.vocab.arc import ARCBuffer, ARCConfig
from evospec.vocab.retrieval import RetrievalPool
from evospec.vocab.window import CandidateWindow


@dataclass
class RoundFeedback:
    """What one verified round tells a policy (tensors on the model's device)."""

    tree_tokens: torch.Tensor  # [N] draft tree token ids, node 0 = root (last committed token)
    verified: torch.Tensor  # [a + 1] accepted ids then the bonus id
    # [a + 1, V] target logits at the path nodes, row -1 produced the bonus (a policy that does
    # not learn from rounds, ``observes`` False, is handed no feedback at all)
    path_logits: torch.Tensor | None
    bonus_hidden: torch.Tensor  # [D] target feature at the node whose logits produced the bonus
    oov: bool  # the bonus token was outside the active vocabulary
    round_index: int  # rounds since the request started (0 = first round)


@dataclass
class PolicyStats:
    """Per-round extras a policy reports (reset by :meth:`VocabPolicy.take_stats`)."""

    retrieval_s: list[float] = field(default_factory=list)  # latencies of results merged this round
    late: int = 0  # merged results that missed the round right after their event
    errors: int = 0  # retrievals that raised
    dropped: int = 0  # events not submitted because the pool was saturated (stalled worker)
    admitted: int = 0  # ids inserted into the ARC buffer
    evicted: int = 0


class VocabPolicy(Protocol):
    name: str
    capacity: int  # most ids the policy ever makes active (sizes the reduced head)
    prefill_top_k: int  # top-K ids per prompt position the policy wants at prefill (0 = none)
    observes: bool  # learns from rounds (False: no feedback is built for it, no logits gathered)
    # its set changes rarely (a fixed table; an ARC buffer filled on OOV events), not every round:
    # a head may keep its slots in a layout that costs a repack per change (head.py: _SlotTiles4)
    steady: bool

    def start(
        self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden: torch.Tensor | None = None
    ) -> None:
        """New request: prompt ids [P], if asked for the prefill top ids [P, prefill_top_k], and
        the target's feature at the last prompt position [D] (the first round's context)."""
        ...

    def active_mask(self, round_index: int) -> torch.Tensor:
        """[V] bool: ids active for this round (merges finished asynchronous work first)."""
        ...

    def observe(self, fb: RoundFeedback) -> None: ...

    def take_stats(self) -> PolicyStats: ...

    def state(self) -> dict:
        """JSON-able snapshot for the admin API (sizes; the ARC lists and p where there is one)."""
        ...

    def reset_dynamic(self) -> dict | None:
        """Forget what was learnt while serving (the ARC buffer); None if the policy keeps nothing."""
        ...

    def dynamic_state(self) -> dict | None:
        """What was learnt while serving, JSON-able (the ARC buffer's ``state_dict``), for a
        restart snapshot; None if the policy keeps nothing."""
        ...

    def load_dynamic_state(self, state: dict) -> None:
        """Restore :meth:`dynamic_state`; ValueError (state untouched) if it does not fit."""
        ...

    def close(self) -> None: ...


def frspec_size(vocab_size: int) -> int:
    """Default FR-Spec table size: 32,768 for vocabularies of 128k and more (the paper's
    optimum for 128k-152k), and V / 4 (rounded up to a multiple of 256) below that, keeping
    the paper's 32k / 128k ratio for small vocabularies such as SmolLM2's 49,152."""
    quarter = -(-vocab_size // 4 // 256) * 256
    return min(vocab_size, 32768, quarter)


def _mask_of(ids: torch.Tensor | np.ndarray | list[int], vocab_size: int, device) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)
    mask[ids_t[(ids_t >= 0) & (ids_t < vocab_size)]] = True
    return mask


class StatelessPolicy:
    """The answers of a policy that learns nothing while serving (no ARC buffer, no stats)."""

    name: str
    observes = True
    steady = False  # a window or router picks ids every round

    def take_stats(self) -> PolicyStats:
        return PolicyStats()

    def reset_dynamic(self) -> dict | None:
        return None

    def dynamic_state(self) -> dict | None:
        return None

    def load_dynamic_state(self, state: dict) -> None:
        raise ValueError(f"policy {self.name} keeps no dynamic state")

    def close(self) -> None:
        pass


class StaticVocab(StatelessPolicy):
    """FR-Spec: a fixed top-K frequency table."""

    prefill_top_k = 0
    observes = False  # a fixed table
    steady = True

    def __init__(self, top_ids: np.ndarray | list[int], vocab_size: int, device="cpu", name: str = "frspec"):
        self.name = name
        self.mask = _mask_of(top_ids, vocab_size, device)  # [V]
        self.capacity = int(self.mask.sum())

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        pass

    def active_mask(self, round_index: int) -> torch.Tensor:
        return self.mask

    def observe(self, fb: RoundFeedback) -> None:
        pass

    def state(self) -> dict:
        return {"policy": self.name, "static_size": self.capacity}


@dataclass(frozen=True)
class NanoSpecConfig:
    k_pre: int = 3  # top ids per prompt position appended at prefill
    k_ver: int = 3  # top ids per verified-path node appended each round
    w_max: int = 3072  # window of stream entries (bounds the active size)


def _append_round(window: CandidateWindow, fb: RoundFeedback, k_ver: int) -> None:
    draft = torch.unique(fb.tree_tokens[1:])  # [u] C_draft
    ver = torch.topk(fb.path_logits, k_ver, dim=-1).indices.flatten()  # [(a + 1) * k_ver] C_ver
    window.push(torch.cat([draft, ver]))


def _seed_window(window: CandidateWindow, prompt: torch.Tensor, prefill_top: torch.Tensor | None) -> None:
    window.reset()
    window.push(prompt)
    if prefill_top is not None:
        window.push(prefill_top.flatten())


class NanoSpecVocab(StatelessPolicy):
    """NanoSpec: the unique ids among the last W_max candidate-stream entries."""

    name = "nanospec"

    def __init__(self, vocab_size: int, cfg: NanoSpecConfig = NanoSpecConfig(), device="cpu") -> None:
        self.cfg = cfg
        self.window = CandidateWindow(vocab_size, cfg.w_max, device=device)
        self.capacity = min(vocab_size, cfg.w_max)
        self.prefill_top_k = cfg.k_pre

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        _seed_window(self.window, prompt, prefill_top)

    def active_mask(self, round_index: int) -> torch.Tensor:
        return self.window.active_mask()

    def observe(self, fb: RoundFeedback) -> None:
        _append_round(self.window, fb, self.cfg.k_ver)

    def state(self) -> dict:
        return {"policy": self.name, "window": self.cfg.w_max, "window_size": self.window.size}


class _RetrievalFed:
    """ARC buffer fed by the asynchronous retrieval pool (shared by the two EvoSpec policies)."""

    def __init__(
        self, vocab_size: int, arc: ARCConfig, pool: RetrievalPool | None, top_n: int, device, persist: bool
    ) -> None:
        self.vocab_size = vocab_size
        self.persist = persist  # keep the buffer across requests (server scope) or not
        self.arc = ARCBuffer(arc)
        self.pool = pool
        self.top_n = top_n
        self.device = device
        self.stats = PolicyStats()
        self._dyn = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] ARC members

    def start(self) -> None:
        """New request: drop in-flight retrievals; keep the buffer only in server scope."""
        if self.pool is not None:
            self.pool.reset()
        if not self.persist:
            self.reset()

    def reset(self) -> None:
        self.arc.reset()
        self._dyn = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)

    def reset_dynamic(self) -> dict:
        """Empty the buffer (``p`` back to its start) and drop in-flight retrievals; what was cleared."""
        cleared = {
            "arc_size": len(self.arc),
            "ghosts": len(self.arc.b1) + len(self.arc.b2),
            "pending_retrievals": self.pool.pending if self.pool is not None else 0,
        }
        self.reset()
        if self.pool is not None:
            self.pool.reset()
        return cleared

    def dynamic_state(self) -> dict:
        return self.arc.state_dict()

    def load_dynamic_state(self, state: dict) -> None:
        """Restore an ARC snapshot (ValueError, buffer untouched, if it was taken under another
        ARC config or breaks an invariant); the ids must lie inside this vocabulary."""
        ids = [int(tok) for lst in ("t1", "t2") for tok, _ in state.get(lst, ())]
        if any(tok >= self.vocab_size for tok in ids):
            raise ValueError(f"ARC state holds ids outside the vocabulary of {self.vocab_size}")
        self.arc.load_state_dict(state)
        self._dyn = _mask_of(self.arc.ids(), self.vocab_size, self.device)

    def merge(self, round_index: int, exclude: torch.Tensor) -> torch.Tensor:
        """Admit every finished retrieval (minus ids already active via ``exclude`` [V]); [V] mask."""
        if self.pool is None:
            return self._dyn
        changed = False
        for res in self.pool.poll(round_index):
            if res.error is not None:
                self.stats.errors += 1
                continue
            self.stats.retrieval_s.append(res.latency_s)
            self.stats.late += res.late
            cand = torch.as_tensor(res.ids, dtype=torch.long, device=self.device)  # [c] priority order
            cand = cand[(cand >= 0) & (cand < self.vocab_size)]
            out = self.arc.admit(cand[~exclude[cand]].tolist())
            self.stats.admitted += len(out.inserted)
            self.stats.evicted += len(out.evicted)
            changed = True
        if changed:
            self._dyn = _mask_of(self.arc.ids(), self.vocab_size, self.device)
        return self._dyn

    def observe(self, fb: RoundFeedback) -> None:
        self.arc.tick()
        verified = fb.verified.tolist()
        self.arc.touch([t for t in verified if t in self.arc])
        if fb.oov and self.pool is not None:
            top = torch.topk(fb.path_logits[-1], self.top_n).indices  # [top_n]
            submitted = self.pool.submit(
                fb.round_index, top.cpu().numpy(), fb.bonus_hidden.float().cpu().numpy()
            )
            self.stats.dropped += not submitted

    def take_stats(self) -> PolicyStats:
        out, self.stats = self.stats, PolicyStats()
        return out

    def state(self) -> dict:
        return {
            "arc": self.arc.state_dict(),
            "arc_size": len(self.arc),
            "p": self.arc.p,
            "persist": self.persist,
            "pending_retrievals": self.pool.pending if self.pool is not None else 0,
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class EvoSpecVocab:
    """EvoSpec's vocabulary path: static core ∪ ARC buffer of retrieved ids."""

    name = "evospec"
    prefill_top_k = 0
    observes = True  # the bonus row's top ids seed its retrieval
    steady = True  # the core is fixed; ARC admits up to arc_max_insert ids per OOV event

    def __init__(
        self,
        core_ids: np.ndarray | list[int],
        vocab_size: int,
        pool: RetrievalPool | None,
        *,
        arc: ARCConfig | None = None,
        top_n: int = 10,
        persist: bool = True,
        device="cpu",
    ) -> None:
        self.core = _mask_of(core_ids, vocab_size, device)  # [V]
        arc = arc or ARCConfig()
        self.dyn = _RetrievalFed(vocab_size, arc, pool, top_n, device, persist)
        self.capacity = min(vocab_size, int(self.core.sum()) + arc.capacity)

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        self.dyn.start()

    def active_mask(self, round_index: int) -> torch.Tensor:
        return self.core | self.dyn.merge(round_index, self.core)

    def observe(self, fb: RoundFeedback) -> None:
        self.dyn.observe(fb)

    def take_stats(self) -> PolicyStats:
        return self.dyn.take_stats()

    def state(self) -> dict:
        return {"policy": self.name, "static_size": int(self.core.sum()), **self.dyn.state()}

    def reset_dynamic(self) -> dict | None:
        return self.dyn.reset_dynamic()

    def dynamic_state(self) -> dict | None:
        return self.dyn.dynamic_state()

    def load_dynamic_state(self, state: dict) -> None:
        self.dyn.load_dynamic_state(state)

    def close(self) -> None:
        self.dyn.close()


class NanoSpecEvoVocab:
    """NanoSpec window ∪ EvoSpec ARC buffer within one budget (window = budget - ARC capacity)."""

    name = "nanospec+evospec"
    observes = True  # the verified path's top ids grow its window, the bonus row's seed retrieval
    steady = False  # its window changes every round

    def __init__(
        self,
        vocab_size: int,
        pool: RetrievalPool | None,
        *,
        nano: NanoSpecConfig = NanoSpecConfig(),
        arc: ARCConfig | None = None,
        top_n: int = 10,
        persist: bool = True,
        device="cpu",
    ) -> None:
        arc = arc or ARCConfig()
        if nano.w_max <= arc.capacity:
            raise ValueError(f"budget {nano.w_max} must exceed the ARC capacity {arc.capacity}")
        self.cfg = nano
        self.window = CandidateWindow(vocab_size, nano.w_max - arc.capacity, device=device)
        self.dyn = _RetrievalFed(vocab_size, arc, pool, top_n, device, persist)
        self.capacity = min(vocab_size, nano.w_max)
        self.prefill_top_k = nano.k_pre

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        _seed_window(self.window, prompt, prefill_top)
        self.dyn.start()

    def active_mask(self, round_index: int) -> torch.Tensor:
        win = self.window.active_mask()
        return win | self.dyn.merge(round_index, win)

    def observe(self, fb: RoundFeedback) -> None:
        _append_round(self.window, fb, self.cfg.k_ver)
        self.dyn.observe(fb)

    def take_stats(self) -> PolicyStats:
        return self.dyn.take_stats()

    def state(self) -> dict:
        return {
            "policy": self.name,
            "window": self.window.w_max,
            "window_size": self.window.size,
            **self.dyn.state(),
        }

    def reset_dynamic(self) -> dict | None:
        return self.dyn.reset_dynamic()

    def dynamic_state(self) -> dict | None:
        return self.dyn.dynamic_state()

    def load_dynamic_state(self, state: dict) -> None:
        self.dyn.load_dynamic_state(state)

    def close(self) -> None:
        self.dyn.close()
