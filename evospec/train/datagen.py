"""Draft-training data: the target's own greedy answers, then its features, cached on disk.

Owns two resumable stages under one work folder:
1. ``generations.jsonl`` -- one line per prompt {uid, source, prompt_ids, response_ids},
   produced by continuously batched greedy generation (``batch_generate.greedy_stream``); a rerun skips
   uids already present and stops once the response-token budget is reached.
2. ``features/shard_XXXXX.safetensors`` -- per sequence the token ids and the target's
   final-layer (post-norm) features, teacher-forced in one forward each, stored in fp16.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evospec.models.transformer import Transformer
from evospec.tokenizer import TextCodec
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


def generate_responses(
    model: Transformer,
    codec: TextCodec,
    prompts: Sequence[TrainPrompt],
    out: Path,
    *,
    target_tokens: int,
    batch_size: int = 16,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 384,
    cache_len: int = 1536,
    progress: bool = True,
) -> int:
    """Append greedy answers to ``out`` until ``target_tokens`` response tokens exist."""
    out.parent.mkdir(parents=True, exist_ok=True)
    seen, have = _done(out)
    todo = [p for p in prompts if p.uid not in seen]
    bar = tqdm(
        total=target_tokens,
        initial=min(have, target_tokens),
        unit="tok",
        desc="generating",
        disable=not progress,
    )
    with open(out, "a") as f:
        for lo in range(0, len(todo), 512):
            if have >= target_tokens:
                break
            chunk = [
                (p, codec.encode_chat([{"role": "user", "content": p.text}])) for p in todo[lo : lo + 512]
            ]
            chunk = [(p, ids) for p, ids in chunk if len(ids) <= max_prompt_tokens]
            stream = greedy_stream(
                model,
                [ids for _, ids in chunk],
                max_new_tokens,
                codec.eos_ids,
                batch_size=batch_size,
                cache_len=cache_len,
            )
            for i, ans in stream:
                p, ids = chunk[i]
                f.write(
                    json.dumps({"uid": p.uid, "source": p.source, "prompt_ids": ids, "response_ids": ans})
                    + "\n"
                )
                f.flush()
                have += len(ans)
                bar.update(len(ans))
                if have >= target_tokens:
                    break
    bar.close()
    return have


@torch.inference_mode()
def extract_features(
    model: Transformer,
    generations: Path,
    out_dir: Path,
    *,
    shard_tokens: int = 200_000,
    progress: bool = True,
) -> list[Path]:
    """Teacher-forced target features for every generated sequence, in fp16 shards."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "manifest.json"
    with open(generations) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if manifest.is_file():
        meta = json.loads(manifest.read_text())
        if meta.get("sequences") == len(records):
            return [out_dir / s for s in meta["shards"]]
    shards: list[str] = []
    buf_tokens: list[torch.Tensor] = []
    buf_feats: list[torch.Tensor] = []
    buf_meta: list[list[int]] = []  # per sequence: [prompt_len, total_len]
    count = 0

    def flush() -> None:
        nonlocal buf_tokens, buf_feats, buf_meta, count
        if not buf_tokens:
            return
        name = f"shard_{len(shards):05d}.safetensors"
        save_file(
            {
                "tokens": torch.cat(buf_tokens),
                "features": torch.cat(buf_feats),
                "lengths": torch.tensor(buf_meta, dtype=torch.long),
            },
            str(out_dir / name),
        )
        shards.append(name)
        buf_tokens, buf_feats, buf_meta, count = [], [], [], 0

    for rec in tqdm(records, desc="features", unit="seq", disable=not progress):
        ids = rec["prompt_ids"] + rec["response_ids"]
        if len(rec["response_ids"]) < 2:
            continue
        t = torch.tensor([ids])
        cache = model.new_cache(len(ids))
        hid = model(t, torch.arange(len(ids)), cache, logits="none").hidden[0]  # [T, D]
        buf_tokens.append(t[0])
        buf_feats.append(hid.half())
        buf_meta.append([len(rec["prompt_ids"]), len(ids)])
        count += len(ids)
        if count >= shard_tokens:
            flush()
    flush()
    manifest.write_text(json.dumps({"sequences": len(records), "shards": shards}))
    return [out_dir / s for s in shards]
