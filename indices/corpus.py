"""Text corpora the offline indices are counted from.

Owns: reading the *training-side* sets of ``shared/data`` as whole documents (prompts together
with their answers or contexts where a set has them), each set's license and whether counts
derived from it may ship inside the package (``TRAINING_SOURCES``, ``REDISTRIBUTABLE``), and
reading user-supplied corpus files (.txt, .jsonl, .json, folders of them). A document is the
unit bigrams never cross. Evaluation sets (``EVAL_ONLY`` of ``evospec.train.prompts``) are refused, by folder.

Does not know about tokenizers or token ids: it yields ``str`` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evospec.train.prompts import EVAL_ONLY, read_jsonl

CORPUS_SUFFIXES = (".txt", ".jsonl", ".json")
_META_KEYS = ("_task", "_split", "_license", "label", "src", "uid", "id", "path", "template")


class EvalDataError(ValueError):
    """A corpus path lies inside an evaluation-only data set."""


def eval_only_match(path: Path) -> str | None:
    """The ``EVAL_ONLY`` entry ``path`` lies in (or contains as a folder), else None.

    ``gsm8k/test`` matches ``.../gsm8k/test.jsonl``: the last part is compared by stem.
    """
    parts = path.resolve().parts
    for entry in EVAL_ONLY:
        want = entry.split("/")
        for i in range(len(parts) - len(want) + 1):
            window = parts[i : i + len(want)]
            if window[:-1] == tuple(want[:-1]) and want[-1] in (window[-1], Path(window[-1]).stem):
                return entry
    return None


def _refuse_eval(path: Path) -> None:
    entry = eval_only_match(path)
    if entry is not None:
        raise EvalDataError(
            f"{path}: lies inside the evaluation-only set {entry!r}; evaluation sets "
            f"({', '.join(EVAL_ONLY)}) must not feed the indices. For the shared data folder use "
            "the training-side reader (evospec-index build --training-data DIR)."
        )


# -- training-side sets of shared/data ------------------------------------------------------------
def _lines(path: Path) -> Iterator[str]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            yield line


def _oasst(data: Path) -> Iterator[str]:
    for r in read_jsonl(data / "oasst/oasst_1k_prompts.jsonl"):
        yield r["prompt"]
    for r in read_jsonl(data / "oasst/prompt_lottery_en_250_text.jsonl"):
        yield r["prompt"]
    for tree in read_jsonl(data / "oasst/en_100_tree.jsonl"):  # every message of every tree
        stack = [tree["prompt"]]
        while stack:
            msg = stack.pop()
            if not msg.get("deleted") and isinstance(msg.get("text"), str):
                yield msg["text"]
            stack.extend(reversed(msg.get("replies") or []))


def _arena_hard(data: Path) -> Iterator[str]:
    for name in ("question_v0.1.jsonl", "question_v2.0.jsonl"):
        for r in read_jsonl(data / "arena_hard" / name):
            if isinstance(r.get("prompt"), str):
                yield r["prompt"]


def _self_instruct(data: Path) -> Iterator[str]:
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        for r in read_jsonl(data / "self_instruct" / name):
            for inst in r.get("instances") or [{}]:
                parts = [r["instruction"], inst.get("input", ""), inst.get("output", "")]
                yield "\n\n".join(p for p in parts if p)


def _t0_sample(data: Path) -> Iterator[str]:
    for r in read_jsonl(data / "t0_sample/t0_sample_20_per_template_nonews.jsonl"):
        completion = r.get("completion", "").replace("<|endoftext|>", "").strip()
        yield r["prompt"] + (f"\n{completion}" if completion else "")


def _gsm8k_train(data: Path) -> Iterator[str]:
    for r in read_jsonl(data / "gsm8k/train.jsonl"):
        yield f"{r['question']}\n\n{r['answer']}"


def _record_text(rec: dict[str, Any]) -> str:
    """All string fields of a record but its metadata, joined by blank lines."""
    return "\n\n".join(v for k, v in rec.items() if k not in _META_KEYS and isinstance(v, str) and v.strip())


def _legalbench(data: Path) -> Iterator[str]:
    for r in read_jsonl(data / "legalbench/legalbench_permissive.jsonl"):
        text = _record_text(r)
        if text:
            yield text


def _github_site_policy(data: Path) -> Iterator[str]:
    for r in read_jsonl(data / "github_site_policy/site_policy_docs.jsonl"):
        yield r["text"]


def _parallel(*names: str) -> Callable[[Path], Iterator[str]]:
    """Both sides of a German-English parallel set, one sentence per document."""

    def read(data: Path) -> Iterator[str]:
        for name in names:
            yield from _lines(data / name)

    return read


@dataclass(frozen=True)
class TrainingSource:
    """One training-side set of ``shared/data``: how to read it and under which terms."""

    read: Callable[[Path], Iterator[str]]
    folder: str  # its folder in shared/data (LICENSE or LICENSE_NOTE.txt, SOURCE_COMMIT)
    upstream: str  # who made it (the attribution its license asks for)
    license: str
    # Counts derived from it may ship inside the package: a permissive or attribution-only
    # license (CC0, MIT, Apache-2.0, CC BY); never share-alike, non-commercial or unclear terms.
    redistributable: bool
    why: str  # why it may or may not ship (recorded in the packaged manifest)


_PERMISSIVE = "permissive license; counts shipped with attribution"
TRAINING_SOURCES: dict[str, TrainingSource] = {
    "oasst": TrainingSource(
        _oasst, "oasst", "OpenAssistant (LAION-AI/Open-Assistant)", "Apache-2.0", True, _PERMISSIVE
    ),
    "arena_hard": TrainingSource(
        _arena_hard, "arena_hard", "lmarena/arena-hard-auto", "Apache-2.0", True, _PERMISSIVE
    ),
    "self_instruct": TrainingSource(
        _self_instruct, "self_instruct", "yizhongw/self-instruct", "Apache-2.0", True, _PERMISSIVE
    ),
    "t0_sample": TrainingSource(
        _t0_sample,
        "t0_sample",
        "T0 / P3 prompts (bigscience), sampled in yizhongw/self-instruct",
        "Apache-2.0 (repository), mixed upstream",
        False,
        "unclear: P3 prompts wrap many upstream data sets, some share-alike (e.g. CC BY-SA)",
    ),
    "gsm8k_train": TrainingSource(
        _gsm8k_train, "gsm8k", "openai/grade-school-math", "MIT", True, _PERMISSIVE
    ),
    "legalbench": TrainingSource(
        _legalbench,
        "legalbench",
        "HazyResearch/legalbench",
        "CC BY 4.0 / MIT (per task)",
        True,
        "attribution-only licenses",
    ),
    "github_site_policy": TrainingSource(
        _github_site_policy, "github_site_policy", "github/site-policy", "CC0-1.0", True, _PERMISSIVE
    ),
    "flores200_deen": TrainingSource(
        _parallel("flores200_deen/deu_Latn.devtest", "flores200_deen/eng_Latn.devtest"),
        "flores200_deen",
        "FLORES-200 (Meta AI), via Helsinki-NLP/OPUS-MT-testsets",
        "CC BY-SA 4.0",
        False,
        "share-alike",
    ),
    "tatoeba_deen": TrainingSource(
        _parallel("tatoeba_deen/tatoeba-test-v2021-08-07.deu", "tatoeba_deen/tatoeba-test-v2021-08-07.eng"),
        "tatoeba_deen",
        "Tatoeba (tatoeba.org) contributors, via Helsinki-NLP/OPUS-MT-testsets",
        "CC BY 2.0 FR",
        True,
        "attribution-only license",
    ),
    "ntrex128_deen": TrainingSource(
        _parallel("ntrex128_deen/newstest2019-ref.deu.txt", "ntrex128_deen/newstest2019-src.eng.txt"),
        "ntrex128_deen",
        "NTREX-128 (Microsoft), via Helsinki-NLP/OPUS-MT-testsets",
        "CC BY-SA 4.0",
        False,
        "share-alike",
    ),
}
REDISTRIBUTABLE = tuple(n for n, s in TRAINING_SOURCES.items() if s.redistributable)


def source_commit(data_dir: Path, name: str) -> str:
    """The upstream commit a training source was taken from ("" when not recorded)."""
    path = Path(data_dir) / TRAINING_SOURCES[name].folder / "SOURCE_COMMIT"
    return path.read_text().strip() if path.is_file() else ""


def check_sources(names: Iterable[str]) -> list[str]:
    """``names`` as a list, or ValueError naming the unknown ones."""
    names = list(names)
    unknown = sorted(set(names) - set(TRAINING_SOURCES))
    if unknown:
        raise ValueError(f"unknown training sources {unknown}; known: {list(TRAINING_SOURCES)}")
    return names


def training_texts(data_dir: Path, sources: Iterable[str] | None = None) -> Iterator[str]:
    """Every document of the training-side sets under ``data_dir``, source by source.

    ``sources`` picks a subset of ``TRAINING_SOURCES`` (default: all, in table order).
    """
    data_dir = Path(data_dir)
    _refuse_eval(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: shared data folder not found")
    for name in check_sources(TRAINING_SOURCES if sources is None else sources):
        for text in TRAINING_SOURCES[name].read(data_dir):
            if text.strip():
                yield text


# -- user corpus files ----------------------------------------------------------------------------
def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand ``paths`` (files, folders searched recursively) into corpus files, checked up front.

    Raises ``EvalDataError`` for anything inside an evaluation-only set, ``FileNotFoundError`` for
    a missing path and ``ValueError`` for a file of an unknown type named explicitly.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        _refuse_eval(p)
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and f.suffix in CORPUS_SUFFIXES:
                    _refuse_eval(f)
                    files.append(f)
        elif p.is_file():
            if p.suffix not in CORPUS_SUFFIXES:
                raise ValueError(f"{p}: unknown corpus file type (expected {', '.join(CORPUS_SUFFIXES)})")
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: corpus file or folder not found")
    return files


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _json_record_text(rec: Any) -> str:
    """A record's ``text`` field if it has one, else all its string values joined."""
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return rec["text"]
    return "\n\n".join(s for s in _strings(rec) if s.strip())


def _file_texts(path: Path, paragraphs: bool) -> Iterator[str]:
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        yield from (text.split("\n\n") if paragraphs else [text])
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{lineno}: invalid JSON line: {exc}") from exc
                    yield _json_record_text(rec)
    else:  # .json: a list of records or one record
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from exc
        for rec in doc if isinstance(doc, list) else [doc]:
            yield _json_record_text(rec)


def read_corpus_files(paths: Iterable[str | Path], *, paragraphs: bool = True) -> Iterator[str]:
    """Documents of corpus files: a .txt is split at blank lines (``paragraphs``) or read whole;
    each .jsonl line / .json list item is one record (its ``text`` field, or all its strings).

    All paths are expanded and checked before the first document is yielded.
    """
    for path in corpus_files(paths):
        for text in _file_texts(path, paragraphs):
            if text.strip():
                yield text
