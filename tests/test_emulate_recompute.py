"""`fp8_checkpoint`'s recompute updates the forward scales where TE's does. TE 2.20 recomputes
under its own autocast (`autocast(enabled=fp8, recipe=fp8_recipe)`, pytorch/distributed.py:
797-803), the outermost region during a plain backward, and an autocast leaving the last open
region with grad on runs `reduce_and_update_fp8_tensors(forward=True)` (pytorch/quantization.py:
772-782) for every registered layer. The recompute itself casts with the stashed scales and
restores the layer's state before that exit (module/base.py:1601-1603, 1649-1650), so the update
sees only amaxes recorded since the last one: normally none, but an FP8 forward under no_grad
between the training forward and the backward leaves its amaxes for it."""

from __future__ import annotations

import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.recipe import FP8Recipe
from tests.test_emulate_te import E4M3, te_amax, te_scale

RECIPE = FP8Recipe(amax_history_len=4)


def _input(amax: float) -> torch.Tensor:
    x = torch.ones(4, 16)
    x[0, 0] = amax
    return x.requires_grad_()


def _train_then_eval(layer: EmulatedFP8Linear) -> torch.Tensor:
    """A checkpointed training forward (input amax 2; its exit rolls 2 in), then an FP8 forward
    under no_grad (amax 100: recorded in row 0, no update); the training output."""
    with fp8_autocast(recipe=RECIPE):
        out = fp8_checkpoint(layer, _input(2.0))
    with torch.no_grad(), fp8_autocast(recipe=RECIPE):
        layer(_input(100.0))
    return out


def test_the_recompute_region_exit_updates_the_forward_scales_as_te():
    """TE by hand: the training forward's exit rolls 2 in (history [0, 0, 0, 2]); the no_grad
    forward records 100 in row 0; the recompute's exit rolls it in ([0, 0, 2, 100], scale
    448 / 100), so the next step casts its input with 448 / 100 and ends at [0, 2, 100, 3].
    The emulation recomputed one region deeper and updated nothing: it cast the next step with
    448 / 2 = 224 and ended at [0, 0, 2, 100]."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16)
    meta = layer.fp8_meta["scaling_fwd"]
    w_amax = te_amax(layer.weight)
    _train_then_eval(layer).sum().backward()
    assert meta.amax_history[:, 0].tolist() == [0.0, 0.0, 2.0, 100.0]
    assert meta.amax_history[:, 1].tolist() == [0.0, 0.0, w_amax, w_amax]
    assert meta.scale[0].item() == te_scale(E4M3, 100.0)  # in force at the next step
    with fp8_autocast(recipe=RECIPE):
        layer(_input(3.0)).sum().backward()
    assert meta.amax_history[:, 0].tolist() == [0.0, 2.0, 100.0, 3.0]
    assert meta.scale[0].item() == te_scale(E4M3, 100.0)


def test_a_recompute_inside_an_open_region_leaves_the_update_to_that_region():
    """A backward run inside an enabled autocast: TE's recompute autocast is then nested
    (autocast_depth > 0 at its exit) and updates nothing; the enclosing region's exit does."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16)
    meta = layer.fp8_meta["scaling_fwd"]
    out = _train_then_eval(layer)
    with fp8_autocast(recipe=RECIPE):
        out.sum().backward()
        assert meta.amax_history[:, 0].tolist() == [100.0, 0.0, 0.0, 2.0]
        assert meta.scale[0].item() == te_scale(E4M3, 2.0)
    assert meta.amax_history[:, 0].tolist() == [0.0, 0.0, 2.0, 100.0]
    assert meta.scale[0].item() == te_scale(E4M3, 100.0)


def test_a_recompute_of_a_checkpoint_taken_outside_fp8_updates_nothing():
    """Checkpointed outside FP8, TE recomputes under `autocast(enabled=False)`, whose exit does
    not update: the amaxes the no_grad forward recorded wait for the next region."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16)
    meta = layer.fp8_meta["scaling_fwd"]
    with fp8_autocast(recipe=RECIPE):
        layer(_input(2.0)).sum().backward()
    out = fp8_checkpoint(layer, _input(5.0))  # high precision: records nothing
    with torch.no_grad(), fp8_autocast(recipe=RECIPE):
        layer(_input(100.0))
    out.sum().backward()
    assert meta.amax_history[:, 0].tolist() == [100.0, 0.0, 0.0, 2.0]
    assert meta.scale[0].item() == te_scale(E4M3, 2.0)
