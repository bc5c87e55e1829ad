"""Could a round skip its draft forward when the head is likely wrong, without running it?

A drafted round on a 2-core CPU pays ~1-2 ms of draft forward before it knows anything; a
stopping chain (``--min-prob``) turns doubtful rounds into plain steps but only after paying it.
This measures, over the target's own greedy answers to the benchmark prompts (as
``scripts/live_gap.py`` generates them), how well signals predict that the head's first token
is right (ROC AUC; accuracy of the kept and dropped rounds at three cut-offs):

- the target's probability of the root token (free: the last verify computed it);
- the head's own top-1 probability (what a stopping chain uses; costs the draft forward);
- the target's confidence at the next position (an oracle: not known before the verify).

    .venv/bin/python scripts/draft_gate.py --data ../shared/data/spec_bench/question.jsonl HEAD
"""

from __future__ import annotations

import argparse

import torch
from live_gap import target_answers
from scipy.stats import mannwhitneyu

from evospec.common import positive_int
from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.train.trainer import head_unroll

SIGNALS = ("target p(root)", "head p(top-1)", "target p(next), oracle")


@torch.inference_mode()
def signals(head, lm_head: torch.Tensor, answers) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 3] signal values and [N] hits, one row per answer position a round could root at."""
    cols, hits = [], []
    for a in answers:
        feats = a.features.float()  # [T-1, D]: row i predicts token i + 1
        target = torch.softmax(feats @ lm_head.T, -1).amax(-1)  # [T-1]
        out = head_unroll(head, feats[None, :-1], a.tokens[None, 1 : len(feats)], 1)[0][0]
        probs = torch.softmax(head.logit_input(out) @ lm_head.T, -1)  # row i predicts token i + 2
        conf, pred = probs.max(-1)
        for root in range(a.prompt_len, min(len(a.tokens) - 1, len(pred) + 1)):
            cols.append((float(target[root - 1]), float(conf[root - 1]), float(target[root])))
            hits.append(int(pred[root - 1]) == int(a.tokens[root + 1]))
    return torch.tensor(cols), torch.tensor(hits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head", help="an EAGLE-2 head folder")
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or a prompts JSONL)")
    ap.add_argument("--per-category", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4", help="the target's weight format")
    ap.set_defaults(categories=None, max_len=None)  # live_gap's target_answers: every prompt, whole
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(args.target, weights=args.weights, progress=False)
    answers = target_answers(args, loaded)
    head = load_eagle(args.head).attach(loaded.model)
    x, hit = signals(head, loaded.model.lm_head.weight.detach().float(), answers)
    print(f"{len(hit)} positions, head's first token right at {hit.float().mean():.3f}\n")
    print("| signal | AUC | kept / dropped accuracy, lowest 20% dropped | 40% | 60% |\n|---|---|---|---|---|")
    for j, name in enumerate(SIGNALS):
        v = x[:, j]
        auc = mannwhitneyu(v[hit].numpy(), v[~hit].numpy()).statistic / (hit.sum() * (~hit).sum())
        cells = []
        for q in (0.2, 0.4, 0.6):
            keep = v >= torch.quantile(v, q)
            cells.append(f"{hit[keep].float().mean():.3f} / {hit[~keep].float().mean():.3f}")
        print(f"| {name} | {float(auc):.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
