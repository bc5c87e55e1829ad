"""Weight formats side by side on one model: load time, peak RSS, plain-decoding speed, parity.

Each format runs in its own subprocess (so peak RSS is that format's), formats alternate over
``--repeat`` rounds so machine drift spreads over all of them, and the table reports medians:

    .venv/bin/python scripts/bench_weights.py [--formats fp32,bf16,int8,int4] [--max-new-tokens 64]

A format ``F-eager`` (e.g. ``int4-eager``) is F with every step run eagerly (no recorded
one-token graph, ``evospec/models/step.py``): the A/B of that graph. ``F-aten`` is F without
the fused CPU ops (``evospec/models/fused.py``): the A/B of those.

Per format: load seconds (``load_model``, converted cache warm), peak RSS after load and after
decoding, bytes of the linear weights, AR tok/s (median over prompts and rounds), speedup over
fp32, and parity with fp32: greedy tokens identical before the first divergence (mean over
prompts), teacher-forced top-1 agreement and max |logit difference| on the fp32 greedy outputs.
Prompts: ``evospec.decoding.tune.CALIBRATION_TEXTS`` (shipped; no shared data needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _worker(fmt: str, model: str, max_new: int, prompts: int, ref_path: str | None) -> dict:
    import resource
    import time

    import torch

    from evospec.decoding.autoregressive import generate_ar
    from evospec.decoding.sampling import SamplingParams
    from evospec.decoding.tune import CALIBRATION_TEXTS
    from evospec.models.loading import load_model

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    weights, _, mode = fmt.partition("-")  # "int4-eager": no recorded step graph; "-aten": no fused ops
    t0 = time.perf_counter()
    loaded = load_model(
        model, progress=False, weights=weights, step_graph=mode != "eager", fused_ops=mode != "aten"
    )
    load_s = time.perf_counter() - t0
    rss_load = rss_mb()
    codec, m = loaded.codec, loaded.model
    params = SamplingParams(max_new_tokens=max_new)
    outs, rates = [], []
    for text in CALIBRATION_TEXTS[:prompts]:
        ids = codec.encode_chat([{"role": "user", "content": text}])
        list(generate_ar(m, ids, SamplingParams(max_new_tokens=4), eos_ids=codec.eos_ids))  # warm
        t = time.perf_counter()
        toks = [x for ev in generate_ar(m, ids, params, eos_ids=codec.eos_ids) for x in ev.tokens]
        rates.append(len(toks) / (time.perf_counter() - t))
        outs.append([ids, toks])
    result = {
        "format": fmt,
        "load_s": load_s,
        "rss_load_mb": rss_load,
        "rss_peak_mb": rss_mb(),
        "weight_mb": (loaded.quant.nbytes if loaded.quant else _fp32_bytes(m)) / 1e6,
        "tok_per_s": rates,
        "outputs": outs,
    }
    if ref_path:  # parity with the fp32 run's greedy outputs, teacher-forced
        ref = json.loads(Path(ref_path).read_text())["outputs"]
        ref_logits = torch.load(Path(ref_path).with_suffix(".pt"))  # [per prompt: [T, V]]
        agree, total, worst = 0, 0, 0.0
        for (ids, _), (_, ref_toks), want in zip(outs, ref, ref_logits, strict=True):
            seq = torch.tensor([ids + ref_toks])
            logits = _forced(m, seq, len(ids))
            agree += int((logits.argmax(-1) == torch.tensor(ref_toks)).sum())
            total += len(ref_toks)
            worst = max(worst, float((logits - want).abs().max()))
        result["parity"] = {"top1_agreement": agree / total, "max_abs_logit_diff": worst}
        result["first_divergence"] = [
            next((i for i, (a, b) in enumerate(zip(t, r, strict=False)) if a != b), min(len(t), len(r)))
            for (_, t), (_, r) in zip(outs, ref, strict=True)
        ]
    return result


def _save_reference_logits(model: str, outs: list, path: Path) -> None:
    """fp32 teacher-forced logits of the fp32 greedy outputs, for the other formats' parity."""
    import torch

    from evospec.models.loading import load_model

    m = load_model(model, progress=False, weights="fp32").model
    logits = []
    for ids, toks in outs:
        seq = torch.tensor([ids + toks])
        logits.append(_forced(m, seq, len(ids)))
    torch.save(logits, path)


