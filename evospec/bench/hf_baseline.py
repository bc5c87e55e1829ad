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
    tree = vocab = adapt = None  # plain decoding: no draft state (the Decoder protocol)

    def __init__(self, folder: str | Path, eos_ids: Sequence[int], *, progress: bool = True) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        shown = hf_logging.is_progress_bar_enabled()
        if not progress:  # transformers draws its own bar while it loads the weights
            hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        finally:
            if shown and not progress:
                hf_logging.enable_progress_bar()
        self.eos_ids = list(eos_ids)

    def close(self) -> None:
        pass

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        if not params.greedy:
            raise ValueError("the hf baseline is benchmarked greedily only")
        ids = torch.tensor([list(prompt)])
        clock = _TokenClock()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos_ids or None,
                pad_token_id=(self.eos_ids or [0])[0],
                streamer=clock,
            )
        end = time.perf_counter()
        new = out[0, len(prompt) :].tolist()
        reason = "stop" if new and new[-1] in self.eos_ids else "length"
        first = clock.first_token_s
        rest = (end - clock.start - first) / max(len(new) - 1, 1)
        # One event per token so MAL counts 1.0, like plain decoding; the first carries the
        # prefill time (prompt forward + first token), as our decoders' prefill event does.
        for i, tok in enumerate(new):
            last = i == len(new) - 1
            yield StepEvent(
                tokens=[tok],
                verify_s=first if i == 0 else rest,
                finish_reason=reason if last else None,
                prefill=i == 0,
            )


class _TokenClock:
    """A ``generate`` streamer that only notes when the prompt and the first new token arrive."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_s = 0.0
        self._calls = 0

    def put(self, value: torch.Tensor) -> None:
        self._calls += 1
        if self._calls == 1:  # the prompt, pushed before the prefill forward
            self.start = time.perf_counter()
        elif self._calls == 2:
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass
