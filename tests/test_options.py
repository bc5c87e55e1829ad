"""Shared command-line knobs: generate, bench and serve turn the same flags into equal settings."""

from __future__ import annotations

import pytest

from evospec.cli import build_parser
from evospec.decoding.methods import METHODS
from evospec.decoding.tree_config import TreeConfig
from evospec.options import METHOD_HELP, stack_settings

FLAGS = [
    "--top-k-tree", "3", "--depth", "4", "--total-tokens", "9", "--frspec-k", "512", "--w-max", "900",
    "--arc-capacity", "64", "--adapt-lr", "0.001", "--adapt-rank", "8", "--adapt-seed", "7",
    "--verify-logits", "all", "--device", "cpu", "--dtype", "float32", "--no-pack",
]  # fmt: skip


def test_generate_and_bench_build_equal_settings() -> None:
    parser = build_parser()
    gen = parser.parse_args(["generate", "hi", "--method", "frspec", *FLAGS])
    bench = parser.parse_args(["bench", "--methods", "frspec", *FLAGS])
    a, b = stack_settings(gen, ["frspec"]), stack_settings(bench, ["frspec"])
    assert a == b
    assert (a.tree.top_k, a.tree.depth, a.tree.total_tokens) == (3, 4, 9)
    assert (a.vocab.frspec_k, a.vocab.w_max, a.vocab.arc_capacity) == (512, 900, 64)
    assert (a.adapt.lr, a.adapt.rank, a.adapt.lora_alpha, a.adapt.seed) == (0.001, 8, 8.0, 7)
    assert a.verify_logits == "all" and not a.pack_weights and not a.tune_tree  # a shape given: fixed


def test_serve_flags_build_the_same_settings_as_generate() -> None:
    from service.command import serve_config

    parser = build_parser()
    gen = stack_settings(parser.parse_args(["generate", "hi", "--method", "frspec", *FLAGS]), ["frspec"])
    served = serve_config(parser.parse_args(["serve", "--method", "frspec", *FLAGS])).stack_settings()
    assert served == gen
    auto = serve_config(parser.parse_args(["serve", "--tree", "auto"]))
    assert auto.tune_tree and auto.stack_settings().tune_tree


def test_serve_flags_override_only_what_they_name(tmp_path) -> None:
    from service.command import serve_config

    path = tmp_path / "c.yaml"
    path.write_text("method: evospec\ntree: {top_k: 4, depth: 4, total_tokens: 16}\nvocab: {w_max: 900}\n")
    cfg = serve_config(
        build_parser().parse_args(["serve", "--config", str(path), "--depth", "6", "--arc-capacity", "32"])
    )
    assert (cfg.tree.top_k, cfg.tree.depth, cfg.tree.total_tokens) == (4, 6, 16)
    assert (cfg.vocab.w_max, cfg.vocab.arc_capacity) == (900, 32)
    with pytest.raises(ValueError, match=r"command line: tree\.depth must be an integer >= 1, got 0"):
        serve_config(build_parser().parse_args(["serve", "--config", str(path), "--depth", "0"]))


def test_max_batch_flag_reaches_the_serve_config(tmp_path) -> None:
    from service.command import serve_config
    from service.config import ServeConfig

    assert serve_config(build_parser().parse_args(["serve"])).max_batch == ServeConfig().max_batch == "auto"
    path = tmp_path / "c.yaml"
    path.write_text("max_batch: 2\n")
    assert serve_config(build_parser().parse_args(["serve", "--config", str(path)])).max_batch == 2
    flag = build_parser().parse_args(
        ["serve", "--config", str(path), "--max-batch", "1", "--prefill-chunk", "64"]
    )
    assert (serve_config(flag).max_batch, serve_config(flag).prefill_chunk) == (1, 64)
    assert serve_config(build_parser().parse_args(["serve", "--max-batch", "auto"])).max_batch == "auto"
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        serve_config(build_parser().parse_args(["serve", "--max-batch", "0"]))
    with pytest.raises(SystemExit):  # argparse: "must be an integer >= 1 or auto"
        build_parser().parse_args(["serve", "--max-batch", "many"])


def test_defaults_agree_with_the_serve_config() -> None:
    from service.config import ServeConfig

    args = build_parser().parse_args(["generate", "hi", "--method", "evospec"])
    cli = stack_settings(args, ["evospec"], tune_by_default=True)  # as generate builds it
    served = ServeConfig(method="evospec").stack_settings()
    assert cli == served  # one schema, one set of defaults


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"], ["serve"]])
def test_method_help_names_every_method(command, capsys) -> None:
    assert set(METHODS) | {"auto"} <= set(METHOD_HELP.replace("|", " ").split())
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens
    assert all(m in out for m in (*METHODS, "auto"))


def test_weight_choices_are_the_formats_plus_auto():
    from evospec.models.quant import WEIGHT_FORMATS
    from evospec.options import WEIGHT_CHOICES

    assert ("auto", *WEIGHT_FORMATS) == WEIGHT_CHOICES


def test_prefetch_flag_reaches_the_stack_and_the_serve_config(capsys):
    from evospec.assembly import StackSettings
    from service.command import serve_config

    parser = build_parser()
    assert stack_settings(parser.parse_args(["generate", "x"]), ["ar"]).prefetch == "auto"
    assert stack_settings(parser.parse_args(["bench", "--prefetch", "t1"]), ["ar"]).prefetch == "t1"
    assert serve_config(parser.parse_args(["serve"])).prefetch == "auto"
    cfg = serve_config(parser.parse_args(["serve", "--prefetch", "t1:10"]))
    assert cfg.prefetch == "t1:10" and cfg.stack_settings().prefetch == "t1:10"
    with pytest.raises(ValueError, match=r"prefetch 'l2': use auto or HINT\[:KIB\]"):
        StackSettings(prefetch="l2")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--prefetch", "t1:100"])  # past 64 KiB
    assert "argument --prefetch: prefetch 't1:100': use auto or HINT[:KIB]" in capsys.readouterr().err


