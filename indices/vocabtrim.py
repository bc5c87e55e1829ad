"""VocabTrim's table: how often the target itself writes each token (Goel et al., 2025).

Owns: counting the target's own greedy answers to training-side prompts into ``vocabtrim.npy``
([V] int64, next to ``frequency.npy``) and adding it to an index directory's manifest
(:func:`add_vocabtrim`, the ``evospec-index vocabtrim`` command). The answers come as JSONL
lines with ``response_ids`` -- the ``generations.jsonl`` that ``evospec train-draft`` writes
while it generates the draft head's training data -- so the table is counted from text the
served model produced, not from a corpus; the ``vocabtrim`` policy then keeps the top ids of
this table at FR-Spec's size rule (``vocab/policy.py: frspec_size``).

FR-Spec counts a corpus; VocabTrim counts what the model it drafts for actually says. For a
chat model the two differ in exactly the tokens speculation must predict (its own phrasing,
formatting, refusals). Evaluation sets never enter: the prompts are train-draft's.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import torch

from indices.frequency import save_counts
from indices.manifest import VOCABTRIM_FILE, Manifest, add_index_file, read_manifest


def count_generations(
    paths: Sequence[Path], vocab_size: int, sources: Collection[str] | None = None
) -> tuple[np.ndarray, dict]:
    """Counts [V] of the ``response_ids`` of every JSONL line in ``paths``, and what they came from.

    ``sources``: count only records whose ``source`` is one of these (the shipped table keeps
    to the sets whose licenses allow redistribution); the others are listed as left out. A torn
    last line (an interrupted generation) is skipped; any other bad line, or an id outside the
    vocabulary, is a ``ValueError`` naming the file and line.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    sequences = 0
    used: dict[str, int] = {}
    left_out: dict[str, int] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such generations file")
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = np.asarray(rec["response_ids"], dtype=np.int64)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                if i == len(lines):
                    continue  # the torn last line of an interrupted run
                raise ValueError(f"{path}:{i}: not a generations record with response_ids ({exc})") from exc
            source = str(rec.get("source", ""))
            if sources is not None and source not in sources:
                left_out[source] = left_out.get(source, 0) + int(ids.size)
                continue
            used[source] = used.get(source, 0) + int(ids.size)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"{path}:{i}: token id outside the vocabulary [0, {vocab_size})")
            np.add.at(counts, ids, 1)
            sequences += 1
    if sequences == 0:
        raise ValueError(f"no generations in {', '.join(map(str, paths))}")
    info = {
        "origin": ", ".join(str(Path(p).name) for p in paths),
        "sequences": sequences,
        "tokens": int(counts.sum()),
        "distinct_ids": int((counts > 0).sum()),
    }
    if sources is not None:
        info |= {
            "source_tokens": dict(sorted(used.items())),
            "left_out_tokens": dict(sorted(left_out.items())),
        }
    return counts, info


def add_vocabtrim(
    directory: Path, lm_head_weight: torch.Tensor, counts: np.ndarray, info: dict, *, command: str = ""
) -> Manifest:
    """Write ``counts`` as the vocabtrim table of an index directory built for this model (the
    file is in place before the manifest naming it is written)."""
    vocab = read_manifest(Path(directory)).vocab_size
    if counts.shape != (vocab,):
        raise ValueError(f"vocabtrim counts have shape {counts.shape}, the model's vocabulary is {vocab}")
    t0 = time.perf_counter()
    record = {**info, "command": command or shlex.join(["evospec-index", *sys.argv[1:]])}
    return add_index_file(
        directory,
        lm_head_weight,
        VOCABTRIM_FILE,
        lambda tmp: save_counts(tmp, counts),
        record,
        seconds=time.perf_counter() - t0,
    )
