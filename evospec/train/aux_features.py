"""EAGLE-3 inputs for cached training sequences: the target's hidden states at three layers.

Owns one resumable stage: for every ``features/shard_XXXXX.safetensors`` of a work folder
(``datagen.py``'s layout: tokens, lengths, final-layer features, top-k supports) it writes
``aux-<l0>-<l1>-<l2>/shard_XXXXX.safetensors`` holding ``aux`` [rows, 3 D] fp16, row for row
the concatenated outputs of target layers l0, l1, l2 (low, middle, high) at the same
positions, from one teacher-forced prefill per sequence. The sequences are the cached ones (the
target's own greedy answers, or dataset answers), so these are the features the target
produced while writing them. A finished shard is skipped on a rerun.

Cost here (SmolLM2-135M, fp32, 2 threads): ~400 tokens/s; 3.4 kB per token in fp16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from evospec.models.transformer import Transformer


def aux_dir(work: Path, layers: tuple[int, ...]) -> Path:
    """The folder of the aux shards for ``layers`` under a data stage's ``work`` folder."""
    return work / ("aux-" + "-".join(str(i) for i in layers))


@torch.inference_mode()
def write_aux_features(
    target: Transformer, work: Path, layers: tuple[int, ...], *, progress: bool = True
) -> list[Path]:
    """Write (or reuse) the aux shards of every feature shard under ``work``; returns their paths
    in the feature shards' order."""
    from safetensors.torch import load_file

    from evospec.common import save_tensors

    shards = sorted((work / "features").glob("shard_*.safetensors"))
    out_dir = aux_dir(work, layers)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [s for s in shards if not (out_dir / s.name).is_file()]
    total = sum(int(load_file(str(s))["lengths"][:, 1].sum()) for s in todo)
    device = target.device
    bar = tqdm(total=total, unit="tok", desc=f"aux features {work.name}", disable=not progress)
    for shard in todo:
        d = load_file(str(shard))
        tokens, rows = d["tokens"], []
        start = 0
        for _, length in d["lengths"].tolist():
            seq = tokens[start : start + length].to(device)[None]
            out = target(
                seq,
                torch.arange(length, device=device),
                target.new_cache(length),
                logits="none",
                aux_layers=layers,
            )
            rows.append(torch.cat(out.aux_hidden, dim=-1)[0].to("cpu", torch.float16))  # [T, 3 D]
            start += length
            bar.update(length)
        tmp = out_dir / f".{shard.name}.tmp"
        save_tensors({"aux": torch.cat(rows)}, str(tmp))
        tmp.rename(out_dir / shard.name)
    bar.close()
    return [out_dir / s.name for s in shards]
