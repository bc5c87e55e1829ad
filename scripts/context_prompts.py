"""Long-context training prompts shaped like served RAG and summarization traffic.

Spec-Bench's ``summarization`` and ``rag`` prompts are a 2-4k character document (or several
retrieved passages) followed by an instruction or a question; the draft-training mix had
nothing like them (prompts capped at 256 tokens). This builds such prompts from text on the
training side only -- the target's own cached answers in a ``train-draft`` work folder and
the training-side documents of the shared data folder -- so no evaluation set is read:

- ``ctx_summarize.jsonl``: ``Summarize: <document>``, the document a GitHub policy text or a
  long LegalBench text (clipped to ``--doc-chars``), or three cached answers of one source joined
  as one text;
- ``ctx_rag.jsonl``: three cached answers as passages (one answers the question, two are
  other answers of the same source, shuffled), then that answer's original question;
- ``ctx_news.jsonl``: news and encyclopedia text -- the English side of the NTREX-128
  (newstest2019) and FLORES-200 translation sets, split into articles at their headlines and
  into windows of consecutive sentences -- under varied summarize / key-points / question
  instructions, half of them as shuffled passages with one from another article mixed in
  (wave 22: Spec-Bench's summarization prompts are news, which no training prompt was).

Each file is a JSONL of ``{"prompt": ...}`` records, the form ``evospec train-draft --data``
reads (its source is the file name). Deterministic for a given ``--seed`` and work folder:

    .venv/bin/python scripts/context_prompts.py --work ~/.cache/evospec/train/v5-self \\
        --prompts ~/.cache/evospec/self_prompts.jsonl ../shared/data --out ~/.cache/evospec/context
    evospec train-draft ... --data ~/.cache/evospec/context/ctx_summarize.jsonl \\
        ~/.cache/evospec/context/ctx_rag.jsonl ~/.cache/evospec/context/ctx_news.jsonl \\
        --max-prompt-tokens 1024 ...
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

from evospec.train.prompts import interleave, read_jsonl, training_prompts


def _answers(
    work: Path, decode, prompts: dict[str, str], min_tokens: int
) -> dict[str, list[tuple[str, str]]]:
    """Per source, (question, answer text) of the cached answers at least ``min_tokens`` long
    whose question is known (its uid is in ``prompts``)."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for rec in read_jsonl(work / "generations.jsonl"):
        if len(rec["response_ids"]) < min_tokens or rec["uid"] not in prompts:
            continue
        text = decode(rec["response_ids"]).strip()
        if text:
            out[rec["source"]].append((prompts[rec["uid"]], text))
    return out


def _documents(data: Path, chars: int) -> list[str]:
    """Long training-side documents (GitHub policies, LegalBench texts), clipped at a word."""
    docs = [r["text"] for r in read_jsonl(data / "github_site_policy/site_policy_docs.jsonl")]
    docs += [
        r["text"]
        for r in read_jsonl(data / "legalbench/legalbench_permissive.jsonl")
        if len(r.get("text", "")) > 1500
    ]
    return [d if len(d) <= chars else d[:chars].rsplit(" ", 1)[0] for d in docs if len(d) > 800]


SUMMARIZE = (
    "Summarize: {doc}",
    "Summarize the following article in a few sentences.\n\n{doc}",
    "{doc}\n\nWhat are the main points of this text?",
    "Write a short summary of this news story:\n{doc}",
    "Read the text and give its key facts as a list.\n\n{doc}",
    "{doc}\n\nTL;DR:",
)
ASK = (
    "What happened, according to these passages?",
    "Who is involved, and what did they say or do?",
    "Explain in simple words: {title}",
    "Based on the passages, what is the background of this story: {title}?",
    "What is the most important information in the text above?",
)


def _sentence_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _is_headline(line: str) -> bool:
    return len(line) < 110 and not line.endswith((".", '"', "?", "!", "'", ")", "\u201d", ":"))


