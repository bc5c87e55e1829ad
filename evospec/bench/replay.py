"""Replayed decoding: a speculative decoder's greedy rounds without running the target.

Owns: :class:`RecordedRequest` (one greedy answer of the target with its features and top-k
next-token log-probabilities at every position, recorded once with ``greedy_stream``) and
:func:`replay_request`, which drives a decoder's drafter, active vocabulary and online adapter
through that answer exactly as ``decoding/speculative.py`` does, with verification read off
the recording instead of a target forward. Each replayed round becomes a
:class:`~evospec.decoding.events.StepEvent` folded into a
:class:`~evospec.decoding.stats.RequestStats`, as a live run's are (counts only: no times and
no vocabulary facts).

Why this is exact for greedy decoding: every accepted prefix is a prefix of the greedy answer,
so the target's greedy choice at any tree node that acceptance visits is the answer's next
token, and the features the drafter commits are the target's features of the answer
positions. So a replay accepts the same tokens, in the same rounds, as a live run (up to the
float noise between a tree-masked verify forward and the recorded one), and hands the
adapter the same trajectories (its top-K support is the recorded one; K >= the adapter's
``k_logit``). What it does not give is wall time: use it to compare adaptation settings on
one recording (MAL per request) in a fraction of a live run's time, then confirm with
``evospec bench --scenario topic-shift``. One place a replay can differ: MAL counts a round's
accepted draft tokens before clipping, and a live run's last round may accept draft tokens
past the answer's end (past the length budget or an EOS); the recording stops there, so the
replay's last round accepts at most the tokens left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from evospec.decoding.events import StepEvent
from evospec.decoding.methods import SpeculativeDecoder
from evospec.decoding.stats import RequestStats
from evospec.decoding.tree import build_tree
from evospec.models.transformer import Transformer
from evospec.train.batch_generate import greedy_stream

_FLOOR = -1e4  # log-prob given to ids outside a recorded support row


@dataclass
class RecordedRequest:
    ids: torch.Tensor  # [L] prompt + greedy answer
    prompt_len: int  # P
    features: torch.Tensor  # [L - 1, D] target features (fp16) of every fed position
    support_ids: torch.Tensor  # [L - P - 1, K] top-K next-token ids at answer positions P..L-2
    support_logp: torch.Tensor  # [L - P - 1, K] their log-probabilities

    @property
    def answer_len(self) -> int:
        return int(self.ids.shape[0]) - self.prompt_len

    def path_logits(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n] sequence positions (>= P) -> [n, V] log-probs: the support, a floor elsewhere."""
        r = rows - self.prompt_len
        out = torch.full((r.shape[0], vocab_size), _FLOOR)
        out.scatter_(1, self.support_ids[r].long(), self.support_logp[r])
        return out


def record_requests(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    *,
    support_k: int = 256,
    batch_size: int = 8,
) -> list[RecordedRequest]:
    """The target's greedy answers to ``prompts`` with everything a replay needs, in order."""
    longest = max(len(p) for p in prompts)
    out: list[RecordedRequest | None] = [None] * len(prompts)
    for done in greedy_stream(
        target,
        prompts,
        max_new_tokens,
        eos_ids,
        batch_size=batch_size,
        cache_len=longest + max_new_tokens + 1,
        features=True,
        support_k=support_k,
    ):
        prompt = list(prompts[done.index])
        ids, logp = done.support
        out[done.index] = RecordedRequest(
            ids=torch.tensor([*prompt, *done.answer], dtype=torch.long),
            prompt_len=len(prompt),
            features=done.features.cpu(),
            support_ids=ids,
            support_logp=logp,
        )
    return [r for r in out if r is not None]


@torch.inference_mode()
def replay_request(dec: SpeculativeDecoder, req: RecordedRequest) -> RequestStats:
    """Greedy rounds of ``dec`` over one recorded answer (its vocabulary and adapter observe),
    folded as a live run's events: ``tokens`` = the answer (its first, the prefill's, included),
    ``rounds``, ``accepted`` (the last round's before clipping, as live) and depth counts."""
    stats = RequestStats()
    answer = req.ids[req.prompt_len :].tolist()  # [L - P]
    stats.add(StepEvent(tokens=answer[:1], prefill=True))
    if req.answer_len < 2:
        return stats
    device = dec.model.device
    vocab_size = dec.model.cfg.vocab_size
    seq = req.ids.to(device)
    feats = req.features.to(device, dec.model.norm.weight.dtype)  # [L - 1, D]
    n, p = seq.shape[0], req.prompt_len
    drafter, tree_cfg, vocab, adapt = dec.drafter, dec.tree, dec.vocab, dec.adapt
    drafter.start(seq[:p].tolist(), n + tree_cfg.draft_slots + 1)
    if vocab is not None:
        vocab.start(seq[:p], feats[:p])
    if adapt is not None:
        adapt.start()
    pending_feats, pending_tokens = feats[:p], seq[1 : p + 1]
    r = p  # the root's position: seq[r] is the last token produced so far
    while r < n - 1:
        if vocab is not None:
            vocab.begin_round()
        if adapt is not None:
            adapt.begin_round(pending_feats, pending_tokens)
        root_logp, root_ids = drafter.commit(pending_feats, pending_tokens, tree_cfg.top_k)
        tree = build_tree(drafter, int(seq[r]), root_logp, root_ids, r, tree_cfg)
        drafter.rewind()
        path = [0]  # greedy acceptance read off the recording
        while r + len(path) < n:
            hit = (tree.parents == path[-1]) & (tree.tokens == seq[r + len(path)])
            if not bool(hit.any()):
                break
            path.append(int(hit.nonzero()[0, 0]))
        a = len(path) - 1
        stats.add(StepEvent(tokens=answer[r + 1 - p : r + a + 2 - p], accepted=a))
        if r + a + 1 >= n:  # the answer ends inside this round: a live run clips it here
            break
        verified = seq[r + 1 : r + a + 2]  # [a + 1] accepted, then the bonus
        if vocab is not None or adapt is not None:
            path_t = torch.tensor(path, device=device)
            rows = torch.arange(r, r + a + 1)
            path_logits = req.path_logits(rows, vocab_size).to(device)  # [a + 1, V]
            if vocab is not None:
                hidden = torch.zeros(tree.size, feats.shape[1], dtype=feats.dtype, device=device)
                hidden[path_t] = feats[r : r + a + 1]  # only the path's features are known
                vocab.end_round(tree.tokens, path_t, verified.tolist(), path_logits, hidden)
            if adapt is not None:
                mask = vocab.mask if vocab is not None else None
                adapt.end_round(tree.parents, path_t, verified, path_logits, mask)
        pending_feats, pending_tokens = feats[r : r + a + 1], verified
        r += a + 1
    return stats
