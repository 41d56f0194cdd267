"""Scales at float32's edge across a resume under another fp8_format/margin: TE clamps a scale
whose division overflows to float32 max (kernel_bulk, transformer_engine/common/recipe/
delayed_scaling.cu:238-249), so a saved float32 max is no `scaled_max / amax` a power-of-2
ratio can carry to the new recipe, and a carried product can overflow. Each expected scale is
TE's kernel formula computed here in numpy float32 from the amax, not by our code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.restore import check_module, recomputed_scales, te_scale
from tests.test_kill_resume import SAVE_EVERY
from tests.test_resume_recipe_change import E4M3, E5M2, HISTORY, _restored, _saved, _trainer

F32_MAX = float(np.finfo(np.float32).max)


def kernel_bulk(amax: float, fp8_max: float, margin: int, old_scale: float) -> float:
    """TE's delayed-scaling scale in float32 (delayed_scaling.cu:238-249, scaled_max at 331):
    `scaled_max / amax` for a finite positive amax, else the old scale; inf becomes float32
    max."""
    scaled_max = np.float32(fp8_max) * np.float32(2.0) ** np.float32(-margin)
    a = np.float32(amax)
    with np.errstate(over="ignore"):
        scale = scaled_max / a if np.isfinite(a) and a > 0 else np.float32(old_scale)
    return F32_MAX if np.isinf(scale) else float(scale)


def _module(recipe: FP8Recipe, fwd_amax: float, bwd_amax: float) -> dict[str, torch.Tensor]:
    """One GEMM's state as TE leaves it after updates from these amaxes under `recipe`: column
    0 of each direction holds the amax under test, the others 1."""
    out = {}
    for prefix, n, amax in (("fwd", 3, fwd_amax), ("bwd", 2, bwd_amax)):
        fp8_max = E4M3 if prefix == "fwd" or recipe.fp8_format == "E4M3" else E5M2
        amaxes = [amax] + [1.0] * (n - 1)
        history = torch.zeros(HISTORY, n)
        history[1:] = torch.tensor(amaxes)
        out[f"{prefix}_amax_history"] = history
        out[f"{prefix}_scale"] = torch.tensor(
            [kernel_bulk(a, fp8_max, recipe.margin, 1.0) for a in amaxes])
    return out


@pytest.mark.parametrize("saved, run, fwd_amax, bwd_amax", [
    # E4M3's bwd scale for 1e-36 is TE's clamp; x128 under HYBRID was inf (old code)
    (FP8Recipe(fp8_format="E4M3"), FP8Recipe(), 2.0, 1e-36),
    # margin 2 -> 0: x4 of a clamped scale was inf, fwd and bwd
    (FP8Recipe(margin=2), FP8Recipe(), 1e-36, 1e-40),
    # HYBRID -> E4M3: a clamped E5M2 scale /128 was 2.66e36, TE's formula gives float32 max
    (FP8Recipe(), FP8Recipe(fp8_format="E4M3"), 2.0, 1e-40),
    # a scale near the edge, not clamped, carried past it: TE clamps the quotient
    (FP8Recipe(fp8_format="E4M3"), FP8Recipe(), 2.0, 1e-35),
    # under another algo too (the history recomputes it)
    (FP8Recipe(fp8_format="E4M3", amax_compute_algo="most_recent"), FP8Recipe(), 2.0, 1e-36),
])
def test_a_scale_at_float32_max_is_tes_scale_under_the_new_recipe(saved, run, fwd_amax,
                                                                  bwd_amax):
    checked, problems = check_module("m", _module(saved, fwd_amax, bwd_amax), saved, HISTORY)
    assert problems == [] and checked is not None
    out = recomputed_scales(checked, saved, run)
    for prefix, amax in (("fwd", fwd_amax), ("bwd", bwd_amax)):
        fp8_max = E4M3 if prefix == "fwd" or run.fp8_format == "E4M3" else E5M2
        assert out[f"{prefix}_scale"][0].item() == kernel_bulk(amax, fp8_max, run.margin, 1.0), (
            prefix, out[f"{prefix}_scale"][0].item())
        # the other columns (amax 1) are still the plain quotient
        assert out[f"{prefix}_scale"][1].item() == kernel_bulk(1.0, fp8_max, run.margin, 1.0)


@pytest.mark.parametrize("amax", [1e-40, 1e-37, 3.0])
def test_te_scale_applies_the_margin_before_the_clamp(amax):
    """margin 2, amax 1e-40: TE's 112/1e-40 overflows to float32 max; clamping 448/amax first
    and then taking 2**-2 of it gave 8.5e37."""
    recipe = FP8Recipe(margin=2)
    got = te_scale(torch.tensor([amax]), recipe, "forward", torch.ones(1)).item()
    assert got == kernel_bulk(amax, E4M3, 2, 1.0)


@pytest.mark.parametrize("saved_recipe, run_recipe, amax", [
    ({"fp8_format": "E4M3"}, {}, 1e-36),  # restored inf before
    ({}, {"fp8_format": "E4M3"}, 1e-40),  # restored 2.66e36 before
])
def test_a_real_resume_restores_tes_scale_for_a_clamped_one(tmp_path, saved_recipe, run_recipe,
                                                            amax):
    """A Composer checkpoint whose backward scale TE clamped (a gradient amax of `amax`
    planted in its window, the scale float32 max beside it), resumed under the other format:
    the scale restored before the first step is TE's formula's under the new format."""
    _trainer(tmp_path, f"{SAVE_EVERY}ba", saved_recipe).fit()
    checkpoint = tmp_path / "checkpoints" / f"ep0-ba{SAVE_EVERY}-rank0.pt"
    entry = torch.load(checkpoint, map_location="cpu", weights_only=False)
    module = entry["state"]["callbacks"]["FP8State"]["modules"]["module.blocks.0"]
    module["bwd_amax_history"][1:, 0] = 0.0
    module["bwd_amax_history"][-1, 0] = amax
    module["bwd_scale"][0] = F32_MAX
    planted = Path(tmp_path / "planted.pt")
    torch.save(entry, planted)
    assert _saved(planted)["module.blocks.0"]["bwd_scale"][0].item() == F32_MAX
    run_format = run_recipe.get("fp8_format", "HYBRID")
    resumed = _trainer(tmp_path / "resumed", f"{SAVE_EVERY + 1}ba", run_recipe, strict=False,
                       load_path=str(planted))
    restored = _restored(resumed)["module.blocks.0"]["bwd_scale"][0].item()
    assert restored == kernel_bulk(amax, E4M3 if run_format == "E4M3" else E5M2, 0, 1.0)
    resumed.fit()
    assert torch.isfinite(_restored(resumed)["module.blocks.0"]["bwd_scale"]).all()
