"""The weight loops' prefetch hints: set and read back process-wide, each one really in the built
library, never a change of any bit, and the timing and choice helpers (on a fake clock)."""

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
    yield
    prefetch.set_hints(*before)


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
def test_no_hint_changes_a_bit(restore_hints):
    g = torch.Generator().manual_seed(3)
    codes = GroupCodes.from_float(torch.randn(64, 256, generator=g))
    packed4 = pack_int4(codes.codes, codes.scale, codes.zero - 8 * codes.scale)
    mm8 = Int8Matmul(torch.randn(64, 256, generator=g), None, [64])
    packed8 = pack_int8(mm8.codes)
    x = torch.randn(5, 256, generator=g)
    outs = []
    for h in prefetch.HINTS:
        prefetch.set_hints(h, h)
        outs.append(
            [int4_matmul(x, packed4, stream=s) for s in (False, True)]
            + [int8_matmul(x, packed8, mm8.scale_f32, stream=s) for s in (False, True)]
        )
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], out, strict=True))


@needs_vnni
def test_no_hint_changes_a_fused_forward(restore_hints):
    """The layer stack's streamed weights and the LM head under every hint: the same logits."""
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
    with torch.inference_mode():
        for h in prefetch.HINTS:
            prefetch.set_hints(h)
            cache = model.new_cache(16)
            logits.append(model(tokens, torch.arange(12), cache, logits="all").logits)
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
    """A clock whose reading advances by the cost of the hint in use at each call."""

    def __init__(self, cost: dict[str, float]):
        self.cost, self.now, self.hint = cost, 0.0, None

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.cost[self.hint]


def test_time_hints_times_each_candidate_under_its_own_hint(monkeypatch):
    state = {"streamed": "nta", "kept": "t0"}
    monkeypatch.setattr(prefetch, "set_hints", lambda s, k="t0": state.update(streamed=s, kept=k))
    monkeypatch.setattr(prefetch, "hints", lambda: (state["streamed"], state["kept"]))
    clock = FakeClock({"nta": 0.008, "t0": 0.003, "t1": 0.0032, "none": 0.0045})
    order = []

    def call() -> None:
        clock.hint = state["streamed"]
        order.append(state["streamed"])
        clock.step()

    ms = prefetch.time_hints(call, rounds=3, calls=4, clock=clock)
    assert ms == pytest.approx({"nta": 8.0, "t0": 3.0, "t1": 3.2, "none": 4.5})
    assert len(order) == 3 * 4 * 5  # a warm-up and 4 timed calls per hint and round
    firsts = [order[r * 20] for r in range(3)]
    assert firsts == ["nta", "t0", "t1"]  # the order rotates per round
    assert state["kept"] == "t0"  # the kept hint is left alone


def test_pick_keeps_the_incumbent_within_the_margin():
    assert prefetch.pick({"nta": 8.7, "t0": 3.3, "t1": 3.4, "none": 4.5}) == "t0"
    assert prefetch.pick({"nta": 3.05, "t0": 3.0, "t1": 3.1}) == "nta"  # 1.7%: noise
    assert prefetch.pick({"nta": 3.2, "t0": 3.0}) == "t0"  # 6.7%
    assert prefetch.pick({"t0": 3.0, "t1": 2.9}, incumbent="nta") == "t1"
