"""The transformers ``generate`` baseline, timed exactly like our decoders.

Owns: loading the reference model from the same (converted) folder and wrapping its greedy
``generate`` as a one-shot event stream. Used only by benchmarks and reference tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from evospec.decoding.events import StepEvent
from evospec.decoding.sampling import SamplingParams


class HFGenerateDecoder:
    """``model.generate`` of transformers on the same weights (greedy only)."""

    name = "hf"

    def __init__(self, folder: str | Path, eos_ids: Sequence[int]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.eos_ids = list(eos_ids)

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        if not params.greedy:
            raise ValueError("the hf baseline is benchmarked greedily only")
        ids = torch.tensor([list(prompt)])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos_ids or None,
                pad_token_id=(self.eos_ids or [0])[0],
            )
        dt = time.perf_counter() - t0
        new = out[0, len(prompt) :].tolist()
        reason = "stop" if new and new[-1] in self.eos_ids else "length"
        # One event per token so MAL counts 1.0, like plain decoding.
        for i, tok in enumerate(new):
            last = i == len(new) - 1
            yield StepEvent(
                tokens=[tok], verify_s=dt / len(new), finish_reason=reason if last else None, prefill=i == 0
            )
