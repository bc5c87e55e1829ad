"""PNG plots of a benchmark result (matplotlib, headless).

Owns: the figures from the results JSON of ``runner.summarise``: ``speed.png`` (tok/s and
speedup vs AR per method), ``acceptance.png`` (MAL and coverage per method),
``draft_split.png`` (per-round draft backbone / LM head / gather and verify time, stacked) and
``acceptance_by_depth.png`` (per drafting method, the share of rounds that accepted at least
d draft tokens, d = 1..depth). Reads the summary only; knows nothing about models.
"""

from __future__ import annotations

from pathlib import Path

from evospec.bench.runner import drafted


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional dependency (the dev extra)
        raise ValueError("--plots needs matplotlib: pip install matplotlib") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = result["methods"]
    names = list(methods)
    cfg = result.get("config", {})
    title = f"{cfg.get('model', '')}  ({cfg.get('prompts', '?')} prompts)"
    paths = []

    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 3.5))
    bars = ax.bar(names, [methods[n]["tok_per_s"] for n in names], color="#4C72B0")
    for bar, n in zip(bars, names, strict=True):
        ax.annotate(
            f"{methods[n]['speedup_vs_ar']:.2f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens / s (label: speedup vs AR)")
    ax.set_title(title, fontsize=9)
    paths.append(_save(fig, out_dir / "speed.png"))

    spec = [n for n in names if "coverage" in methods[n]]
    if spec:
        fig, ax = plt.subplots(figsize=(1.4 * len(spec) + 2, 3.5))
        ax.bar(spec, [methods[n]["mal"] for n in spec], color="#55A868")
        ax.set_ylabel("MAL (tokens per round)")
        ax2 = ax.twinx()
        ax2.plot(spec, [methods[n]["coverage"] for n in spec], "o-", color="#C44E52")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("coverage", color="#C44E52")
        ax.set_title(title, fontsize=9)
        paths.append(_save(fig, out_dir / "acceptance.png"))

        fig, ax = plt.subplots(figsize=(1.4 * len(spec) + 2, 3.5))
        bottom = [0.0] * len(spec)
        for key, label in (
            ("backbone_ms_per_round", "draft backbone + tree"),
            ("lm_head_ms_per_round", "draft LM head"),
            ("gather_ms_per_round", "gather"),
            ("verify_ms_per_round", "verify"),
        ):
            vals = [methods[n][key] for n in spec]
            ax.bar(spec, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("ms per round")
        ax.legend(fontsize=8)
        ax.set_title(title, fontsize=9)
        paths.append(_save(fig, out_dir / "draft_split.png"))

    deep = [n for n in names if drafted(methods[n]) and methods[n].get("acceptance_by_depth")]
    if deep:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for n in deep:
            shares = methods[n]["acceptance_by_depth"]
            ax.plot(range(1, len(shares) + 1), shares, "o-", label=n)
        ax.set_xlabel("depth d (draft tokens accepted)")
        ax.set_ylabel("share of rounds accepting >= d")
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=8)
        ax.set_title(title, fontsize=9)
        paths.append(_save(fig, out_dir / "acceptance_by_depth.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
