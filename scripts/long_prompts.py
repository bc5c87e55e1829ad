"""Long-context prompts for side-by-side runs: "summarise this document" over the first N tokens
of the GitHub site-policy documents (CC0, ``../shared/data/github_site_policy``).

Writes JSONL with a ``prompt`` field, the format ``scripts/serve_vs_llamacpp.py --prompts``
reads. Used for docs/benchmarks.md, wave 14:

    .venv/bin/python scripts/long_prompts.py --tokens 1500 --count 4 --out /tmp/long_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from evospec.models.loading import load_model
from evospec.models.registry import DEFAULT_MODEL

INSTRUCTION = "Summarize the main points of this document:\n\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/github_site_policy/site_policy_docs.jsonl"))
    ap.add_argument("--tokens", type=int, default=1500, help="document tokens per prompt (default 1500)")
    ap.add_argument("--count", type=int, default=4, help="prompts to write (default 4)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    codec = load_model(DEFAULT_MODEL, progress=False).codec
    prompts = []
    for line in args.data.read_text().splitlines():
        ids = codec.encode(json.loads(line)["text"])
        if len(ids) >= args.tokens:
            prompts.append({"prompt": INSTRUCTION + codec.decode(ids[: args.tokens])})
        if len(prompts) == args.count:
            break
    if len(prompts) < args.count:
        raise SystemExit(f"only {len(prompts)} documents have {args.tokens} tokens")
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts of {args.tokens} document tokens to {args.out}")


if __name__ == "__main__":
    main()
