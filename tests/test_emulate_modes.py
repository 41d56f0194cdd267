"""The emulated backend in the modes people run TE in, against references written here from
TransformerEngine 2.20's rules (TE read at 2.20.0.dev0, commit d0067d0; file and line in each
docstring), not from the emulation's own primitives."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe, RecipeError
from tests.test_emulate_te import E4M3, E5M2, te_amax, te_scale


def _after_one_update(amaxes: list[float], length: int, fp8_max: float) -> tuple[list, list]:
    """A fresh state (scales 1, zero history of `length` rows) after TE's fused update with
    `amaxes` recorded in row 0 (delayed_scaling.cu:182-253): a column that recorded something
    moves its amax to the last row and takes `fp8_max / amax`; one that recorded 0 stays."""
    history = [[0.0] * len(amaxes) for _ in range(length)]
    history[-1] = list(amaxes)
    scales = [te_scale(fp8_max, a) if a > 0 else 1.0 for a in amaxes]
    return history, scales


@pytest.mark.parametrize("around", [torch.inference_mode, torch.no_grad],
                         ids=["inference_mode", "no_grad"])
def test_a_first_fp8_forward_under_inference_mode_then_training(around):
    """An eval/validation forward under `torch.inference_mode()` before the first training step
    (Lightning validates that way) sized the layer's history there, as an inference tensor: the
    next training forward's amax record raised 'Inplace update to inference tensor outside
    InferenceMode'. TE writes its state through raw pointers (the cast kernels' amax,
    pytorch/csrc/extensions/recipe.cpp:44-53 for the update) and trains on; as with `no_grad`,
    the eval amax waits in row 0 for the training step's update (quantization.py:779)."""
    torch.manual_seed(11)
    recipe = FP8Recipe(amax_history_len=4)
    layer = EmulatedFP8Linear(16, 16)
    x_eval, x_train = torch.randn(16, 16) * 9, torch.randn(16, 16)
    with around(), fp8_autocast(recipe=recipe):
        layer(x_eval)
    with fp8_autocast(recipe=recipe):
        out = layer(x_train)
    grad = torch.randn(16, 16) * 3
    out.backward(grad)
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    history, scales = _after_one_update(
        [max(te_amax(x_eval), te_amax(x_train)), te_amax(layer.weight), 0.0], 4, E4M3)
    assert fwd.amax_history.tolist() == history and fwd.scale.tolist() == scales
    history, scales = _after_one_update([te_amax(grad), 0.0], 4, E5M2)
    assert bwd.amax_history.tolist() == history and bwd.scale.tolist() == scales
    assert not fwd.amax_history.is_inference() and not bwd.amax_history.is_inference()


def test_calibration_runs_in_high_precision_and_records_nothing_as_te_linear():
    """TE's calibration mode (`autocast(enabled=False, calibrating=True)`): te.Linear's forward
    runs in high precision and its `calibrate` calls get no quantizer outside FP8 (linear.py:
    506-510, `_get_quantizers` returning None for each, l. 2082-2084), so nothing is recorded
    and no update follows (the exit updates only enabled regions, quantization.py:779), while
    `init_fp8_metadata` gives the layer the recipe and its sized state (module/base.py:
    1534-1566). The emulation refused the keyword (TypeError)."""
    torch.manual_seed(12)
    recipe = FP8Recipe(amax_history_len=4)
    layer = EmulatedFP8Linear(16, 16)
    x_cal = (torch.randn(16, 16) * 50).requires_grad_()
    with fp8_autocast(enabled=False, recipe=recipe, calibrating=True):
        out = layer(x_cal)
    assert torch.equal(out, x_cal @ layer.weight.t() + layer.bias)  # no FP8 cast
    out.sum().backward()
    assert torch.equal(x_cal.grad, torch.ones(16, 16) @ layer.weight.detach())
    for meta, n in ((layer.fp8_meta["scaling_fwd"], 3), (layer.fp8_meta["scaling_bwd"], 2)):
        assert meta.amax_history.tolist() == [[0.0] * n] * 4 and meta.scale.tolist() == [1.0] * n
    x = torch.randn(16, 16)
    with fp8_autocast(recipe=recipe):  # the first FP8 step: no calibration amax in row 0
        layer(x)
    history, scales = _after_one_update([te_amax(x), te_amax(layer.weight), 0.0], 4, E4M3)
    fwd = layer.fp8_meta["scaling_fwd"]
    assert fwd.amax_history.tolist() == history and fwd.scale.tolist() == scales
    fresh = EmulatedFP8Linear(16, 16)  # calibration gave it its recipe, as TE's metadata
    with fp8_autocast(enabled=False, recipe=recipe, calibrating=True):
        fresh(x)
    with pytest.raises(RecipeError, match=r"^fp8_recipe\.margin: "):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=4, margin=1)):
            fresh(x)
