"""GPU timings of the draft path with random weights: per-step latency and method throughput.

Owns nothing the engine uses: it builds random-weight models shaped like Llama-3.1-8B
(hidden 4096, vocab 128,256, one-layer EAGLE head) and like the default model (SmolLM2-135M),
and times them through the project's own code (``evospec.models``, ``evospec.vocab``,
``evospec.decoding.methods``). Random weights make acceptance meaningless: the throughput
section is timing only.

Sections (each guarded: a failing one is recorded and the next runs; results are rewritten to
``OUT/results.json`` after every section, so a run cut short still reports what finished):

- ``latency``: draft backbone (one EAGLE layer over a 1k-token prefix, one frontier of
  ``top_k`` nodes), LM head full / 32k / 3k (projection + log-softmax + top-k, eager and
  CUDA-graph replay), the row gather of a staged set (full reload and a typical change), how
  much of the gather hides behind the backbone on the copy stream, and whether the draft step
  (backbone + reduced head, after staging) runs without a host synchronisation.
- ``throughput``: ar / eagle2 / frspec / nanospec / evospec tokens per second on the default
  model with its shipped head (when its converted weights are on the machine), then on the
  random SmolLM2-shaped and 8B-shaped models.

``--dry-run`` shrinks every shape so the script runs on a CPU in seconds (a smoke test of the
script itself; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evospec.decoding.methods import make_decoder  # noqa: E402
from evospec.decoding.sampling import SamplingParams  # noqa: E402
from evospec.decoding.tree import TreeConfig  # noqa: E402
from evospec.kernels.graphs import BucketGraphs  # noqa: E402
from evospec.kernels.streams import copy_stream  # noqa: E402
from evospec.models.config import ModelConfig  # noqa: E402
from evospec.models.eagle import EagleHead, new_eagle_for  # noqa: E402
from evospec.models.transformer import Transformer  # noqa: E402
from evospec.vocab.factory import VocabConfig  # noqa: E402
from evospec.vocab.head import FullHead, ReducedHead  # noqa: E402

LLAMA_8B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
SMOLLM2_135M = ModelConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
METHODS = ("ar", "eagle2", "frspec", "nanospec", "evospec")


def dry(cfg: ModelConfig, vocab: int, hidden: int) -> ModelConfig:
    """A tiny stand-in of ``cfg`` for the CPU dry run."""
    return replace(
        cfg, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
    )  # fmt: skip


# -- models -----------------------------------------------------------------------------------------
def random_target(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0) -> Transformer:
    """A target with random weights initialised on ``device`` (no host copy of 16 GB)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.normal_(0.0, std, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights (llama: scale by w)
    model.reset_rope(device)
    return model.eval()


def random_draft(target: Transformer, dtype: torch.dtype, device: str) -> EagleHead:
    head = new_eagle_for(target, seed=1).to(device=device, dtype=dtype).eval()
    return head.attach(target)


def stand_in_indices(vocab: int, seed: int = 0) -> SimpleNamespace:
    """Zipf-like counts (FR-Spec, EvoSpec core), no HNSW index, a fixed successor graph."""
    rng = np.random.default_rng(seed)
    counts = (1e7 / (1 + rng.permutation(vocab))).astype(np.int64)

    class Successors:
        def successors(self, u: int, k: int) -> list[int]:
            return [(7 * u + j) % vocab for j in range(1, k + 1)]

    return SimpleNamespace(counts=counts, hnsw=None, graph=Successors())


# -- timing -----------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn``; CUDA events around each call on the current stream."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def random_mask(vocab: int, n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.randperm(vocab, generator=gen)[:n]] = True
    return mask.to(device)


def changed_mask(mask: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``mask`` with ``n`` active ids swapped for ``n`` inactive ones (same size)."""
    out = mask.clone().cpu()
    on, off = torch.nonzero(out).flatten(), torch.nonzero(~out).flatten()
    out[on[torch.randperm(on.numel(), generator=gen)[:n]]] = False
    out[off[torch.randperm(off.numel(), generator=gen)[:n]]] = True
    return out.to(mask.device)


def latency(cfg: ModelConfig, dtype: torch.dtype, device: str, reps: int, prefix: int, k: int) -> dict:
    target = random_target(cfg, dtype, device)
    head = random_draft(target, dtype, device)
    weight = target.lm_head.weight  # [V, D]
    vocab, dim = weight.shape
    gen = torch.Generator().manual_seed(0)
    out: dict = {"shape": {"vocab": vocab, "hidden": dim, "prefix": prefix, "frontier": k}}

    # draft backbone: one frontier of k nodes over a committed prefix (the tree slots are trimmed)
    cache = head.new_cache(prefix + 4 * k)
    feats = torch.randn(1, prefix, dim, device=device, dtype=dtype)
    toks = torch.randint(0, vocab, (1, prefix), device=device)
    head(feats, toks, torch.arange(prefix, device=device), cache, None)
    f_k = torch.randn(1, k, dim, device=device, dtype=dtype)
    t_k = torch.randint(0, vocab, (1, k), device=device)
    pos = torch.full((k,), prefix, device=device)
    mask = torch.ones(k, prefix + k, dtype=torch.bool, device=device)

    def backbone() -> torch.Tensor:
        h = head(f_k, t_k, pos, cache, mask)[0]  # [k, D]
        cache.trim(prefix)
        return h

    hidden = backbone()
    out["backbone_ms"] = time_ms(backbone, reps)

    # LM heads: full, 32k, 3k (eager) and the 3k head replayed from a CUDA graph
    full = FullHead(weight)
    heads: dict[str, FullHead | ReducedHead] = {"full": full}
    for name, size in (("32k", min(32768, vocab)), ("3k", min(3072, vocab))):
        rh = ReducedHead(weight, size)
        rh.set_active(random_mask(vocab, size, gen, device))
        heads[name] = rh
    for name, h in heads.items():
        out[f"lm_head_{name}_ms"] = time_ms(lambda h=h: h(hidden, k), reps)
    out["lm_head_speedup_3k"] = out["lm_head_full_ms"] / max(out["lm_head_3k_ms"], 1e-9)
    out["lm_head_speedup_32k"] = out["lm_head_full_ms"] / max(out["lm_head_32k_ms"], 1e-9)
    rh3 = heads["3k"]
    assert isinstance(rh3, ReducedHead)
    graphs = BucketGraphs(lambda x: rh3(x, k), [1, 8, 16, 64], clone_outputs=False)
    out["lm_head_3k_graph_ms"] = time_ms(lambda: graphs(hidden), reps)
    out["lm_head_3k_graph_used"] = bool(graphs.graphs)
    out["lm_head_3k_graph_failed"] = graphs.failed

    # gather: a full reload of 3k rows and a typical per-round change, on the copy stream
    stream = copy_stream(device)
    stage_mask = random_mask(vocab, rh3.capacity, gen, device)
    for rows in (rh3.capacity, 128):
        masks = [stage_mask]
        for _ in range(reps + 3):
            masks.append(
                changed_mask(masks[-1], rows, gen)
                if rows < rh3.capacity
                else random_mask(vocab, rh3.capacity, gen, device)
            )
        it = iter(masks[1:])
        rh3.set_active(masks[0])

        def gather(it=it) -> None:
            rh3.stage(next(it))
            rh3._wait_staged()

        out[f"gather_{rows}_rows_ms"] = time_ms(gather, reps)  # plan + gather, stream-ordered
        stage_mask = masks[-1]

    # overlap: stage the next set (copy stream), run the backbone, then the reduced head
    def round_step(next_mask: torch.Tensor) -> None:
        rh3.stage(next_mask)
        h = backbone()
        rh3(h, k)

    masks = [random_mask(vocab, rh3.capacity, gen, device) for _ in range(reps + 3)]
    it = iter(masks)
    out["overlapped_full_reload_ms"] = time_ms(lambda: round_step(next(it)), reps)
    serial = out["backbone_ms"] + out["lm_head_3k_ms"] + out[f"gather_{rh3.capacity}_rows_ms"]
    out["serial_full_reload_ms"] = serial
    g = out[f"gather_{rh3.capacity}_rows_ms"]
    out["gather_hidden_fraction"] = max(0.0, min(1.0, (serial - out["overlapped_full_reload_ms"]) / g))
    out["copy_stream"] = stream is not None

    # no host sync inside the draft step once the set is staged
    if torch.cuda.is_available():
        rh3.stage(random_mask(vocab, rh3.capacity, gen, device))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rh3(backbone(), k)
            out["draft_step_sync_free"] = True
        except RuntimeError as exc:
            out["draft_step_sync_free"] = False
            out["draft_step_sync"] = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out["goal_lm_head_3k_8x"] = out["lm_head_speedup_3k"] >= 8.0
    out["goal_gather_hidden"] = out["gather_hidden_fraction"] >= 0.95
    return out


# -- throughput -------------------------------------------------------------------------------------
def default_model(dtype: torch.dtype, device: str) -> tuple[Transformer, EagleHead]:
    """The registered default model and its shipped head (raises when the weights are not here:
    the GPU machine has no network and usually no converted copy)."""
    from evospec.models.eagle import load_eagle
    from evospec.models.loading import load_model
    from evospec.models.registry import DEFAULT_MODEL, default_head

    target = load_model(DEFAULT_MODEL, dtype=dtype, device=device, progress=False).model
    folder = default_head(DEFAULT_MODEL)
    if folder is None:
        raise FileNotFoundError(f"no shipped head for {DEFAULT_MODEL}")
    return target, load_eagle(folder, dtype=dtype, device=device).attach(target)


def throughput(
    models: Callable[[], tuple[Transformer, EagleHead]],
    prompts: int,
    prompt_len: int,
    new: int,
    deadline: float,
    out: dict,
    on_row: Callable[[], None],
) -> None:
    """Fill ``out`` with one row per method (calling ``on_row`` after each); past ``deadline``
    a method stops after its current prompt and later methods are skipped."""
    target, draft = models()
    cfg = target.cfg
    indices = stand_in_indices(cfg.vocab_size)
    vcfg = VocabConfig(w_max=min(3072, cfg.vocab_size // 2), frspec_k=min(32768, cfg.vocab_size // 4))
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(max_new_tokens=new)
    ar_tokens: list[list[int]] | None = None
    for method in METHODS:
        if time.monotonic() > deadline:
            out[method] = {"skipped": "time budget"}
            continue
        try:
            dec = make_decoder(method, target, draft=draft, tree=TreeConfig(), vocab=vcfg, indices=indices)
            list(dec.generate(batch[0][:16], SamplingParams(max_new_tokens=8)))  # warm-up
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            toks, rounds, accepted = [], 0, 0
            for p in batch:
                if toks and time.monotonic() > deadline:
                    break
                evs = list(dec.generate(p, params))
                toks.append([t for ev in evs for t in ev.tokens])
                rounds += sum(1 for ev in evs if not ev.prefill)
                accepted += sum(ev.accepted for ev in evs)
            wall = time.perf_counter() - t0
            n = sum(len(t) for t in toks)
            row = {"tokens": n, "prompts": len(toks), "wall_s": wall, "tok_per_s": n / wall}
            if method == "ar":
                ar_tokens = toks
            else:
                row["mal"] = (accepted + rounds) / max(rounds, 1)
                row["ms_per_round"] = 1e3 * wall / max(rounds, 1)
                same = ar_tokens is not None and len(ar_tokens) >= len(toks)
                row["matches_ar"] = toks == ar_tokens[: len(toks)] if same else None
            if getattr(dec, "vocab", None) is not None:
                row["overlap"] = dec.vocab.overlap
                dec.vocab.close()
            out[method] = row
        except Exception as exc:
            out[method] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
        base = out.get("ar", {}).get("tok_per_s")
        if base and "tok_per_s" in out[method]:
            out[method]["speedup_vs_ar"] = out[method]["tok_per_s"] / base
        on_row()


# -- report -----------------------------------------------------------------------------------------
def summary_md(res: dict) -> str:
    lines = [f"# GPU check ({res['device']}, {res['dtype']}{', DRY RUN' if res['dry_run'] else ''})", ""]
    lat = res.get("latency", {})
    if "error" in lat:
        lines += ["## Latency: FAILED", "", "```", lat["error"], "```", ""]
    elif lat:
        lines += ["## Per-step latency at " + json.dumps(lat["shape"]), "", "| what | ms |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" for k, v in lat.items() if k.endswith("_ms")]
        lines += [
            "",
            f"- LM head full / 3k: {lat['lm_head_speedup_3k']:.2f}x"
            f" (goal >= 8x: {lat['goal_lm_head_3k_8x']}); full / 32k: {lat['lm_head_speedup_32k']:.2f}x",
            f"- gather hidden behind the backbone: {100 * lat['gather_hidden_fraction']:.0f}%"
            f" (goal: all; {lat['goal_gather_hidden']})",
            f"- draft step free of host syncs: {lat.get('draft_step_sync_free')}"
            f" {lat.get('draft_step_sync', '')}",
            f"- 3k head from a CUDA graph: {lat.get('lm_head_3k_graph_used')}"
            f" {lat.get('lm_head_3k_graph_failed')}",
            "",
        ]
    for name, table in res.get("throughput", {}).items():
        lines += [f"## Throughput: {name} (random weights: timing only)", ""]
        if "error" in table:
            lines += ["```", table["error"], "```", ""]
            continue
        lines += [
            "| method | tok/s | x AR | MAL | ms/round | = AR | overlap |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m, r in table.items():
            if "tok_per_s" not in r:
                lines.append(f"| {m} | {r.get('skipped') or r.get('error', '')[:80]} | | | | | |")
                continue
            mal = f"{r['mal']:.2f}" if "mal" in r else "-"
            per_round = f"{r['ms_per_round']:.2f}" if "ms_per_round" in r else "-"
            lines.append(
                f"| {m} | {r['tok_per_s']:.1f} | {r.get('speedup_vs_ar', 0):.2f} | {mal} | {per_round} | "
                f"{r.get('matches_ar', '-')} | {r.get('overlap', '-')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (smoke test)")
    ap.add_argument("--sections", default="latency,throughput")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new work after this")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    big = dry(LLAMA_8B, 4096, 128) if args.dry_run else LLAMA_8B
    small = dry(SMOLLM2_135M, 2048, 64) if args.dry_run else SMOLLM2_135M
    res: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "throughput": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["elapsed_s"] = time.monotonic() - start
        (args.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / "summary.md").write_text(summary_md(res))

    sections = set(args.sections.split(","))
    if "latency" in sections:
        t0 = time.monotonic()
        try:
            reps = 3 if args.dry_run else args.reps
            res["latency"] = latency(big, dtype, device, reps, prefix=64 if args.dry_run else 1024, k=10)
        except Exception as exc:
            res["latency"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(f"[gpu_bench] latency done in {time.monotonic() - t0:.1f}s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()
    if "throughput" in sections:

        def randomly(cfg: ModelConfig) -> Callable[[], tuple[Transformer, EagleHead]]:
            def build() -> tuple[Transformer, EagleHead]:
                target = random_target(cfg, dtype, device)
                return target, random_draft(target, dtype, device)

            return build

        plan = [
            ("default-model", lambda: default_model(dtype, device), 0.35),
            ("smollm2-135m-shaped", randomly(small), 0.6),
            ("llama-3.1-8b-shaped", randomly(big), 1.0),  # gets what is left
        ]
        if args.dry_run:
            plan = plan[1:]
        for name, models, share_of_budget in plan:
            t0 = time.monotonic()
            share = start + args.budget_s * share_of_budget
            table: dict = {}
            res["throughput"][name] = table
            try:
                n_prompts, new = (2, 12) if args.dry_run else (4, 128)
                prompt_len = 32 if args.dry_run else 256
                throughput(models, n_prompts, prompt_len, new, min(share, deadline), table, save)
            except Exception as exc:  # building or loading the model failed
                table["error"] = f"{type(exc).__name__}: {exc}"
                table["trace"] = traceback.format_exc()
            print(f"[gpu_bench] throughput {name} done in {time.monotonic() - t0:.1f}s", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save()
    save()
    print(summary_md(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
