"""``evospec bench`` with every vocabulary method, end to end through the CLI on a tiny model
folder: the index comes from ``evospec-index build``, the draft head from ``save_eagle``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.cli import main
from evospec.models.eagle import new_eagle_for, save_eagle
from indices.cli import main as index_main
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for, write_model_folder

METHODS = "ar,eagle2,frspec,nanospec,evospec,nanospec+evospec"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench-vocab")
    codec = tiny_codec(CORPUS.split("\n\n") * 4)
    target = tiny_model_for(codec, 0)
    model = write_model_folder(root / "model", target, codec)
    draft = save_eagle(new_eagle_for(target, seed=0), root / "head")
    (root / "corpus.txt").write_text(CORPUS)
    idx = root / "idx"
    argv = ["build", "--model", str(model), "--corpus", str(root / "corpus.txt"), "--out", str(idx)]
    assert index_main([*argv, "--min-count", "1", "--threads", "1", "--no-progress"]) == 0
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "chat": False}) for p in CORPUS.split("\n\n")))
    return {"model": model, "draft": draft, "idx": idx, "data": data, "root": root}


def test_bench_quick_runs_every_method_side_by_side(setup, capsys: pytest.CaptureFixture[str]) -> None:
    out = setup["root"] / "out"
    argv = ["bench", "--quick", "--methods", METHODS, "--model", str(setup["model"])]
    argv += ["--draft", str(setup["draft"]), "--indices", str(setup["idx"]), "--data", str(setup["data"])]
    argv += ["--frspec-k", "64", "--w-max", "300", "--arc-capacity", "32"]
    argv += ["--top-k-tree", "3", "--depth", "3", "--total-tokens", "8", "--no-progress"]
    argv += ["--json", str(out / "b.json"), "--markdown", str(out / "b.md"), "--plots", str(out / "plots")]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    result = json.loads((out / "b.json").read_text())
    assert list(result["methods"]) == METHODS.split(",")
    assert result["config"]["prompts"] == 2 and result["config"]["max_new_tokens"] == 16  # --quick
    tree = {"top_k": 3, "depth": 3, "total_tokens": 8, "lookup": 0, "lookup_ngram": 2, "table_lookup": 0}
    tree |= {"table_min_share": 0.3, "jump_forward": 4, "min_prob": 0.0, "sample_drafts": True}
    assert result["config"]["tree"]["nanospec"] == tree
    assert result["config"]["vocab"]["w_max"] == 300
    assert result["config"]["verify_logits"] == "auto"
    assert result["config"]["draft"] == str(setup["draft"]) and result["config"]["draft3"] is None
    for name, stats in result["methods"].items():
        assert stats["matches_ar"] == 1.0, name  # lossless under every policy
        assert len(stats["acceptance_by_depth"]) == 3  # d = 1 .. --depth
        if name != "ar":
            assert 0 < stats["coverage"] <= 1 and stats["active_size"] > 0
    assert result["methods"]["ar"]["acceptance_by_depth"] == [0.0, 0.0, 0.0]
    assert all(
        len(s["acceptance_by_depth"]) == 3 for c in result["per_category"].values() for s in c.values()
    )
    assert result["methods"]["frspec"]["active_size"] <= 64 + 1  # + the always-active EOS
    assert (out / "b.md").read_text().strip() in stdout
    assert "| acceptance by depth | d=1 | d=2 | d=3 |" in stdout
    assert sorted(p.name for p in (out / "plots").iterdir()) == [
        "acceptance.png",
        "acceptance_by_depth.png",
        "draft_split.png",
        "speed.png",
    ]


def test_unknown_method_is_a_clear_error(setup, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "hi", "--method", "evospek", "--model", str(setup["model"]), "--no-progress"]
    assert main(argv) == 2
    assert "unknown method 'evospek'" in capsys.readouterr().err


def test_budget_smaller_than_the_arc_buffer_is_a_clear_error(
    setup, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "hi", "--method", "nanospec+evospec", "--model", str(setup["model"]), "--no-progress"]
    argv += ["--draft", str(setup["draft"]), "--indices", str(setup["idx"]), "--w-max", "100"]
    assert main([*argv, "--arc-capacity", "200"]) == 2
    err = capsys.readouterr().err  # refused by the settings, before anything loads
    assert "shares vocab.w_max (100) between the window and the ARC buffer" in err
    assert "must exceed vocab.arc_capacity (200)" in err


def test_tree_flag_refuses_unknown_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--tree", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def _shift_data(root: Path) -> Path:
    """A stand-in shared data folder with the three files the topic-shift stream reads."""
    data = root / "shared"
    paras = CORPUS.split("\n\n")
    for sub, name, rows in (
        (
            "humaneval",
            "prompts.jsonl",
            [{"prompt": f"def f{i}():\n    # {p}\n"} for i, p in enumerate(paras)],
        ),
        ("legalbench", "legalbench_permissive.jsonl", [{"text": (p + " ") * 2} for p in paras]),
        ("pubmedqa", "pqal.jsonl", [{"question": p[:40] + "?", "contexts": [p[:100]]} for p in paras]),
    ):
        (data / sub).mkdir(parents=True, exist_ok=True)
        (data / sub / name).write_text("\n".join(json.dumps(r) for r in rows))
    return data


def test_topic_shift_scenario_end_to_end(setup, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr("evospec.bench.topic_shift._MIN_LAW_CHARS", 80)  # the tiny model has 160 positions
    out = setup["root"] / "shift"
    argv = ["bench", "--scenario", "topic-shift", "--quick", "--model", str(setup["model"])]
    argv += ["--draft", str(setup["draft"]), "--indices", str(setup["idx"]), "--frspec-k", "64"]
    argv += ["--shared-data", str(_shift_data(setup["root"])), "--adapt-buffer", "4", "--adapt-lr", "1e-2"]
    argv += ["--adapt-rank", "4", "--top-k-tree", "3", "--depth", "3", "--total-tokens", "8", "--no-progress"]
    argv += ["--json", str(out / "s.json"), "--plots", str(out / "plots")]
    assert main(argv) == 0
    result = json.loads((out / "s.json").read_text())
    assert list(result["methods"]) == ["frspec", "clora", "osd", "evospec-full"]
    assert result["categories"] == ["code", "code", "law", "medicine"]  # --quick: 2 + 2 requests
    assert all(n == 0 for n in result["config"]["outputs_differing_from_first_method"].values())
    for name in ("clora", "osd", "evospec-full"):
        stats = result["methods"][name]
        assert len(stats["per_request_mal"]) == 4 and stats["aux_mib"] > 0
        assert stats["adapt"]["errors"] == 0
    assert result["methods"]["clora"]["aux_vs_osd"] < 0.75
    frozen = result["methods"]["frspec"]
    assert list(frozen["mal_by_category"]) == ["code", "law", "medicine"]
    code_mal = sum(frozen["per_request_mal"][:2]) / 2
    assert frozen["mal_by_category"]["code"] == pytest.approx(code_mal, abs=1e-3)
    printed = capsys.readouterr().out
    assert "clora aux memory / osd aux memory" in printed
    assert "| MAL by category | code | law | medicine |" in printed and "(1.000x)" in printed
    assert (out / "plots" / "topic_shift.png").is_file()


def test_topic_shift_replay_matches_the_live_stream(setup, monkeypatch) -> None:
    """--replay gives the live run's per-request MAL for a frozen method; --adapt-key category
    keeps one adapter per domain."""
    monkeypatch.setattr("evospec.bench.topic_shift._MIN_LAW_CHARS", 80)
    out = setup["root"] / "replay"
    argv = ["bench", "--scenario", "topic-shift", "--quick", "--model", str(setup["model"])]
    argv += ["--draft", str(setup["draft"]), "--indices", str(setup["idx"]), "--frspec-k", "64"]
    argv += ["--shared-data", str(_shift_data(setup["root"])), "--methods", "frspec,clora"]
    argv += ["--adapt-buffer", "4", "--adapt-lr", "1e-2", "--adapt-rank", "4", "--top-k-tree", "3"]
    argv += ["--depth", "3", "--total-tokens", "8", "--verify-logits", "all", "--no-progress"]
    assert main([*argv, "--json", str(out / "live.json")]) == 0
    assert main([*argv, "--replay", "--adapt-key", "category", "--json", str(out / "replay.json")]) == 0
    live = json.loads((out / "live.json").read_text())
    replay = json.loads((out / "replay.json").read_text())
    assert replay["config"]["replay"] and replay["config"]["adapt_key"] == "category"
    assert replay["methods"]["frspec"]["per_request_mal"] == live["methods"]["frspec"]["per_request_mal"]
    assert replay["methods"]["frspec"]["round_ms_p99"] is None  # no wall times in a replay
    keys = replay["methods"]["clora"]["adapt"]["keys"]
    assert set(keys) == {"code", "law", "medicine"}
    assert set(live["methods"]["clora"]["adapt"]["keys"]) == {"default"}
    # the frozen baseline drafts with the head's fp32 weights, as the adapting methods do: with
    # no update made (a buffer that never fills), clora's rounds are frspec's
    assert live["config"]["draft_weights"] == "fp32"
    at = argv.index("--adapt-buffer") + 1
    still = [*argv[:at], "100000", *argv[at + 1 :]]
    assert main([*still, "--replay", "--json", str(out / "still.json")]) == 0
    still = json.loads((out / "still.json").read_text())
    assert still["methods"]["clora"]["adapt"]["updates"] == 0
    assert still["methods"]["clora"]["per_request_mal"] == still["methods"]["frspec"]["per_request_mal"]


def test_bad_adaptation_settings_are_clear_errors(setup, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "hi", "--method", "clora", "--model", str(setup["model"]), "--no-progress"]
    argv += ["--draft", str(setup["draft"]), "--indices", str(setup["idx"])]
    assert main([*argv, "--adapt-lr", "-1"]) == 2
    assert "adapt.lr must be > 0" in capsys.readouterr().err
    assert main([*argv, "--adapt-temperature", "0"]) == 2
    assert "adapt.temperature must be > 0" in capsys.readouterr().err
    assert main([*argv, "--adapt-gate", "-1"]) == 2
    assert "gate_kl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--adapt-seed", "x"])
    assert "argument --adapt-seed: invalid int value: 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--scenario", "topic-shift", "--shift-requests", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--scenario", "topic-shift", "--replay", "--temperature", "0.7"]) == 2
    assert "error: --replay replays greedy answers" in capsys.readouterr().err
