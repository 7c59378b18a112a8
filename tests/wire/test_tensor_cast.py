"""``cast_float32``: float32 -> bfloat16 / float16, round to nearest even, at C speed.

Against the element-by-element references (``Tensor.from_values``' bfloat16 rounding,
``struct``'s float16 packing) under hypothesis, the edge values one by one, and the
refusals, each with numpy and without it. Against torch itself:
``tests/real_engine/test_mm_golden.py``."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdispatch.errors import LocalProtocolError
from zmqdispatch.wire import tensors
from zmqdispatch.wire.tensors import Tensor, cast_float32

f32s = st.floats(width=32, allow_nan=False)


@pytest.fixture(autouse=True, params=["numpy", "integers"])
def cast_path(request, monkeypatch):
    """Every test runs on both paths of ``cast_float32``."""
    if request.param == "integers":
        monkeypatch.setattr(tensors, "_numpy_cast", lambda mv, dtype: None)
    return request.param


def pack(vals) -> bytes:
    return struct.pack(f"<{len(vals)}f", *vals)


@settings(max_examples=200, deadline=None)
@given(st.lists(f32s, max_size=300))
def test_bfloat16_equals_the_elementwise_rounding(vals):
    assert cast_float32(pack(vals), "bfloat16") == Tensor.from_values("bfloat16", [len(vals)], vals).data


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, min_value=-65504, max_value=65504), max_size=300))
def test_float16_equals_struct_packing(vals):
    assert cast_float32(pack(vals), "float16") == struct.pack(f"<{len(vals)}e", *vals)


def test_edges():
    ties = [struct.unpack("<f", struct.pack("<I", b))[0] for b in (0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF)]
    got = cast_float32(pack([*ties, 0.0, -0.0, math.inf, -math.inf, 3.4028234e38, 1e-45]), "bfloat16")
    # ties to even (0x3F80 stays, 0x3F81 goes up), above half up, below half down; the max float rounds to inf
    assert struct.unpack("<10H", got) == (0x3F80, 0x3F82, 0x3F81, 0x3F80, 0, 0x8000, 0x7F80, 0xFF80, 0x7F80, 0)
    nans = struct.pack("<3I", 0x7FC00000, 0xFFFFFFFF, 0x7F800001)
    assert struct.unpack("<3H", cast_float32(nans, "bfloat16")) == (0x7FC0,) * 3


def test_chunks_join_without_seams(monkeypatch, cast_path):
    monkeypatch.setattr(tensors, "_CAST_CHUNK", 12)
    vals = [i * 0.37 - 5 for i in range(50)]
    assert cast_float32(pack(vals), "bfloat16") == Tensor.from_values("bfloat16", [50], vals).data
    assert cast_float32(memoryview(pack(vals)), "float16") == struct.pack("<50e", *vals)


@pytest.mark.parametrize("data, dtype, words", [
    (bytes(6), "bfloat16", "not whole float32 values"),
    (bytes(8), "int8", "cannot cast float32 to 'int8'"),
    (pack([70000.0]), "float16", "beyond float16's range"),
])
def test_refusals(data, dtype, words):
    with pytest.raises(LocalProtocolError, match=words):
        cast_float32(data, dtype)
