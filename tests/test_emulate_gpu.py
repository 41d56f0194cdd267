"""The emulated layer against `te.Linear` on an H100: same weights, inputs and gradients, 10
steps, float32 and bfloat16, delayed and current scaling. Delayed scaling: every history and
scale bit-exact after every step. Outputs and gradients: within what cuBLAS's accumulation
order (and Hopper's fast FP8 accumulation in the forward GEMM) explains.

Never run: written on CPU-only machines (skipped without CUDA), against TE 2.20's sources.
"""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe

pytestmark = pytest.mark.gpu


def _te_recipe(recipe: FP8Recipe):
    """The TE recipe that means `recipe`, built here from TE's own classes."""
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    if recipe.scaling == "delayed":
        return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=recipe.amax_history_len,
                              amax_compute_algo=recipe.amax_compute_algo, margin=recipe.margin)
    return Float8CurrentScaling(fp8_format=Format.HYBRID)


def _te_autocast(te, te_recipe):
    """TE's FP8 autocast: `te.autocast(recipe=)` from TE 2.9, `te.fp8_autocast` before."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within accumulation-order error: 2**-7 of the largest |want| in bfloat16 (about one
    bfloat16 step of it), 2**-10 in float32 (Hopper's fast-accumulation forward GEMM keeps
    fewer bits than float32)."""
    bound = (2.0 ** -7 if want.dtype == torch.bfloat16 else 2.0 ** -10) * want.abs().max()
    error = (got.float() - want.float()).abs().max()
    assert error <= bound, f"{what}: max error {error.item():.3g} > {bound.item():.3g}"


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_emulated_layer_matches_te_linear(scaling, dtype):
    te = pytest.importorskip("transformer_engine.pytorch")
    recipe = FP8Recipe(amax_history_len=4) if scaling == "delayed" else FP8Recipe(scaling="current")
    torch.manual_seed(0)
    reference = te.Linear(768, 768, params_dtype=dtype, device="cuda")
    emulated = EmulatedFP8Linear(768, 768, dtype=dtype, device="cuda")
    with torch.no_grad():
        emulated.weight.copy_(reference.weight)
        emulated.bias.copy_(reference.bias)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for step in range(10):
        x = torch.randn(64, 768, device="cuda", generator=generator).to(dtype) * (step % 3 + 1)
        grad = torch.randn(64, 768, device="cuda", generator=generator).to(dtype) * 10 ** -step
        inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        with _te_autocast(te, _te_recipe(recipe)):
            out_te = reference(inputs[0])
        with fp8_autocast(recipe=recipe):
            out_emulated = emulated(inputs[1])
        out_te.backward(grad)
        out_emulated.backward(grad)
        torch.cuda.synchronize()
        where = f"step {step}"
        assert out_emulated.dtype == out_te.dtype == dtype
        _close(out_emulated, out_te, f"{where} output")
        _close(inputs[1].grad, inputs[0].grad, f"{where} dgrad")
        _close(emulated.weight.grad, reference.weight.grad, f"{where} wgrad")
        _close(emulated.bias.grad, reference.bias.grad, f"{where} bgrad")
        if scaling == "delayed":
            got, want = read_fp8_meta(emulated), read_fp8_meta(reference)
            for key in ("fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale"):
                assert torch.equal(got[key], want[key]), (where, key, got[key], want[key])
        with torch.no_grad():  # one SGD step on both, so the weight amaxes move
            for p_te, p_emulated in ((reference.weight, emulated.weight),
                                     (reference.bias, emulated.bias)):
                p_te -= 0.01 * p_te.grad
                p_emulated.copy_(p_te)
        for p in (*reference.parameters(), *emulated.parameters()):
            p.grad = None
