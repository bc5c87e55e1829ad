"""The weight loops' prefetch settings (hint and distance): named, set and read back process-wide,
each hint really in the built library, never a change of any bit, and the timing and choice
helpers (on a fake clock)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from evospec.kernels import prefetch
from evospec.kernels.int4_matmul import int4_matmul, pack_int4, vnni_available
from evospec.kernels.int8_matmul import int8_matmul, pack_int8
from evospec.models.quant import GroupCodes, Int8Matmul

needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no int8-activation kernels (needs AVX2) here")


@pytest.fixture
def restore_hints():
    before = prefetch.hints()
    distances = torch.ops.evospec.prefetch_distances() if prefetch.available() else None
    yield
    prefetch.set_hints(*before)
    if distances is not None:
        torch.ops.evospec.set_prefetch_distance(*distances)


def test_settings_are_named_hint_and_kibibytes():
    assert str(prefetch.Setting("t1", 10240)) == "t1:10"
    assert str(prefetch.Setting("nta")) == "nta:2.5"  # the distance before wave 46
    assert str(prefetch.Setting("none", 10240)) == "none"  # no prefetch: no distance
    assert prefetch.Setting.parse("t1:10") == prefetch.Setting("t1", 10240)
    assert prefetch.Setting.parse("t0") == prefetch.Setting("t0", prefetch.DISTANCE_DEFAULT)
    assert prefetch.Setting.parse("t2:0.0625") == prefetch.Setting("t2", 64)
    for c in prefetch.CANDIDATES:
        assert prefetch.Setting.parse(str(c)) == c or c.hint == "none"
    assert len(set(map(str, prefetch.CANDIDATES))) == len(prefetch.CANDIDATES) == 13
    assert prefetch.DEFAULT in prefetch.CANDIDATES


@pytest.mark.parametrize(
    "bad", ["l2", "T0", "t1:", "t1:x", "t1:0", "t1:65", "t1:0.01", "t1:-4", "t1:inf", "t1:nan"]
)
def test_bad_settings_are_refused_naming_the_forms(bad):
    with pytest.raises(ValueError, match=r"use HINT\[:KIB\], HINT one of"):
        prefetch.Setting.parse(bad)
    assert prefetch.mode_problem(bad).startswith(f"prefetch {bad!r}: use auto or HINT[:KIB]")
    assert prefetch.mode_problem("auto") is None and prefetch.mode_problem("t1:20") is None


@needs_vnni
def test_settings_are_applied_and_read_back(restore_hints):
    prefetch.set_hints("nta", "t1")
    for s in (prefetch.Setting("t1", 10240), prefetch.Setting("t0", 64), prefetch.Setting("none", 65536)):
        prefetch.apply(s)
        assert prefetch.current() == s
        assert prefetch.hints()[1] == "t1"  # the kept hint is left alone
        assert torch.ops.evospec.prefetch_distances()[0] == prefetch.DISTANCE_DEFAULT  # and its distance


@needs_vnni
def test_the_op_refuses_distances_it_cannot_take(restore_hints):
    for kept, streamed in ((0, 2560), (2560, 100), (2560, 65600), (-64, 2560)):
        with pytest.raises(RuntimeError, match="distances are multiples of 64 bytes"):
            torch.ops.evospec.set_prefetch_distance(kept, streamed)


@needs_vnni
def test_hints_are_set_and_read_back(restore_hints):
    for streamed in prefetch.HINTS:
        prefetch.set_hints(streamed, "t1")
        assert prefetch.hints() == (streamed, "t1")


def test_unknown_hints_are_refused():
    with pytest.raises(ValueError, match="prefetch hint 'l2' is not one of"):
        prefetch.set_hints("l2")
    with pytest.raises(ValueError, match="prefetch hint 'T0' is not one of"):
        prefetch.set_hints("nta", "T0")


@needs_vnni
def test_no_setting_changes_a_bit(restore_hints):
    g = torch.Generator().manual_seed(3)
    codes = GroupCodes.from_float(torch.randn(64, 256, generator=g))
    packed4 = pack_int4(codes.codes, codes.scale, codes.zero - 8 * codes.scale)
    mm8 = Int8Matmul(torch.randn(64, 256, generator=g), None, [64])
    packed8 = pack_int8(mm8.codes)
    x = torch.randn(5, 256, generator=g)
    outs = []
    for h, d in [(h, prefetch.DISTANCE_DEFAULT) for h in prefetch.HINTS] + [("t1", 64), ("t0", 65536)]:
        prefetch.set_hints(h, h)
        torch.ops.evospec.set_prefetch_distance(d, d)
        outs.append(
            [int4_matmul(x, packed4, stream=s) for s in (False, True)]
            + [int8_matmul(x, packed8, mm8.scale_f32, stream=s) for s in (False, True)]
        )
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], out, strict=True))


@needs_vnni
def test_no_setting_changes_a_fused_forward(restore_hints):
    """The layer stack's streamed weights and the LM head under every candidate setting, and the
    attention's key/value prefetch off and near: the same logits."""
    from evospec.kernels.cpu_ops import load_cpu_ops
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import quantize_linears
    from tests.decoding.spec_helpers import tiny_target

    if not load_cpu_ops():
        pytest.skip("no fused CPU ops here")
    model = tiny_target(0, head_dim=16)
    quantize_linears(model, "int4", stream=True)
    model.exact_rows = True
    assert enable_fused_ops(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    logits = []
    kv = prefetch.kv_ahead()
    try:
        with torch.inference_mode():
            for setting, ahead in [(s, 64) for s in prefetch.CANDIDATES] + [
                (prefetch.DEFAULT, 0),
                (prefetch.DEFAULT, 3),
            ]:
                prefetch.apply(setting)
                prefetch.set_kv_ahead(ahead)
                cache = model.new_cache(16)
                logits.append(model(tokens, torch.arange(12), cache, logits="all").logits)
    finally:
        prefetch.set_kv_ahead(kv)
    assert all(torch.equal(logits[0], other) for other in logits[1:])


@needs_vnni
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump here")
def test_the_library_holds_every_prefetch_instruction():
    """GCC 12 merged ``_mm_prefetch`` calls of different hints in one switch and then dropped them
    all (every hint then timed the same, as none); each hint is now its own instruction."""
    from evospec.common import evospec_home
    from evospec.kernels.cpu_ops import build_key

    lib = evospec_home() / "kernels" / build_key() / "evospec_cpu_ops.so"
    if not lib.exists():
        pytest.skip("the op library was loaded from elsewhere")
    text = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    for ins in ("prefetcht0", "prefetcht1", "prefetcht2", "prefetchnta"):
        assert text.count(ins) >= 10, ins  # one per tile loop and row count, at least


class FakeClock:
    """A clock whose reading advances by the cost of the setting in use at each call."""

    def __init__(self, cost: dict[str, float]):
        self.cost, self.now, self.setting = cost, 0.0, None

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.cost[self.setting]


def test_time_settings_times_each_candidate_under_its_own_setting(monkeypatch):
    state = {"streamed": prefetch.DEFAULT}
    monkeypatch.setattr(prefetch, "apply", lambda s: state.update(streamed=s))
    cands = [prefetch.Setting.parse(n) for n in ("nta", "t0", "t0:10", "none")]
    clock = FakeClock({"nta:2.5": 0.008, "t0:2.5": 0.003, "t0:10": 0.0026, "none": 0.0045})
    order = []

    def call() -> None:
        clock.setting = str(state["streamed"])
        order.append(clock.setting)
        clock.step()

    ms = prefetch.time_settings(call, cands, rounds=3, calls=4, clock=clock)
    assert {str(s): v for s, v in ms.items()} == pytest.approx(
        {"nta:2.5": 8.0, "t0:2.5": 3.0, "t0:10": 2.6, "none": 4.5}
    )
    assert len(order) == 3 * 4 * 5  # a warm-up and 4 timed calls per setting and round
    firsts = [order[r * 20] for r in range(3)]
    assert firsts == ["nta:2.5", "t0:2.5", "t0:10"]  # the order rotates per round


def test_pick_keeps_the_incumbent_within_the_margin():
    def ms(**named: float) -> dict:
        return {prefetch.Setting.parse(k.replace("_", ":")): v for k, v in named.items()}

    assert prefetch.pick(ms(nta=8.7, t0=3.3, t1=3.4, none=4.5)) == prefetch.Setting("t0")
    assert prefetch.pick(ms(nta=3.05, t0=3.0, t1=3.1)) == prefetch.DEFAULT  # 1.7%: noise
    assert prefetch.pick(ms(nta=3.2, t0=3.0)) == prefetch.Setting("t0")  # 6.7%
    assert prefetch.pick(ms(t0=3.0, t1_10=2.6)) == prefetch.Setting("t1", 10240)  # no incumbent timed
    incumbent = prefetch.Setting("t1", 10240)
    assert prefetch.pick(ms(t1_10=2.62, t1_20=2.6), incumbent=incumbent) == incumbent


@pytest.fixture
def restore_kv_ahead():
    before = prefetch.kv_ahead()
    yield
    prefetch.set_kv_ahead(before)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_no_kv_prefetch_distance_changes_attention(restore_kv_ahead, dtype):
    """The attention's key/value prefetch, off, near and far: the same bits for a step, a 3-row
    chain and a draft tree over 300 cached slots."""
    from evospec.kernels.cpu_ops import load_cpu_ops

    if not load_cpu_ops():
        pytest.skip("no fused CPU ops here")
    assert prefetch.kv_ahead() == prefetch.KV_AHEAD_DEFAULT == 64
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 3, 300, 64, generator=g).to(dtype)
    values = torch.randn(1, 3, 300, 64, generator=g).to(dtype)
    tree = torch.tensor([0b1, 0b11, 0b101], dtype=torch.long)
    outs = []
    for ahead in (0, 64, 7, 1000):
        prefetch.set_kv_ahead(ahead)
        got = []
        for n in (1, 3):
            q = torch.randn(1, 9, n, 64, generator=torch.Generator().manual_seed(n))
            got.append(torch.ops.evospec.decode_attention(q, keys, values, None, 0.125, 0))
        got.append(torch.ops.evospec.decode_attention(q, keys, values, None, 0.125, 0, tree))
        outs.append(got)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


def test_bad_kv_prefetch_distances_are_refused():
    for bad in (-1, 4097):
        with pytest.raises(ValueError, match=r"use 0\.\.4096"):
            prefetch.set_kv_ahead(bad)
    if prefetch.available():
        with pytest.raises(RuntimeError, match=r"set_kv_ahead: 0\.\.4096 keys"):
            torch.ops.evospec.set_kv_ahead(5000)
