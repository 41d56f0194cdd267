"""The emulated backend in the modes people run TE in, against references written here from
TransformerEngine 2.20's rules (TE read at 2.20.0.dev0, commit d0067d0; file and line in each
docstring), not from the emulation's own primitives."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.recipe import FP8Recipe, RecipeError
from tests.test_emulate_te import E4M3, E5M2, te_amax, te_scale


def _te_update(history: list[list[float]], scales: list[float], fp8_max: float,
               algo: str = "max") -> tuple[list[list[float]], list[float]]:
    """TE's fused delayed-scaling update of one state, column by column (delayed_scaling.cu:
    182-253): a column whose row 0 is 0 recorded nothing and stays; any other takes
    `fp8_max / amax`, amax the column's max (or row 0 for `most_recent`), and rolls up by one,
    row 0 becoming the last row and the new row 0 zero."""
    history, scales = [row[:] for row in history], scales[:]
    for j in range(len(scales)):
        column = [row[j] for row in history]
        if column[0] == 0:
            continue
        scales[j] = te_scale(fp8_max, column[0] if algo == "most_recent" else max(column))
        for i, value in enumerate([0.0, *column[2:], column[0]]):
            history[i][j] = value
    return history, scales


def _after_one_update(amaxes: list[float], length: int, fp8_max: float) -> tuple[list, list]:
    """A fresh state (scales 1, zero history of `length` rows) after one update with `amaxes`
    recorded in row 0."""
    history = [list(amaxes)] + [[0.0] * len(amaxes) for _ in range(length - 1)]
    return _te_update(history, [1.0] * len(amaxes), fp8_max)


@pytest.mark.parametrize("around", [torch.inference_mode, torch.no_grad],
                         ids=["inference_mode", "no_grad"])
def test_a_first_fp8_forward_under_inference_mode_then_training(around):
    """An eval/validation forward under `torch.inference_mode()` before the first training step
    (Lightning validates that way) sized the layer's history there, as an inference tensor: the
    next training forward's amax record raised 'Inplace update to inference tensor outside
    InferenceMode'. TE writes its state through raw pointers (the cast kernels' amax,
    pytorch/csrc/extensions/recipe.cpp:44-53 for the fused update) and trains on; as with `no_grad`,
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


def test_a_layer_called_twice_and_two_micro_batches_in_one_autocast():
    """Weight sharing and gradient accumulation inside one autocast. TE's cast kernels take the
    max into the amax slot (`atomicMaxFloat`, common/cast/fp8/quantize_fp8.cuh:223; nothing
    zeroes it before a cast, pytorch/csrc/quantizer.cpp:632-644), so every call of the layer in
    the region counts; the forward update comes once, at the exit (quantization.py:779). The
    first call that casts with grad takes the first-module flag (linear.py:258-265,
    1436-1442): the backward update comes at the end of its backward (l. 1467-1470), so a
    second micro-batch's gradient, recorded after it, waits in row 0 for the next step's."""
    torch.manual_seed(13)
    recipe = FP8Recipe(amax_history_len=4)
    layer = EmulatedFP8Linear(16, 16)
    x1, x2, x3, x4 = (torch.randn(16, 16) * s for s in (1.0, 6.0, 2.0, 0.5))
    g1, g2, g4 = (torch.randn(16, 16) * s for s in (5.0, 40.0, 1.0))
    with fp8_autocast(recipe=recipe):
        y1 = layer(x1) + layer(x2)  # the same weight twice
        y2 = layer(x3)  # a second micro-batch
    y1.backward(g1)  # its last node is the first call's: the backward update
    y2.backward(g2)
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    weight = te_amax(layer.weight)
    want_fwd = _after_one_update(
        [max(te_amax(x1), te_amax(x2), te_amax(x3)), weight, 0.0], 4, E4M3)
    assert fwd.amax_history.tolist() == want_fwd[0] and fwd.scale.tolist() == want_fwd[1]
    history, scales = _after_one_update([te_amax(g1), 0.0], 4, E5M2)
    history[0][0] = te_amax(g2)  # recorded after the update: waits
    assert bwd.amax_history.tolist() == history and bwd.scale.tolist() == scales
    with fp8_autocast(recipe=recipe):
        y4 = layer(x4)
    y4.backward(g4)
    history[0][0] = max(history[0][0], te_amax(g4))
    want_bwd = _te_update(history, scales, E5M2)
    assert bwd.amax_history.tolist() == want_bwd[0] and bwd.scale.tolist() == want_bwd[1]
    history = [row[:] for row in want_fwd[0]]
    history[0][:2] = [te_amax(x4), weight]
    want_fwd = _te_update(history, want_fwd[1], E4M3)
    assert fwd.amax_history.tolist() == want_fwd[0] and fwd.scale.tolist() == want_fwd[1]