def test_weights_flag_reaches_the_stack_and_the_serve_config():
    from evospec.cli import build_parser
    from service.command import serve_config

    parser = build_parser()
    assert stack_settings(parser.parse_args(["generate", "x"]), ["ar"]).weights == "auto"
    assert stack_settings(parser.parse_args(["generate", "x", "--weights", "int8"]), ["ar"]).weights == "int8"
    assert serve_config(parser.parse_args(["serve"])).weights == "auto"
    cfg = serve_config(parser.parse_args(["serve", "--weights", "fp32"]))
    assert cfg.weights == "fp32" and cfg.stack_settings().weights == "fp32"


def test_prefix_reuse_flag_reaches_the_stack_and_the_serve_config():
    from evospec.cli import build_parser
    from service.command import serve_config

    parser = build_parser()
    assert stack_settings(parser.parse_args(["generate", "x"]), ["ar"]).prefix_reuse
    assert not stack_settings(parser.parse_args(["bench", "--no-prefix-reuse"]), ["ar"]).prefix_reuse
    assert serve_config(parser.parse_args(["serve"])).prefix_reuse
    cfg = serve_config(parser.parse_args(["serve", "--no-prefix-reuse"]))
    assert not cfg.prefix_reuse and not cfg.stack_settings().prefix_reuse
    assert stack_settings(parser.parse_args(["bench", "--prefix-cache-mb", "0"]), ["ar"]).prefix_cache_mb == 0
    cfg = serve_config(parser.parse_args(["serve", "--prefix-cache-mb", "64"]))
    assert cfg.stack_settings().prefix_cache_mb == 64
    assert serve_config(parser.parse_args(["serve"])).prefix_cache_mb is None  # prefix.STORE_MB
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefix-cache-mb", "-1"])


def test_draft_weights_flag_reaches_the_stack_and_the_serve_config(capsys):
    from evospec.cli import build_parser
    from service.command import serve_config

    parser = build_parser()
    assert stack_settings(parser.parse_args(["generate", "x"]), ["ar"]).draft_weights == "auto"
    args = parser.parse_args(["bench", "--draft-weights", "fp32"])
    assert stack_settings(args, ["eagle2"]).draft_weights == "fp32"
    assert serve_config(parser.parse_args(["serve"])).draft_weights == "auto"
    cfg = serve_config(parser.parse_args(["serve", "--draft-weights", "int8"]))
    assert cfg.draft_weights == "int8" and cfg.stack_settings().draft_weights == "int8"
    cfg = serve_config(parser.parse_args(["serve", "--draft-weights", "int4"]))
    assert cfg.draft_weights == "int4" and cfg.stack_settings().draft_weights == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--draft-weights", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "tunes"),
    [
        ([], True),  # no shape given: measured (generate: the one measured earlier, if any)
        (["--jump-forward", "2"], True),  # not part of the shape
        (["--depth", "3"], False),  # a shape given is the shape served
        (["--lookup", "2"], False),
        (["--depth", "3", "--tree", "auto"], True),
        (["--tree", "fixed"], False),
    ],
)
def test_tree_auto_unless_a_shape_is_given(argv: list[str], tunes: bool) -> None:
    from service.command import serve_config

    parser = build_parser()
    gen = parser.parse_args(["generate", "hi", "--method", "frspec", *argv])
    assert stack_settings(gen, ["frspec"], tune_by_default=True).tune_tree is tunes
    assert serve_config(parser.parse_args(["serve", "--method", "frspec", *argv])).tunes_tree is tunes
    bench = stack_settings(parser.parse_args(["bench", "--methods", "frspec", *argv]), ["frspec"])
    assert bench.tune_tree is (argv[-2:] == ["--tree", "auto"])  # a benchmark: the shape it is given


def test_a_config_tree_section_fixes_the_shape(tmp_path) -> None:
    from service.command import serve_config
    from service.config import ServeConfig, load_config

    assert ServeConfig().tunes_tree and ServeConfig(method="frspec").stack_settings().tune_tree
    path = tmp_path / "c.yaml"
    path.write_text("method: frspec\ntree: {top_k: 2, depth: 3, total_tokens: 6}\n")
    assert not load_config(path).tunes_tree
    path.write_text("method: frspec\ntree: {jump_forward: 0}\n")
    assert load_config(path).tunes_tree  # JSON guesses are no shape
    path.write_text("method: frspec\ntune_tree: true\ntree: {top_k: 2, depth: 3, total_tokens: 6}\n")
    assert load_config(path).tunes_tree
    flags = ["serve", "--config", str(path)]
    assert not serve_config(build_parser().parse_args([*flags, "--depth", "2"])).tunes_tree  # flags win
    assert serve_config(build_parser().parse_args([*flags, "--jump-forward", "2"])).tunes_tree
    assert not ServeConfig(tree=TreeConfig(top_k=2)).tunes_tree  # in code: a shape unlike the defaults
    path.write_text("method: frspec\ntune_tree: yes please\n")
    with pytest.raises(ValueError, match="tune_tree"):
        load_config(path)
