"""``scripts/context_prompts.py``: news and encyclopedia articles from the translation sets'
English side, and the summarize / RAG-shaped prompts built over them (wave 22)."""

from __future__ import annotations

from pathlib import Path

from tests.script_modules import load_script


def _script():
    return load_script("context_prompts")


def _data(tmp_path: Path) -> Path:
    (tmp_path / "ntrex128_deen").mkdir()
    (tmp_path / "flores200_deen").mkdir()
    news = [
        "Storm hits the coast",
        "Winds reached 120 km/h on Monday.",
        "Thousands lost power.",
        "Officials said repairs would take days.",
        "Short piece",  # a headline whose body is too short: dropped
        "One line only.",
        "Council approves new bridge",
        "The vote was 7 to 2.",
        "Work starts in spring.",
        "It will cost $4 million.",
    ]
    (tmp_path / "ntrex128_deen/newstest2019-src.eng.txt").write_text("\n".join(news) + "\n")
    flores = [f"Sentence number {i} of the encyclopedia text." for i in range(17)]
    (tmp_path / "flores200_deen/eng_Latn.devtest").write_text("\n".join(flores) + "\n")
    return tmp_path


def test_articles_split_at_headlines_and_window_flores(tmp_path: Path) -> None:
    arts = _script().articles(_data(tmp_path), chars=10_000)
    titles = [t for t, _ in arts]
    assert titles[:2] == ["Storm hits the coast", "Council approves new bridge"]
    assert arts[0][1] == (
        "Winds reached 120 km/h on Monday. Thousands lost power. Officials said repairs would take days."
    )
    # 17 FLORES sentences: two whole windows of eight, the rest left out
    assert len(arts) == 4
    assert arts[2][1].startswith("Sentence number 0 ")
    assert arts[2][1].endswith("number 7 of the encyclopedia text.")
    assert arts[3][1].startswith("Sentence number 8 ")


def test_bodies_are_clipped_at_a_word(tmp_path: Path) -> None:
    arts = _script().articles(_data(tmp_path), chars=30)
    assert all(len(body) <= 30 and not body.endswith(" ") for _, body in arts)
    assert arts[0][1] == "Winds reached 120 km/h on"


def test_news_prompts_summarize_each_article_and_mix_one_foreign_passage_into_its_rag(
    tmp_path: Path,
) -> None:
    module = _script()
    arts = module.articles(_data(tmp_path), chars=10_000)
    prompts = module.news_prompts(arts, seed=0)
    assert prompts == module.news_prompts(arts, seed=0)  # deterministic per seed
    openings = [" ".join(body.split()[:4]) for _, body in arts]
    whole = [sum(body in p for _, body in arts) for p in prompts]
    summaries = [p for p, n in zip(prompts, whole, strict=True) if n == 1]
    rag = [p for p, n in zip(prompts, whole, strict=True) if n == 0]
    assert len(summaries) == len(rag) == len(arts)  # one of each per article
    for p in rag:  # its own article's passages and the start of exactly one other article
        assert sum(o in p for o in openings) == 2
        question = p.rsplit("\n", 1)[1]
        assert any(question.startswith(q.split("{")[0]) for q in module.ASK)