def articles(data: Path, chars: int) -> list[tuple[str, str]]:
    """(title, body) of news and encyclopedia texts on the training side: NTREX-128's English
    source (newstest2019) cut at its headlines, and FLORES-200's English devtest in windows of
    eight consecutive sentences (titled by their first words); bodies clipped at a word."""
    out: list[tuple[str, str]] = []
    title, body = "", []
    for line in [*_sentence_lines(data / "ntrex128_deen/newstest2019-src.eng.txt"), "END"]:
        if _is_headline(line):
            if title and len(body) >= 3:
                out.append((title, " ".join(body)))
            title, body = line, []
        else:
            body.append(line)
    flores = _sentence_lines(data / "flores200_deen/eng_Latn.devtest")
    for i in range(0, len(flores) - 7, 8):
        out.append((" ".join(flores[i].split()[:8]), " ".join(flores[i : i + 8])))
    return [(t, b if len(b) <= chars else b[:chars].rsplit(" ", 1)[0]) for t, b in out]


def news_prompts(arts: list[tuple[str, str]], seed: int) -> list[str]:
    """Per article: one summarize-style prompt, and one question after its paragraphs shuffled
    with a passage of another article (RAG-shaped); the instruction is drawn per prompt."""
    rng = random.Random(seed)
    out = []
    for i, (title, body) in enumerate(arts):
        out.append(rng.choice(SUMMARIZE).format(doc=body))
        words = body.split()
        third = -(-len(words) // 3)  # ceil: three passages hold every word
        passages = [" ".join(words[j : j + third]) for j in range(0, len(words), third)][:3]
        other = arts[(i + 1 + rng.randrange(len(arts) - 1)) % len(arts)][1].split()
        passages.append(" ".join(other[: len(other) // 2]))
        rng.shuffle(passages)
        out.append("\n".join(passages) + "\n" + rng.choice(ASK).format(title=title))
    return rng.sample(out, len(out))


def build(
    answers: dict[str, list[tuple[str, str]]], docs: list[str], count: int, seed: int
) -> tuple[list[str], list[str]]:
    """(summarize prompts, rag prompts), ``count`` of each at most; answers are grouped in
    threes within a source and the sources interleaved, so no one source dominates."""
    rng = random.Random(seed)
    rag: dict[str, list[str]] = defaultdict(list)
    joined: dict[str, list[str]] = defaultdict(list)
    for source, items in sorted(answers.items()):
        pool = rng.sample(items, len(items))
        for i in range(0, len(pool) - 2, 3):
            trio = pool[i : i + 3]
            passages = [a for _, a in trio]
            rag[source].append("\n".join(passages[j] for j in rng.sample(range(3), 3)) + "\n" + trio[0][0])
            joined[source].append("\n\n".join(passages))
    docs = rng.sample(docs, len(docs))
    summ = [f"Summarize: {d}" for d in docs[: count // 2]]
    summ += [f"Summarize: {d}" for d in interleave(joined, seed)[: count - len(summ)]]
    return interleave({"docs": summ}, seed), interleave(rag, seed)[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--work", type=Path, required=True, help="a train-draft work folder (its generations.jsonl)"
    )
    ap.add_argument(
        "--prompts",
        type=Path,
        nargs="+",
        required=True,
        help="the --data the work folder answered (for the questions)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for ctx_summarize.jsonl, ctx_rag.jsonl and ctx_news.jsonl",
    )
    ap.add_argument("--count", type=int, default=800, help="prompts per file at most (default 800)")
    ap.add_argument(
        "--min-answer-tokens", type=int, default=120, help="shortest cached answer used (default 120)"
    )
    ap.add_argument(
        "--doc-chars", type=int, default=3000, help="documents clipped to this length (default 3000)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from evospec.models.loading import load_model

    codec = load_model("smollm2-135m-instruct", weights="int4", progress=False).codec
    prompts = {p.uid: p.text for p in training_prompts(args.prompts)}
    data = next((p for p in args.prompts if p.is_dir()), None)
    docs = _documents(data, args.doc_chars) if data else []
    answers = _answers(args.work, codec.decode, prompts, args.min_answer_tokens)
    summ, rag = build(answers, docs, args.count, args.seed)
    news = news_prompts(articles(data, args.doc_chars), args.seed)[: args.count] if data else []
    args.out.mkdir(parents=True, exist_ok=True)
    for name, items in (("ctx_summarize", summ), ("ctx_rag", rag), ("ctx_news", news)):
        with (args.out / f"{name}.jsonl").open("w") as f:
            for text in items:
                f.write(json.dumps({"prompt": text}) + "\n")
        print(f"{len(items)} prompts -> {args.out / name}.jsonl")
    print({s: len(a) for s, a in answers.items()}, f"{len(docs)} documents")


if __name__ == "__main__":
    main()
