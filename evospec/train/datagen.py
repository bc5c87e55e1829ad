"""Draft-training data: the target's own greedy answers and its features, cached on disk.

Owns one resumable stage under a work folder:
- ``features/shard_XXXXX.safetensors``: per sequence the token ids (prompt + answer), the
  target's final-layer (post-norm) features in fp16 (the last position, never fed to the
  model, is a zero row) and [prompt_len, total_len]; with ``support_k``, also the target's
  top-k next-token ids / log-probabilities per row (``support_ids`` int32, ``support_logp``
  float32, [rows, K], zero outside the fed answer positions); written before
- ``generations.jsonl``: one line per finished sequence {uid, source, prompt_ids,
  response_ids, shard}. A rerun skips uids already listed and stops once the response-token
  budget is reached; at most one unflushed shard is lost to an interruption.
Generation is continuously batched (``batch_generate.greedy_stream``), which also yields the
features, so no second forward pass is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evospec.models.transformer import Transformer
from evospec.train.batch_generate import greedy_stream
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

    def add(self, rec: dict, feats: torch.Tensor, support: tuple[torch.Tensor, torch.Tensor] | None) -> None:
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
        from safetensors.torch import save_file

        if not self.recs:
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
        save_file(tensors, str(tmp))
        tmp.rename(self.dir / name)
        with open(self.jsonl, "a") as f:
            for r in self.recs:
                f.write(json.dumps({**r, "shard": name}) + "\n")
        self.index += 1
        self.recs, self.tokens, self.feats, self.sup_ids, self.sup_logp = [], [], [], [], []
        self.count = 0


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
    progress: bool = True,
) -> int:
    """Generate until ``target_tokens`` response tokens exist in ``work``; returns that count.

    ``support_k`` > 0 also stores the target's top-k next-token support per answer row (what
    the ``topk+neg`` training loss reads), taken from the generation's own logits."""
    work.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(work, shard_tokens)
    seen, have = _done(writer.jsonl)
    todo = [p for p in prompts if p.uid not in seen]
    bar = tqdm(
        total=target_tokens,
        initial=min(have, target_tokens),
        unit="tok",
        desc="generating",
        disable=not progress,
    )
    try:
        for lo in range(0, len(todo), 256):
            if have >= target_tokens:
                break
            chunk = [(p, encode(p)) for p in todo[lo : lo + 256]]
            chunk = [(p, ids) for p, ids in chunk if len(ids) <= max_prompt_tokens]
            stream = greedy_stream(
                model,
                [ids for _, ids in chunk],
                max_new_tokens,
                eos_ids,
                batch_size=batch_size,
                cache_len=cache_len,
                features=True,
                support_k=support_k,
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


def feature_shards(work: Path) -> list[Path]:
    return sorted((work / "features").glob("shard_*.safetensors"))
