"""Draft-training data: the target's own greedy answers and its features, cached on disk.

Owns one resumable stage under a work folder:
- ``features/shard_XXXXX.safetensors``: per sequence the token ids (prompt + answer), the
  target's final-layer (post-norm) features in fp16 (the last position, never fed to the
  model, is a zero row) and [prompt_len, total_len]; with ``support_k``, also the target's
  top-k next-token ids / log-probabilities per row (``support_ids`` int32, ``support_logp``
  float32, [rows, K], zero outside the fed answer positions); written before
- ``generations.jsonl``: one line per finished sequence {uid, source, prompt_ids,
  response_ids, shard} (shard null where only the token ids were kept, for on-the-fly
  training). A rerun skips uids already listed and stops once the response-token
  budget is reached; at most one unflushed shard is lost to an interruption.
Generation is continuously batched (``batch_generate.greedy_stream``), which also yields the
features, so no second forward pass is needed.

``teacher_force`` writes the same layout for the datasets' *own* answers (``conversations.py``)
under ``<work>/teacher``: one batched prefill pass of the target over prompt + answer yields the
features and the target's top-k at every answer row (there the answer token is the dataset's,
so the target's greedy choice is ``support_ids[:, 0]``, not the next token).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evospec.models.transformer import Transformer
from evospec.train.batch_generate import greedy_stream
from evospec.train.conversations import TrainConversation
from evospec.train.prompts import TrainPrompt


def _done(path: Path) -> tuple[set[str], int]:
    uids: set[str] = set()
    tokens = 0
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a torn last line from an interrupted run
                    continue
                uids.add(rec["uid"])
                tokens += len(rec["response_ids"])
    return uids, tokens


class _ShardWriter:
    def __init__(self, work: Path, shard_tokens: int) -> None:
        self.dir = work / "features"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = work / "generations.jsonl"
        self.shard_tokens = shard_tokens
        self.index = len(list(self.dir.glob("shard_*.safetensors")))
        self.recs: list[dict] = []
        self.tokens: list[torch.Tensor] = []
        self.feats: list[torch.Tensor] = []
        self.sup_ids: list[torch.Tensor] = []
        self.sup_logp: list[torch.Tensor] = []
        self.count = 0

    def add(
        self, rec: dict, feats: torch.Tensor | None, support: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        if feats is None:  # token ids only (on-the-fly training): the record is the data
            self.recs.append(rec)
            if len(self.recs) >= 64:
                self.flush()
            return
        ids = torch.tensor(rec["prompt_ids"] + rec["response_ids"])
        full = torch.zeros(len(ids), feats.shape[1], dtype=torch.float16)
        full[: feats.shape[0]] = feats.cpu()  # generation may run on a GPU; shards live on disk
        self.recs.append(rec)
        self.tokens.append(ids)
        self.feats.append(full)
        if support is not None:  # rows prompt_len .. prompt_len + len(answer) - 2 were fed
            lo, k = len(rec["prompt_ids"]), support[0].shape[1]
            sid, slp = torch.zeros(len(ids), k, dtype=torch.int32), torch.zeros(len(ids), k)
            sid[lo : lo + len(support[0])], slp[lo : lo + len(support[1])] = support
            self.sup_ids.append(sid)
            self.sup_logp.append(slp)
        self.count += len(ids)
        if self.count >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        from evospec.common import save_tensors

        if not self.recs:
            return
        if not self.tokens:  # token ids only: no shard
            self._append(None)
            return
        name = f"shard_{self.index:05d}.safetensors"
        lengths = [[len(r["prompt_ids"]), len(t)] for r, t in zip(self.recs, self.tokens, strict=True)]
        tmp = self.dir / f".{name}.tmp"
        tensors = {
            "tokens": torch.cat(self.tokens),
            "features": torch.cat(self.feats),
            "lengths": torch.tensor(lengths),
        }
        if self.sup_ids and len(self.sup_ids) == len(self.recs):  # one run writes all or none
            tensors |= {"support_ids": torch.cat(self.sup_ids), "support_logp": torch.cat(self.sup_logp)}
        save_tensors(tensors, str(tmp))
        tmp.rename(self.dir / name)
        self.index += 1
        self._append(name)

    def _append(self, shard: str | None) -> None:
        with open(self.jsonl, "a") as f:
            for r in self.recs:
                f.write(json.dumps({**r, "shard": shard}) + "\n")
        self.recs, self.tokens, self.feats, self.sup_ids, self.sup_logp = [], [], [], [], []
        self.count = 0


def _resume(work: Path, shard_tokens: int, items: Sequence, target_tokens: int, desc: str, progress: bool):
    """A resumable stage under ``work``: (shard writer, answer tokens already there, the items not
    done yet, a progress bar over ``target_tokens``)."""
    work.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(work, shard_tokens)
    seen, have = _done(writer.jsonl)
    todo = [x for x in items if x.uid not in seen]
    bar = tqdm(
        total=target_tokens, initial=min(have, target_tokens), unit="tok", desc=desc, disable=not progress
    )
    return writer, have, todo, bar


def generate_responses(
    model: Transformer,
    encode: Callable[[TrainPrompt], list[int]],
    eos_ids: Sequence[int],
    prompts: Sequence[TrainPrompt],
    work: Path,
    *,
    target_tokens: int,
    batch_size: int = 16,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 256,
    cache_len: int = 640,
    shard_tokens: int = 20_000,
    support_k: int = 0,
    store_features: bool = True,
    progress: bool = True,
) -> int:
    """Generate until ``target_tokens`` response tokens exist in ``work``; returns that count.

    ``support_k`` > 0 also stores the target's top-k next-token support per answer row (what
    the ``topk+neg`` training loss reads), taken from the generation's own logits.
    ``store_features`` False keeps the token ids only (``generations.jsonl``, no shards): what
    on-the-fly training (``onthefly.py``) reads."""
    writer, have, todo, bar = _resume(work, shard_tokens, prompts, target_tokens, "generating", progress)
    too_long = 0
    try:
        for lo in range(0, len(todo), 256):
            if have >= target_tokens:
                break
            chunk = [(p, encode(p)) for p in todo[lo : lo + 256]]
            fits = [(p, ids) for p, ids in chunk if len(ids) <= max_prompt_tokens]
            too_long += len(chunk) - len(fits)
            bar.set_postfix(too_long=too_long, refresh=False)  # prompts over max_prompt_tokens
            chunk = fits
            stream = greedy_stream(
                model,
                [ids for _, ids in chunk],
                max_new_tokens,
                eos_ids,
                batch_size=batch_size,
                cache_len=cache_len,
                features=store_features,
                support_k=support_k if store_features else 0,
            )
            for done in stream:
                p, ids = chunk[done.index]
                rec = {"uid": p.uid, "source": p.source, "prompt_ids": ids, "response_ids": done.answer}
                writer.add(rec, done.features, done.support)
                have += len(done.answer)
                bar.update(len(done.answer))
                if have >= target_tokens:
                    break
    finally:  # finished answers survive an interruption (Ctrl-C, SIGINT) or an error
        writer.flush()
        bar.close()
    return have


@torch.inference_mode()
def _teacher_rows(
    model: Transformer, seqs: list[tuple[list[int], int]], support_k: int
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    """One forward over ``seqs`` ([(ids, prompt_len)], all but each last token fed, rows
    right-aligned): per sequence its features [len - 1, D] fp16 and the target's top-k at the
    answer rows prompt_len .. len - 2 (ids int32, log-probs float32, [len - 1 - prompt_len, K])."""
    device = model.device
    width = max(len(ids) - 1 for ids, _ in seqs)
    pad = torch.tensor([width - (len(ids) - 1) for ids, _ in seqs], device=device)
    tokens = torch.tensor([[ids[0]] * (width - len(ids) + 1) + ids[:-1] for ids, _ in seqs], device=device)
    out = model(
        tokens,
        torch.arange(width, device=device),
        model.new_cache(width, batch=len(seqs)),
        logits="none",
        left_pad=pad,
    )
    rows = []
    for i, (ids, prompt_len) in enumerate(seqs):
        lo = width - (len(ids) - 1)
        hidden = out.hidden[i, lo:]  # [len - 1, D]
        logits = model.project_logits(hidden[prompt_len:]).float()  # answer rows only
        top, sid = logits.topk(support_k, dim=-1)
        logp = top - torch.logsumexp(logits, dim=-1, keepdim=True)
        rows.append((hidden.half(), (sid.to("cpu", torch.int32), logp.cpu())))
    return rows


def teacher_force(
    model: Transformer,
    encode: Callable[[TrainConversation], tuple[list[int], list[int]]],
    conversations: Sequence[TrainConversation],
    work: Path,
    *,
    target_tokens: int,
    support_k: int = 32,
    max_len: int = 576,
    batch_tokens: int = 2048,
    shard_tokens: int = 20_000,
    progress: bool = True,
) -> int:
    """Teacher-force the target on answered conversations until ``target_tokens`` answer tokens
    exist under ``work / "teacher"``; returns that count (resumable like ``generate_responses``).

    ``encode`` maps a conversation to (prompt ids, answer ids). Sequences longer than
    ``max_len`` keep the answer and the end of the prompt; answers longer than that are cut.
    Sequences are length-sorted within each chunk of 512 and run ~``batch_tokens`` per forward.
    """
    stage = _resume(work / "teacher", shard_tokens, conversations, target_tokens, "teacher-forcing", progress)
    writer, have, todo, bar = stage
    try:
        for lo in range(0, len(todo), 512):
            if have >= target_tokens:
                break
            chunk = []
            for conv in todo[lo : lo + 512]:
                prompt, answer = encode(conv)
                answer = answer[: max_len // 2] if len(prompt) + len(answer) > max_len else answer
                prompt = prompt[-(max_len - len(answer)) :]
                if len(answer) >= 2 and prompt:
                    chunk.append((conv, prompt, answer))
            chunk.sort(key=lambda c: len(c[1]) + len(c[2]))
            while chunk and have < target_tokens:
                width = len(chunk[0][1]) + len(chunk[0][2])
                n = max(1, min(len(chunk), batch_tokens // width))
                while n > 1 and (len(chunk[n - 1][1]) + len(chunk[n - 1][2])) * n > batch_tokens:
                    n -= 1
                batch, chunk = chunk[:n], chunk[n:]
                rows = _teacher_rows(model, [(p + a, len(p)) for _, p, a in batch], support_k)
                for (conv, prompt, answer), (feats, support) in zip(batch, rows, strict=True):
                    rec = {
                        "uid": conv.uid,
                        "source": conv.source,
                        "prompt_ids": prompt,
                        "response_ids": answer,
                        "teacher_forced": True,
                    }
                    writer.add(rec, feats, support)
                    have += len(answer)
                    bar.update(len(answer))
    finally:
        writer.flush()
        bar.close()
    return have


def feature_shards(work: Path, *, generated: bool = True, teacher: bool = True) -> list[Path]:
    """The cached shards: the target's own answers, then teacher-forced dataset answers."""
    out = sorted((work / "features").glob("shard_*.safetensors")) if generated else []
    return out + (sorted((work / "teacher" / "features").glob("shard_*.safetensors")) if teacher else [])


def generated_records(work: Path) -> list[dict]:
    """Every finished answer listed in ``work/generations.jsonl`` (torn lines skipped)."""
    path = work / "generations.jsonl"
    if not path.is_file():
        return []
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return recs
