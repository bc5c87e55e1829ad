"""``scripts/isa_kernels.py``: the kernels' costs under this build's instruction set (wave 27)."""

from __future__ import annotations

import pytest

from evospec.kernels.int4_matmul import vnni_available
from tests.script_modules import load_script


def test_median_s_takes_the_median_of_per_call_means():
    script = load_script("isa_kernels")
    calls = []
    t = script.median_s(lambda: calls.append(1), calls=4, repeats=3)
    assert len(calls) == 4 + 4 * 3  # warm-up, then every timing
    assert 0 < t < 0.01


@pytest.mark.skipif(not vnni_available(), reason="no int8-activation kernels (needs AVX2) here")
def test_products_and_attention_are_timed_per_row_count_and_length():
    script = load_script("isa_kernels")
    products = script.product_ms(32, 64, [1, 3], calls=2, repeats=1)
    assert set(products) == {"int4", "int8 LM head"}
    assert all(len(v) == 2 and min(v) > 0 for v in products.values())
    attention = script.attention_us([20, 40], [1, 2], calls=2, repeats=1)
    assert list(attention) == [(20, 1), (20, 2), (40, 1), (40, 2)]
    assert min(attention.values()) > 0
