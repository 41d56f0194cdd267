"""Input and parameter dtypes outside torch autocast, as te.Linear checks them (TE 2.20,
transformer_engine/pytorch/module/base.py:1482-1501, `set_activation_dtype`, called by
`prepare_forward` at every forward, FP8 or not, but in an FP8 recompute, l. 1601, 1617): under
torch autocast the activation dtype is
autocast's and nothing is checked; otherwise, unless the input's dtype equals the dtype the
layer last computed in (TE's cache, also set under autocast), every parameter must have the
input's dtype, or TE raises TypeError ("Data types for parameters must match when outside of
autocasted region"; from TE 2.14, base.py:980-985 at v2.14; an assert up to 2.13, base.py:939-944
at v2.13). The rule here is that text, not the emulation's code."""

from __future__ import annotations

import contextlib

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


Call = tuple[torch.dtype, bool, bool]  # input dtype, under torch autocast, under FP8


def te_raises(param_dtypes: list[torch.dtype], calls: list[Call]) -> list[bool]:
    """TE's `set_activation_dtype` per call: whether it raises. FP8 or not, it is asked alike."""
    cached, out = None, []
    for dtype, autocast, _fp8 in calls:
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


def emulated_raises(layer: EmulatedFP8Linear, calls: list[Call]) -> list[bool]:
    out = []
    for dtype, autocast, fp8 in calls:
        x = torch.randn(16, 32).to(dtype)
        fp8_region = fp8_autocast(recipe=FP8Recipe()) if fp8 else contextlib.nullcontext()
        with fp8_region, torch.autocast("cpu", BF16, enabled=autocast):
            try:
                layer(x).float().sum().backward()
            except TypeError as error:
                assert "parameter" in str(error) and "autocast" in str(error), error
                assert "2.14" in str(error), error  # TypeError from TE 2.14 only
                assert "\n" not in str(error)
                out.append(True)
                continue
        out.append(False)
    return out


CASES = {
    "bf16 input, fp32 params": (F32, [(BF16, False, True)]),
    "fp16 input, fp32 params": (F32, [(F16, False, True)]),
    "fp32 input, bf16 params": (BF16, [(F32, False, True)]),
    "same dtype": (F16, [(F16, False, True), (F16, False, True)]),
    "Composer amp: fp32 params under autocast": (F32, [(F32, True, True), (BF16, True, True)]),
    "amp, a bf16 input first": (F32, [(BF16, True, True), (F32, True, True)]),
    # TE's cache: bfloat16 was last computed in (under autocast), so the check is skipped
    "autocast, then bf16 input outside it": (F32, [(F32, True, True), (BF16, False, True)]),
    "fp32, then bf16 input": (F32, [(F32, False, True), (BF16, False, True)]),
    # forwards outside FP8 set TE's cache too, and raise TE's TypeError
    "autocast outside FP8, then bf16 input under FP8": (F32, [(F32, True, False),
                                                             (BF16, False, True)]),
    "FP8 amp, fp32 outside FP8, then bf16 input under FP8": (
        F32, [(F32, True, True), (F32, False, False), (BF16, False, True)]),
    "bf16 input outside FP8, fp32 params": (F32, [(BF16, False, False)]),
    "bf16 input under FP8, then outside it": (F32, [(F32, True, True), (BF16, False, False)]),
}


RAISING = ("bf16 input, fp32 params", "fp16 input, fp32 params", "fp32 input, bf16 params",
           "fp32, then bf16 input", "FP8 amp, fp32 outside FP8, then bf16 input under FP8",
           "bf16 input outside FP8, fp32 params")


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


@pytest.mark.parametrize("operand", ["input", "weight"])
def test_a_float64_operand_in_calibration_is_not_called_fp8(operand):
    """Calibration runs outside FP8 (TE: `fp8_autocast(enabled=False, calibrating=True)`, under
    torch autocast a cast to autocast's dtype, linear.py:400, 439, 493): the refusal must not
    call the operand an FP8 one."""
    layer = EmulatedFP8Linear(32, 16, dtype=torch.float64 if operand == "weight" else F32)
    x = torch.randn(16, 32, dtype=torch.float64 if operand == "input" else F32)
    with (fp8_autocast(enabled=False, calibrating=True, recipe=FP8Recipe()),
          torch.autocast("cpu", BF16), pytest.raises(RuntimeError) as error):
        layer(x)
    message = str(error.value)
    assert f"calibration forward with {operand} torch.float64" in message
    assert "FP8 " not in message and "\n" not in message  # "FP8 input", as the old one said


def test_outside_fp8_the_cached_dtype_is_computed_in_as_te_casts_the_parameters():
    """After an FP8 forward under autocast (TE's cache: bfloat16), a bfloat16 input outside both
    is not checked, and te.Linear casts weight and bias to that dtype (linear.py:439, 493, 503)."""
    layer = EmulatedFP8Linear(32, 16)
    with fp8_autocast(recipe=FP8Recipe()), torch.autocast("cpu", BF16):
        layer(torch.randn(16, 32))
    x = torch.randn(16, 32, dtype=BF16)
    out = layer(x)
    w, b = layer.weight.detach().to(BF16), layer.bias.detach().to(BF16)
    reference = (x.double() @ w.double().T + b.double())
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), reference, rtol=2**-7, atol=2**-7)