def test_the_algorithm_is_the_last_one_entered_under_the_recipe_s_text():
    """TE names an amax buffer by the recipe's text (`get_unique_autocast_key`,
    quantization.py:714-727), which for DelayedScaling leaves out `amax_compute_algo`
    (common/recipe/__init__.py:272-282), and updates the buffer with the recipe that the last
    autocast entered under that text, enabled or not (`autocast_arguments`, l. 743-746, read at
    l. 675). So a layer switched from max to most_recent mid-run follows the switch (the
    emulation refused it), and the last region entered decides for every layer in the buffer
    (the emulation kept each layer's own)."""
    torch.manual_seed(14)
    by_max = FP8Recipe(amax_history_len=4)
    recent = FP8Recipe(amax_history_len=4, amax_compute_algo="most_recent")
    a, b = EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16)
    big, small, tiny = torch.randn(16, 16) * 20, torch.randn(16, 16) * 0.1, torch.randn(16, 16)
    with fp8_autocast(recipe=by_max):
        a(big), b(big)
    want = {layer: _after_one_update([te_amax(big), te_amax(layer.weight), 0.0], 4, E4M3)
            for layer in (a, b)}

    def step(inputs: dict, algo: str) -> None:
        for layer, x in inputs.items():
            history = [row[:] for row in want[layer][0]]
            history[0][:2] = [te_amax(x), te_amax(layer.weight)]
            want[layer] = _te_update(history, want[layer][1], E4M3, algo)
        for layer in (a, b):
            meta = layer.fp8_meta["scaling_fwd"]
            assert meta.amax_history.tolist() == want[layer][0]
            assert meta.scale.tolist() == want[layer][1]

    with fp8_autocast(recipe=by_max):
        b(small)
        with fp8_autocast(recipe=recent):
            a(small)
    step({a: small, b: small}, "most_recent")  # b too: `recent` was entered last
    with fp8_autocast(recipe=recent):
        with fp8_autocast(enabled=False, recipe=by_max):
            pass
        a(tiny)
    step({a: tiny}, "max")  # a disabled region's recipe counts as well


def test_a_recompute_outside_fp8_enters_no_recipe_of_its_own():
    """TE's checkpoint taken outside FP8 recomputes under `autocast(enabled=False, recipe=None)`
    (distributed.py:795), whatever recipe the disabled region around it had: the recompute
    enters TE's default, not that recipe, so it does not become its buffer's for the backward
    update that follows (`autocast_arguments`, quantization.py:743-746). The emulation's
    recompute entered the disabled region's `most_recent` and the first module's backward
    update then took row 0 for the history's max."""
    torch.manual_seed(15)
    by_max = FP8Recipe(amax_history_len=4)
    recent = FP8Recipe(amax_history_len=4, amax_compute_algo="most_recent")
    a, b = EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16)
    x = torch.randn(16, 16)
    with fp8_autocast(recipe=by_max):
        out = a(x)
    out.backward(torch.randn(16, 16) * 1000)  # a large gradient amax in a's history

    def block(h: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=8)):  # another buffer
            return b(h)

    with fp8_autocast(recipe=by_max):
        h = a(x)  # the first module
        with fp8_autocast(enabled=False, recipe=recent):
            y = fp8_checkpoint(block, h)
        with fp8_autocast(recipe=by_max):  # the last recipe entered under a's text
            pass
    y.backward(torch.randn(16, 16))  # the recompute, then a's backward and the update
    meta = a.fp8_meta["scaling_bwd"]
    column = meta.amax_history[:, 0].tolist()
    assert sorted(v > 0 for v in column) == [False, False, True, True]
    assert meta.scale[0].item() == te_scale(E5M2, max(column))  # by max, not the last row
    assert max(column) > column[-1]


def test_a_new_buffer_takes_the_last_recipe_entered_under_its_text():
    """TE records (recipe, group) under the recipe's text at every autocast entry, enabled or
    not (`autocast_arguments`, quantization.py:743-746), before any layer registers under it,
    and the update reads that record (l. 675). So a nested disabled region entered with
    `most_recent` decides the first update of a buffer its first layer creates afterwards in
    the outer `max` region. The emulation took the creating cast's recipe (`max`). The layer
    resumes a history (restored as `fp8_state` restores a checkpoint's) so the two differ."""
    torch.manual_seed(16)
    by_max = FP8Recipe(amax_history_len=5, margin=3)  # a text no other test enters
    recent = FP8Recipe(amax_history_len=5, margin=3, amax_compute_algo="most_recent")
    layer = EmulatedFP8Linear(16, 16)
    restored = [[0.0] * 3 for _ in range(4)] + [[50.0, 40.0, 30.0]]
    meta = layer.fp8_meta["scaling_fwd"]
    meta.amax_history = torch.tensor(restored)
    x = torch.randn(16, 16)
    with fp8_autocast(recipe=by_max):
        with fp8_autocast(enabled=False, recipe=recent):
            pass
        layer(x)
    history = [row[:] for row in restored]
    history[0][:2] = [te_amax(x), te_amax(layer.weight)]
    want = _te_update(history, [1.0] * 3, E4M3 * 2.0 ** -3, "most_recent")
    assert meta.amax_history.tolist() == want[0]
    assert meta.scale.tolist() == want[1]
    assert want[1][0] == te_scale(E4M3, te_amax(x), margin=3)  # row 0's amax, not 50