def _forced(m, seq, prompt_len: int):
    """Teacher-forced logits [T, V] predicting the T answer tokens of ``seq`` [1, prompt + T]."""
    import torch

    return m(seq, torch.arange(seq.shape[1]), m.new_cache(seq.shape[1])).logits[0, prompt_len - 1 : -1]


def _fp32_bytes(model) -> int:
    from torch import nn

    from evospec.models.packing import PackedLinear

    linears = [mod for mod in model.modules() if isinstance(mod, (nn.Linear, PackedLinear))]
    return sum(mod.weight.numel() * 4 for mod in linears)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp32,bf16,int8,int4")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the per-format results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        res = _worker(a.worker, a.model, a.max_new_tokens, a.prompts, a.ref)
        Path(a.out).write_text(json.dumps(res))
        if a.worker == "fp32" and not a.ref and not Path(a.out).with_suffix(".pt").exists():
            _save_reference_logits(a.model, res["outputs"], Path(a.out).with_suffix(".pt"))
        return
    formats = a.formats.split(",")
    if "fp32" not in formats:
        formats.insert(0, "fp32")  # the parity reference
    work = Path(a.json.parent if a.json else ".") / ".bench_weights"
    work.mkdir(exist_ok=True)
    runs: dict[str, list[dict]] = {f: [] for f in formats}
    for r in range(a.repeat):
        for fmt in formats:
            out = work / f"{fmt}-{r}.json"
            ref = work / "fp32-0.json" if fmt != "fp32" else None
            cmd = [sys.executable, __file__, "--worker", fmt, "--model", a.model, "--out", str(out)]
            cmd += ["--max-new-tokens", str(a.max_new_tokens), "--prompts", str(a.prompts)]
            if ref:
                cmd += ["--ref", str(ref)]
            subprocess.run(cmd, check=True)
            runs[fmt].append(json.loads(out.read_text()))
            print(f"round {r + 1}/{a.repeat}: {fmt} done", file=sys.stderr, flush=True)
    base = statistics.median(x for run in runs["fp32"] for x in run["tok_per_s"])
    print(
        "| weights | load s | RSS after load MB | peak RSS MB | linear weights MB | AR tok/s | vs fp32 | "
        "greedy tokens equal to fp32 before divergence | top-1 agreement (teacher-forced) | "
        "max abs logit diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for fmt, rs in runs.items():
        rate = statistics.median(x for run in rs for x in run["tok_per_s"])
        row = {
            "load_s": statistics.median(r["load_s"] for r in rs),
            "rss_load_mb": statistics.median(r["rss_load_mb"] for r in rs),
            "rss_peak_mb": statistics.median(r["rss_peak_mb"] for r in rs),
            "weight_mb": rs[0]["weight_mb"],
            "tok_per_s": rate,
            "speedup": rate / base,
        }
        if fmt != "fp32":
            row |= rs[0]["parity"] | {"first_divergence": rs[0]["first_divergence"]}
        summary[fmt] = row
        div = statistics.mean(row["first_divergence"]) if fmt != "fp32" else a.max_new_tokens
        par = f"{row['top1_agreement']:.3f} | {row['max_abs_logit_diff']:.3f}" if fmt != "fp32" else "1 | 0"
        print(
            f"| {fmt} | {row['load_s']:.1f} | {row['rss_load_mb']:.0f} | {row['rss_peak_mb']:.0f} | "
            f"{row['weight_mb']:.0f} | {rate:.1f} | {rate / base:.2f}x | "
            f"{div:.1f} of {a.max_new_tokens} | {par} |"
        )
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
