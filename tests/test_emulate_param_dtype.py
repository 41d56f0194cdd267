"""Input and parameter dtypes outside torch autocast, as te.Linear checks them (TE 2.20,
transformer_engine/pytorch/module/base.py:1482-1501, `set_activation_dtype`, called by
`prepare_forward` at every forward, l. 1620): under torch autocast the activation dtype is
autocast's and nothing is checked; otherwise, unless the input's dtype equals the dtype the
layer last computed in (TE's cache, also set under autocast), every parameter must have the
input's dtype, or TE raises TypeError ("Data types for parameters must match when outside of
autocasted region"; an assert from TE 2.0, base.py:718-723 at v2.0). The rule here is that
text, not the emulation's code."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def te_raises(param_dtypes: list[torch.dtype], calls: list[tuple[torch.dtype, bool]]) -> list[bool]:
    """TE's `set_activation_dtype` per call (input dtype, under autocast): whether it raises."""
    cached, out = None, []
    for dtype, autocast in calls:
        if autocast:
            cached = BF16
            out.append(False)
        elif cached == dtype:
            out.append(False)
        else:
            bad = any(p != dtype for p in param_dtypes)
            out.append(bad)
            if not bad:
                cached = dtype
    return out


def emulated_raises(layer: EmulatedFP8Linear, calls: list[tuple[torch.dtype, bool]]) -> list[bool]:
    out = []
    for dtype, autocast in calls:
        x = torch.randn(16, 32).to(dtype)
        with fp8_autocast(recipe=FP8Recipe()), torch.autocast("cpu", BF16, enabled=autocast):
            try:
                layer(x).float().sum().backward()
            except TypeError as error:
                assert "parameter" in str(error) and "autocast" in str(error), error
                assert "\n" not in str(error)
                out.append(True)
                continue
        out.append(False)
    return out


CASES = {
    "bf16 input, fp32 params": (F32, [(BF16, False)]),
    "fp16 input, fp32 params": (F32, [(F16, False)]),
    "fp32 input, bf16 params": (BF16, [(F32, False)]),
    "same dtype": (F16, [(F16, False), (F16, False)]),
    "Composer amp: fp32 params under autocast": (F32, [(F32, True), (BF16, True)]),
    "amp, a bf16 input first": (F32, [(BF16, True), (F32, True)]),
    # TE's cache: bfloat16 was last computed in (under autocast), so the check is skipped
    "autocast, then bf16 input outside it": (F32, [(F32, True), (BF16, False)]),
    "fp32, then bf16 input": (F32, [(F32, False), (BF16, False)]),
}


RAISING = ("bf16 input, fp32 params", "fp16 input, fp32 params", "fp32 input, bf16 params",
           "fp32, then bf16 input")


@pytest.mark.parametrize("case", CASES)
def test_mismatched_dtypes_outside_autocast_raise_where_te_raises(case):
    params, calls = CASES[case]
    layer = EmulatedFP8Linear(32, 16, dtype=params)
    expected = te_raises([params, params], calls)
    assert emulated_raises(layer, calls) == expected
    assert expected[-1] == (case in RAISING)  # the reference itself, on the cases TE refuses


def test_a_bias_of_another_dtype_is_named():
    layer = EmulatedFP8Linear(32, 16, dtype=BF16)
    layer.bias.data = layer.bias.data.float()
    with fp8_autocast(recipe=FP8Recipe()), pytest.raises(TypeError, match="'bias'"):
        layer(torch.randn(16, 32, dtype=BF16))


#: The dtypes TE's FP8 casts read (TE 2.20, transformer_engine/common/common.h
#: TRANSFORMER_ENGINE_TYPE_SWITCH_INPUT: Float32, Float16, BFloat16; float64 has no TE DType at
#: all, pytorch/csrc/common.h:495-520 `GetTransformerEngineDType`: "Invalid type").
TE_CAST_DTYPES = (F32, F16, BF16)


@pytest.mark.parametrize(("x_dtype", "w_dtype", "autocast"), [
    (torch.float64, torch.float64, False), (torch.float64, F32, True), (F32, torch.float64, True),
    (F32, F32, True), (F16, F16, False)])
def test_float64_operands_are_refused_as_te_refuses_to_cast_them(x_dtype, w_dtype, autocast):
    """te.Linear quantizes its input and weight as they come (linear.py:436, base.py:883), so
    under autocast too a float64 operand stops TE's first FP8 forward with RuntimeError."""
    layer = EmulatedFP8Linear(32, 16, bias=False, dtype=w_dtype)
    x = torch.randn(16, 32, dtype=x_dtype)
    te_refuses = x_dtype not in TE_CAST_DTYPES or w_dtype not in TE_CAST_DTYPES
    with fp8_autocast(recipe=FP8Recipe()), torch.autocast("cpu", BF16, enabled=autocast):
        if te_refuses:
            with pytest.raises(RuntimeError, match="float64") as error:
                layer(x)
            assert "\n" not in str(error.value)
        else:
            assert torch.isfinite(layer(x)).all()
