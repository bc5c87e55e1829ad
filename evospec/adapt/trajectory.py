"""What one verified round teaches the draft: a :class:`Trajectory`, and the recorder that
builds it on the decode thread.

Owns: the per-request context store (every committed (feature, token) pair of the request,
exactly what the drafter committed, in one append-only buffer that the request's trajectories
share) and, at the end of a round, the cheap snapshot the worker needs to recompute the draft
forward along the verified path: a window onto that store ending at the root's pair (at most
``context`` pairs), the verified tokens, the target's top-``K_logit`` logits at every step (the
verified token is always part of that support), and per step whether the verified token was
in the active vocabulary and whether the draft's proposals there were all rejected. Nothing
here runs the draft or decides admission (see ``loss.py``); the decode thread only copies the
new pairs and takes one top-k.

Sharing: rows of the store are written once and never change, so a trajectory holds a view
(its window is ``[ctx_start, ctx_end)``) rather than a copy; when the store grows it is
reallocated, and the newer trajectories of the request hold the new buffer (a superset of
the old one). ``request`` names the store, so the worker can run a request's shared prefix
once for all of its trajectories (``unroll.py``).

Steps (EAGLE pairing, see ``decoding/drafter.py``): step 1 is the draft output at the root's
pair, which predicts the first verified token; step j > 1 feeds (step j-1's output,
verified token j-1) and predicts verified token j. A round with a accepted tokens has
a + 1 steps; the last one predicts the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trajectory:
    ctx_features: torch.Tensor  # [n, D] the request's committed target features (rows < ctx_end valid)
    ctx_tokens: torch.Tensor  # [n] the token after each of them
    tokens: torch.Tensor  # [s] verified ids: the accepted tokens, then the bonus
    support_ids: torch.Tensor  # [s, K] target's top-K ids per step (incl. the verified id)
    support_logits: torch.Tensor  # [s, K] their target logits
    target_index: torch.Tensor  # [s] where the verified id sits in its support row
    in_vocab: torch.Tensor  # [s] bool: verified id was in the round's active vocabulary
    rejected: torch.Tensor  # [s] bool: the draft proposed children there and none was accepted
    key: str | None = None  # adapter scope (conversation / tenant) it belongs to
    ready: object | None = None  # CUDA: an event marking when these tensors are written
    ctx_start: int = 0  # this round's context window [ctx_start, ctx_end): the root's pair last
    ctx_end: int | None = None  # None: all of ctx_tokens
    request: int | None = None  # trajectories with one id share their context store (None: alone)
    round: int = -1  # the adapter's round counter when recorded (publish-lag bookkeeping)

    def __post_init__(self) -> None:
        if self.ctx_end is None:
            self.ctx_end = int(self.ctx_tokens.shape[0])

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This round's context: features [c, D] and tokens [c] (views), the root's pair last."""
        lo, hi = self.ctx_start, self.ctx_end
        return self.ctx_features[lo:hi], self.ctx_tokens[lo:hi]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.ctx_features,
            self.ctx_tokens,
            self.tokens,
            self.support_ids,
            self.support_logits,
            self.target_index,
            self.in_vocab,
            self.rejected,
        )

    def nbytes(self) -> int:
        """Bytes of its own tensors; the shared context store is counted by :func:`stores_nbytes`."""
        return sum(t.numel() * t.element_size() for t in self.tensors()[2:])


