"""What a loaded stack keeps resident: RSS, anonymous and file-backed, after ``assemble``.

Run once per configuration (a fresh process each: memory a process once touched stays counted):

    .venv/bin/python scripts/load_memory.py --model smollm2-135m-instruct --methods ar
    .venv/bin/python scripts/load_memory.py --model smollm2-135m-instruct --methods ar --before

``--before`` switches two of wave 47's changes off in this checkout: the float32 token embedding
is kept (``models/embedding.py``) and the checkpoint file's pages stay mapped after quantisation
(``models/file_pages.py``); an int8 weight's single copy (``quant.Int8Matmul``) stays. For the
loader as it was, run a worktree of an older commit with ``PYTHONPATH`` pointing at it.
docs/benchmarks.md, wave 47, quotes its output.
"""

from __future__ import annotations

import argparse
import resource

import torch


def status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, MB."""
    out = {}
    for line in open("/proc/self/status"):  # noqa: SIM115
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="ar", help="comma-separated methods to build")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--before", action="store_true", help="keep the float embedding and the file pages")
    args = ap.parse_args()
    import evospec.models.loading as loading

    if args.before:
        loading.compact_embedding = lambda model: 0
        loading.release_dropped = lambda model, before: 0
    from evospec.assembly import StackSettings, assemble

    torch.set_num_threads(2)
    methods = tuple(args.methods.split(","))
    stack = assemble(StackSettings(methods=methods, model=args.model, weights=args.weights), progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    mem = status()
    kind = type(stack.loaded.model.embed_tokens).__name__
    print(
        f"| {args.model} | {args.methods} | {'before' if args.before else 'after'} | {mem['VmRSS']} | "
        f"{mem['RssAnon']} | {mem['RssFile']} | {peak} | {kind} |"
    )


if __name__ == "__main__":
    main()
