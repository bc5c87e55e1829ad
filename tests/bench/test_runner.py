"""Side-by-side benchmark runner and the results JSON contract, on a tiny random model."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from evospec.bench.prompts import BenchPrompt
from evospec.bench.runner import RunRecord, bench_stats, format_table, run_side_by_side, summarise
from evospec.decoding.events import StepEvent
from evospec.decoding.methods import ARDecoder
from evospec.decoding.sampling import SamplingParams
from tests.conftest import TinyPair, random_tokens

PROMPTS = [
    BenchPrompt("writing", "a", True),
    BenchPrompt("math", "b", True),
    BenchPrompt("writing", "c", False),
]


def _encode(p: BenchPrompt) -> list[int]:
    return random_tokens(4 + len(p.text), seed=ord(p.text))[0].tolist()


def _ar_record(method: str, i: int, tokens: list[int], prefill_s: float = 0.0) -> RunRecord:
    """A plain-decoding run of 1.0 s, all of it target forwards, folded from its events: the first
    token from the prefill (``prefill_s``), then one decode step per token."""
    step_s = (1.0 - prefill_s) / max(len(tokens) - 1, 1)
    rec = RunRecord(method, "c", i, list(tokens), seconds=1.0, stats=bench_stats())
    for k, tok in enumerate(tokens):
        rec.stats.add(StepEvent([tok], verify_s=prefill_s if k == 0 else step_s, prefill=k == 0))
    return rec


@pytest.fixture(scope="module")
def result(tiny_llama: TinyPair) -> tuple[list[RunRecord], dict]:
    model = tiny_llama.ours
    decoders = {"ar": ARDecoder(model), "ar_again": ARDecoder(model)}
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    records = run_side_by_side(decoders, PROMPTS, _encode, params, progress=False)
    return records, summarise(records, {"model": "tiny", "max_new_tokens": 6})


def test_records(result: tuple[list[RunRecord], dict]) -> None:
    records, _ = result
    assert [(r.method, r.prompt_index, r.category) for r in records] == [
        ("ar", 0, "writing"),
        ("ar_again", 0, "writing"),
        ("ar", 1, "math"),
        ("ar_again", 1, "math"),
        ("ar", 2, "writing"),
        ("ar_again", 2, "writing"),
    ]
    for r in records:
        st = r.stats
        assert len(r.tokens) == st.tokens == 6 and st.rounds == 5 and st.accepted == 0  # prefill: no round
        assert r.seconds > 0 and 0 < st.verify_s <= r.seconds
        assert 0 < st.prefill_s < st.verify_s  # the prefill event's time, one of six steps
        assert st.depth_counts == [] and st.mal == 1.0


def test_summary_json_shape(result: tuple[list[RunRecord], dict]) -> None:
    _, summary = result
    json.dumps(summary)  # serialisable
    assert set(summary) == {"methods", "per_category", "config"}
    assert summary["config"] == {"model": "tiny", "max_new_tokens": 6}
    assert set(summary["methods"]) == {"ar", "ar_again"}
    assert set(summary["per_category"]) == {"math", "writing"}
    keys = {
        "mal",
        "acceptance_by_depth",
        "tok_per_s",
        "speedup_vs_ar",
        "median_prompt_speedup_vs_ar",
        "matches_ar",
        "tokens",
        "seconds",
        "rounds",
        "draft_s",
        "verify_s",
        "decode_tok_per_s",
        "decode_speedup_vs_ar",
        "prefill_s_median",
        "prompts",
    }
    assert (
        summary["methods"]["ar"]["prompts"] == 3 and summary["per_category"]["writing"]["ar"]["prompts"] == 2
    )
    for scope in [summary["methods"], *summary["per_category"].values()]:
        for stats in scope.values():
            assert keys <= set(stats)
            assert stats["mal"] == 1.0
            assert stats["acceptance_by_depth"] == []  # nothing drafted, no tree configured
            assert stats["matches_ar"] == 1.0
            assert stats["tok_per_s"] > 0 and math.isfinite(stats["speedup_vs_ar"])
        assert scope["ar"]["speedup_vs_ar"] == 1.0
    assert summary["methods"]["ar"]["tokens"] == 18
    assert summary["per_category"]["writing"]["ar"]["tokens"] == 12


def test_matches_ar_detects_a_difference() -> None:
    records = [
        _ar_record("ar", 0, [1, 2, 3]),
        _ar_record("other", 0, [1, 2, 3]),
        _ar_record("ar", 1, [4, 5]),
        _ar_record("other", 1, [4, 6]),
    ]
    stats = summarise(records, {})["methods"]["other"]
    assert stats["matches_ar"] == 0.5
    assert stats["speedup_vs_ar"] == 1.0


def test_decode_rate_leaves_the_prefill_out() -> None:
    """3 tokens in 1.0 s of which 0.6 s prefill: 3 tok/s overall, 2 tokens / 0.4 s decoding."""
    rec = _ar_record("ar", 0, [1, 2, 3], prefill_s=0.6)
    assert (rec.stats.rounds, rec.stats.prefill_s, rec.stats.verify_s) == (2, 0.6, pytest.approx(1.0))
    stats = summarise([rec], {})["methods"]["ar"]
    assert stats["tok_per_s"] == pytest.approx(3.0)
    assert stats["decode_tok_per_s"] == pytest.approx(5.0)
    assert stats["prefill_s_median"] == pytest.approx(0.6) and stats["decode_speedup_vs_ar"] == 1.0


def test_no_ar_means_no_speedup_baseline() -> None:
    records = [_ar_record("x", 0, [1, 2])]
    stats = summarise(records, {})["methods"]["x"]
    assert math.isnan(stats["speedup_vs_ar"]) and "matches_ar" not in stats


def test_format_table(result: tuple[list[RunRecord], dict]) -> None:
    _, summary = result
    lines = format_table(summary).splitlines()
    assert lines[0].startswith("| method | mal | tok_per_s | speedup_vs_ar")
    assert lines[2].startswith("| ar | 1.000 |") and lines[3].startswith("| ar_again | 1.000 |")
    # two categories: MAL and speedup per category follow the speed table
    assert lines[4] == ""
    assert lines[5] == "| category | prompts | ar tok/s | ar_again MAL | ar_again vs AR |"
    math_row = [c.strip() for c in lines[7].strip("|").split("|")]
    assert math_row[:2] == ["math", "1"] and math_row[3] == "1.00"  # ar_again: plain decoding, MAL 1
    assert float(math_row[2]) == pytest.approx(summary["per_category"]["math"]["ar"]["tok_per_s"], abs=0.01)
    assert lines[8].startswith("| writing | 2 | ")
    assert len(lines) == 9


@pytest.mark.parametrize("max_new", [13, 12])
def test_speculative_method_side_by_side(max_new: int) -> None:
    """eagle2-style decoding in the same harness: MAL counts accepted + 1 per round, before
    clipping (with 12 new tokens the third round's 4 tokens are cut to 3: MAL stays 4)."""
    from evospec.decoding.drafter import TargetDrafter
    from evospec.decoding.methods import SpeculativeDecoder
    from evospec.decoding.tree import TreeConfig
    from tests.decoding.spec_helpers import prompt_of, tiny_target

    target = tiny_target(0)
    tree = TreeConfig(top_k=1, depth=3, total_tokens=3)
    decoders = {
        "ar": ARDecoder(target),
        "spec": SpeculativeDecoder("spec", target, TargetDrafter(target), tree),
    }
    prompts = [BenchPrompt("x", str(i), False) for i in range(3)]
    params = SamplingParams(max_new_tokens=max_new)
    records = run_side_by_side(decoders, prompts, lambda p: prompt_of(int(p.text), 5), params, progress=False)
    summary = summarise(records, {})
    spec = summary["methods"]["spec"]
    assert spec["matches_ar"] == 1.0
    assert spec["tokens"] == 3 * max_new and spec["rounds"] == 9
    assert spec["mal"] == pytest.approx(4.0)  # 3 rounds per prompt, each of depth 3 + 1
    assert spec["acceptance_by_depth"] == [1.0, 1.0, 1.0]  # every round accepted the whole tree
    assert summary["methods"]["ar"]["mal"] == pytest.approx(1.0)
    assert summary["methods"]["ar"]["acceptance_by_depth"] == [0.0, 0.0, 0.0]
    assert summary["per_category"]["x"]["spec"]["acceptance_by_depth"] == [1.0, 1.0, 1.0]
    assert all(
        r.stats.accepted == 9 and r.stats.depth_counts == [3, 3, 3] for r in records if r.method == "spec"
    )
    # the depth table lists the method that drafted, not plain decoding
    tables = format_table(summary).split("\n\n")
    assert tables[1].splitlines() == [
        "| acceptance by depth | d=1 | d=2 | d=3 |",
        "|---|---|---|---|",
        "| spec | 1.000 | 1.000 | 1.000 |",
    ]


def test_vocabulary_methods_report_coverage_split_and_oracle() -> None:
    from evospec.decoding.methods import make_decoder
    from evospec.decoding.tree import TreeConfig
    from evospec.models.eagle import new_eagle_for
    from evospec.vocab.factory import VocabConfig
    from tests.decoding.spec_helpers import prompt_of, tiny_target

    target = tiny_target(0)
    head = new_eagle_for(target, seed=0)
    tree = TreeConfig(top_k=3, depth=3, total_tokens=8)
    decoders = {
        "ar": ARDecoder(target),
        "eagle2": make_decoder("eagle2", target, draft=head, tree=tree),
        "nanospec": make_decoder("nanospec", target, draft=head, tree=tree, vocab=VocabConfig(w_max=16)),
    }
    prompts = [BenchPrompt("x", str(i), False) for i in range(2)]
    params = SamplingParams(max_new_tokens=12)
    records = run_side_by_side(decoders, prompts, lambda p: prompt_of(int(p.text), 6), params, progress=False)
    config = {"tree": {"eagle2": asdict(tree), "nanospec": asdict(tree)}}
    methods = summarise(records, config)["methods"]
    assert "coverage" not in methods["ar"]
    assert methods["eagle2"]["coverage"] == 1.0 and methods["eagle2"]["active_size"] == 64
    nano = methods["nanospec"]
    assert 0 < nano["coverage"] <= 1 and nano["active_size"] <= 16
    assert nano["lm_head_ms_per_round"] > 0 and nano["backbone_ms_per_round"] > 0
    round_ms = nano["draft_ms_per_round"] + nano["verify_ms_per_round"]
    assert nano["oracle_tok_per_s"] == pytest.approx(1e3 * methods["eagle2"]["mal"] / round_ms)
    assert nano["matches_ar"] == 1.0
    for name in ("eagle2", "nanospec"):  # d = 1 .. the tree's depth, never rising with d
        shares = methods[name]["acceptance_by_depth"]
        assert len(shares) == tree.depth and shares == sorted(shares, reverse=True)
        assert sum(shares) == pytest.approx(methods[name]["mal"] - 1)
    table = format_table({"methods": methods})
    assert "| nanospec |" in table.split("\n\n")[1] and "| ar |" not in table.split("\n\n")[1]
    depth = table.split("\n\n")[2].splitlines()
    assert depth[0] == "| acceptance by depth | d=1 | d=2 | d=3 |"
    assert [row.split(" | ")[0] for row in depth[2:]] == ["| eagle2", "| nanospec"]


def test_methods_are_normalised_to_frspec_when_it_ran() -> None:
    """EvoSpec's Table 8: MAL and speed of every method relative to FR-Spec at the same settings."""
    records = [_ar_record("frspec", 0, [1, 2, 3, 4]), _ar_record("other", 0, [1, 2])]
    methods = summarise(records, {})["methods"]
    assert methods["frspec"]["speedup_vs_frspec"] == 1.0 and methods["frspec"]["mal_vs_frspec"] == 1.0
    assert methods["other"]["speedup_vs_frspec"] == pytest.approx(0.5)
    assert "speedup_vs_frspec" not in summarise([records[1]], {})["methods"]["other"]