def stores_nbytes(trajs) -> int:
    """Bytes of the distinct context stores ``trajs`` hold (a shared store counts once)."""
    seen: dict[int, int] = {}
    for t in trajs:
        for x in (t.ctx_features, t.ctx_tokens):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def retained_support(
    logits: torch.Tensor,  # [s, V] target logits at the path nodes
    verified: torch.Tensor,  # [s] verified ids
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k support per row, forced to contain the verified id -> (ids, logits, index) [s, k]."""
    k = min(k, logits.shape[-1])
    top = torch.topk(logits, k, dim=-1)
    ids, vals = top.indices, top.values  # [s, k]
    hit = ids == verified[:, None]  # [s, k]
    found = hit.any(-1)  # [s]
    # a sampled token outside the top-k replaces the weakest retained id
    last = torch.full_like(verified, k - 1)
    index = torch.where(found, hit.float().argmax(-1), last)  # [s]
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids = ids.clone()
    vals = vals.clone()
    ids[rows, index] = torch.where(found, ids[rows, index], verified)
    vals[rows, index] = torch.where(found, vals[rows, index], logits[rows, verified])
    return ids, vals, index


class Recorder:
    """Per-request context store and trajectory builder (decode thread only)."""

    _MIN_ROWS = 256  # first allocation of a request's store; it doubles when full, up to
    # 2 x context rows, after which it is rolled to the last `context` pairs

    def __init__(self, context: int, k_logit: int) -> None:
        self.context = context
        self.k_logit = k_logit
        self._feats: torch.Tensor | None = None  # [capacity, D] the request's store
        self._tokens: torch.Tensor | None = None  # [capacity]
        self._length = 0  # rows written
        self._request = 0  # serial of the current request's store

    def start(self) -> None:
        """A new request: a new store (the old one stays alive while trajectories hold it)."""
        self._feats = self._tokens = None
        self._length = 0
        self._request += 1

    def commit(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """The pairs the drafter commits this round: features [m, D], tokens [m]."""
        m, n = tokens.shape[0], self._length
        if self._feats is None or n + m > self._feats.shape[0]:
            if n + m > 2 * self.context:  # bound memory: a fresh store with the last `context` pairs
                if n:
                    features = torch.cat([self._feats[:n], features])
                    tokens = torch.cat([self._tokens[:n], tokens])
                features, tokens = features[-self.context :], tokens[-self.context :]
                m, n = tokens.shape[0], 0
                self._request += 1  # its rows are numbered anew: its trajectories form a new group
            rows = max(n + m, min(max(self._MIN_ROWS, 2 * (n + m)), 2 * self.context))
            feats = features.new_empty(rows, features.shape[1])
            toks = tokens.new_empty(rows)
            if n:  # rows already shared by trajectories are copied, never moved in place
                feats[:n], toks[:n] = self._feats[:n], self._tokens[:n]
            self._feats, self._tokens = feats, toks
        self._feats[n : n + m] = features
        self._tokens[n : n + m] = tokens
        self._length = n + m

    def trajectory(
        self,
        tree_parents: torch.Tensor,  # [N] parent node of every tree node (-1: root)
        path: torch.Tensor,  # [a + 1] verified path node indices, root first
        verified: torch.Tensor,  # [a + 1] accepted ids, then the bonus
        path_logits: torch.Tensor,  # [a + 1, V] target logits at the path nodes
        active: torch.Tensor | None,  # [V] bool this round's active vocabulary (None: all)
        key: str | None = None,
    ) -> Trajectory:
        if self._feats is None:
            raise RuntimeError("Recorder.trajectory before any commit")
        ids, vals, index = retained_support(path_logits.float(), verified, self.k_logit)
        s = verified.shape[0]
        in_vocab = active[verified] if active is not None else torch.ones(s, dtype=torch.bool)
        # accepted steps were proposed and accepted; the bonus step was rejected iff the last
        # path node had children in the tree (a leaf proposed nothing there)
        rejected = torch.zeros(s, dtype=torch.bool, device=verified.device)
        rejected[-1] = (tree_parents == path[-1]).any()
        end = self._length
        return Trajectory(
            ctx_features=self._feats,
            ctx_tokens=self._tokens,
            tokens=verified.clone(),
            support_ids=ids,
            support_logits=vals,
            target_index=index,
            in_vocab=in_vocab.clone(),
            rejected=rejected,
            key=key,
            ctx_start=max(0, end - self.context),
            ctx_end=end,
            request=self._request,
        )
