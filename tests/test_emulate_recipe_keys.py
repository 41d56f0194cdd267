"""`FP8Recipe(...)` judges the options it was given, as `FP8Recipe.from_options` judges a YAML
mapping: an option of the other scaling mode, which the emulation and TE would ignore, is
refused with the same one line, naming the key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, active_recipe, fp8_autocast
from foundry_fp8.recipe import FP8Recipe, RecipeError, recipe_problems

DELAYED_ONLY = ("fix: remove {key}, or use scaling: delayed", "only applies to delayed scaling; "
                "current scaling keeps no amax history")
CURRENT_ONLY = ("fix: remove {key}, or use scaling: current", "only applies to current scaling")

OTHER_MODE: list[tuple[dict[str, Any], str, tuple[str, str]]] = [
    ({"use_power_2_scales": True}, "use_power_2_scales", CURRENT_ONLY),
    ({"scaling": "delayed", "use_power_2_scales": True, "margin": 1}, "use_power_2_scales",
     CURRENT_ONLY),
    ({"scaling": "current", "margin": 3}, "margin", DELAYED_ONLY),
    ({"scaling": "current", "amax_history_len": 4, "amax_compute_algo": "most_recent"},
     "amax_history_len", DELAYED_ONLY),
    ({"scaling": "current", "amax_compute_algo": "most_recent"}, "amax_compute_algo",
     DELAYED_ONLY),
    ({"scaling": "current", "reduce_amax": False}, "reduce_amax", DELAYED_ONLY),
]


@pytest.mark.parametrize(("options", "key", "says"), OTHER_MODE,
                         ids=[str(case[0]) for case in OTHER_MODE])
def test_an_option_of_the_other_scaling_mode_is_refused_as_from_yaml(options, key, says):
    """These were accepted and ignored: `use_power_2_scales=True` under delayed scaling gave
    scales that are no power of 2 and `as_config()` left the key out, and a layer first run
    under it refused a later `FP8Recipe()` over a key with no effect."""
    fix, message = says
    want = f"fp8_recipe.{key}: {message} ({fix.format(key=key)})"
    with pytest.raises(RecipeError) as from_python:
        FP8Recipe(**options)
    with pytest.raises(RecipeError) as from_yaml:
        FP8Recipe.from_options(options)
    assert str(from_python.value) == str(from_yaml.value) == want
    assert "\n" not in want


@pytest.mark.parametrize("options", [
    {}, {"scaling": "current", "use_power_2_scales": True}, {"margin": 2, "reduce_amax": False},
    {"scaling": "current", "fp8_format": "E4M3"},
    # the other mode's keys at their defaults: a constructor cannot tell them from left out
    {"scaling": "current", "margin": 0, "amax_history_len": 16},
    {"use_power_2_scales": False},
])
def test_the_options_of_the_recipes_own_mode_are_accepted(options):
    recipe = FP8Recipe(**options)
    assert FP8Recipe(**recipe.as_config()) == recipe


def test_a_value_of_the_wrong_type_is_refused_even_when_it_equals_the_default():
    for options, key in (({"amax_history_len": 16.0}, "amax_history_len"),
                         ({"scaling": "current", "margin": 0.0}, "margin"),
                         ({"scaling": "current", "use_power_2_scales": 0}, "use_power_2_scales")):
        with pytest.raises(RecipeError, match=f"^fp8_recipe.{key}: must be"):
            FP8Recipe(**options)


@pytest.mark.parametrize("key", ["fp8_dpa", "fp8_mha", "scaling_factor_compute_algo",
                                 "fp8_gemm_fprop"])
def test_a_te_option_we_do_not_model_is_named_as_tes_not_unknown(key):
    """TE 2.20's DelayedScaling/Float8CurrentScaling take these
    (transformer_engine/common/recipe/__init__.py:253-261, 302-312); "unknown recipe key" sent
    a user who copied a TE recipe looking for a typo."""
    with pytest.raises(RecipeError) as raised:
        FP8Recipe.from_options({key: True})
    message = str(raised.value)
    assert message.startswith(f"fp8_recipe.{key}: a TransformerEngine recipe option that "
                              "foundry-fp8 does not support")
    assert "\n" not in message and "use_power_2_scales" in message


def test_backward_override_as_a_key_points_to_te_s_variable():
    """TE's recipes take `backward_override` as a field whose default is NVTE_BACKWARD_OVERRIDE
    (common/recipe/__init__.py:312 at release_v2.19); te_swap builds TE's recipe without the
    key, so the variable is where it takes effect, and the emulation reads it too."""
    with pytest.raises(RecipeError) as raised:
        FP8Recipe.from_options({"scaling": "current", "backward_override": "high_precision"})
    assert str(raised.value) == (
        "fp8_recipe.backward_override: TransformerEngine takes it from NVTE_BACKWARD_OVERRIDE "
        "(te_swap builds TE's recipe without it, and the emulated backend reads the variable "
        "too) (fix: remove it and set NVTE_BACKWARD_OVERRIDE=high_precision|dequantized in the "
        "environment, with scaling: current)")


BLOCK_RECIPES = [("mxfp8", "MXFP8BlockScaling"), ("MXFP8BlockScaling", "MXFP8BlockScaling"),
                 ("block", "Float8BlockScaling"), ("nvfp4", "NVFP4BlockScaling"),
                 ("custom", "CustomRecipe")]


def _block_line(name: str) -> str:
    return (f"fp8_recipe.scaling: TransformerEngine's {name} is not supported: foundry-fp8 "
            "models per-tensor FP8 scaling only (TE's DelayedScaling and Float8CurrentScaling), "
            "and would not run another recipe in its place (fix: use scaling: delayed or "
            "scaling: current, or run TE's own recipe without te_swap)")


@pytest.mark.parametrize(("scaling", "name"), BLOCK_RECIPES)
def test_a_te_recipe_we_do_not_model_is_named_not_unknown(scaling, name):
    """TE 2.20's MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling and CustomRecipe
    (transformer_engine/common/recipe/__init__.py:337, 392, 489, 630) were refused as an
    "unknown scaling", which reads as a typo; the line now says foundry-fp8 does not run them."""
    for build in (lambda: FP8Recipe(scaling=scaling),
                  lambda: FP8Recipe.from_options({"scaling": scaling})):
        with pytest.raises(RecipeError) as raised:
            build()
        assert str(raised.value) == _block_line(name)


def _te_like(name: str) -> object:
    """An object of a class named as one of TE's recipe classes (TE is not installed here)."""
    return type(name, (), {"fp8_format": "E4M3", "margin": 0})()


@pytest.mark.parametrize(("name", "line"), [
    ("MXFP8BlockScaling", _block_line("MXFP8BlockScaling")),
    ("NVFP4BlockScaling", _block_line("NVFP4BlockScaling")),
    ("DelayedScaling", "fp8_recipe.scaling: fp8_autocast got a DelayedScaling, not an FP8Recipe: "
     "the emulation runs foundry_fp8's FP8Recipe only (fix: pass FP8Recipe(scaling='delayed' "
     "or 'current', ...) with the same options)"),
])
def test_emulated_autocast_refuses_a_te_recipe_object_with_one_line(name, line):
    """A TE recipe given to the emulation's autocast failed inside the layer's forward with
    `AttributeError: ... has no attribute 'scaling'`; now the autocast refuses it on entry,
    leaving the layer and the autocast state as they were."""
    layer = EmulatedFP8Linear(4, 4)
    with pytest.raises(RecipeError) as raised, fp8_autocast(recipe=_te_like(name)):
        layer(torch.randn(2, 4))
    assert str(raised.value) == line
    assert active_recipe() is None and layer.fp8_meta["scaling_fwd"].amax_history.numel() == 0
    with fp8_autocast(recipe=FP8Recipe()):  # the state is usable afterwards
        layer(torch.randn(2, 4))
    assert layer.fp8_meta["scaling_fwd"].amax_history.shape == (16, 3)


#: TE 2.20's defaults for the options it takes and foundry-fp8 does not model
#: (transformer_engine/common/recipe/__init__.py:257-260 DelayedScaling, 310-311
#: Float8CurrentScaling), written here from TE's source, not from recipe.py.
TE_DEFAULTS_WRITTEN_OUT: list[dict[str, Any]] = [
    {"fp8_dpa": False, "fp8_mha": False},
    {"scaling": "delayed", "fp8_dpa": False, "fp8_mha": False,
     "scaling_factor_compute_algo": None, "amax_history_len": 1024, "amax_compute_algo": "max"},
    {"scaling": "current", "fp8_dpa": False, "fp8_mha": False, "fp8_format": "E4M3"},
]


@pytest.mark.parametrize("options", TE_DEFAULTS_WRITTEN_OUT, ids=str)
def test_te_s_defaults_written_out_are_accepted_and_change_nothing(options):
    """A recipe copied from TE spells out `fp8_dpa: false`/`fp8_mha: false`: these are TE's
    defaults and change nothing, yet were refused with 'does not support'."""
    ours = {k: v for k, v in options.items() if k not in TE_ONLY}
    assert recipe_problems(options) == []
    assert FP8Recipe.from_options(options) == FP8Recipe(**ours)


TE_ONLY = ("fp8_dpa", "fp8_mha", "scaling_factor_compute_algo")


@pytest.mark.parametrize(("options", "key", "accepted"), [
    ({"fp8_dpa": True}, "fp8_dpa", " (TE's default, false, is accepted)"),
    ({"scaling": "current", "fp8_mha": True}, "fp8_mha", " (TE's default, false, is accepted)"),
    ({"fp8_dpa": 0}, "fp8_dpa", " (TE's default, false, is accepted)"),
    ({"scaling_factor_compute_algo": "max"}, "scaling_factor_compute_algo",
     " (TE's default, null, is accepted)"),
    # Float8CurrentScaling has no scaling_factor_compute_algo at all (TE: TypeError)
    ({"scaling": "current", "scaling_factor_compute_algo": None}, "scaling_factor_compute_algo",
     ""),
])
def test_te_options_away_from_te_s_default_are_still_refused_with_one_line(options, key, accepted):
    with pytest.raises(RecipeError) as raised:
        FP8Recipe.from_options(options)
    assert str(raised.value) == (
        f"fp8_recipe.{key}: a TransformerEngine recipe option that foundry-fp8 does not support "
        f"(it models TE's linear-layer FP8 casts and scales only) (fix: remove it{accepted}; the "
        "supported keys are: amax_compute_algo, amax_history_len, fp8_format, margin, "
        "reduce_amax, scaling, use_power_2_scales)")
    with pytest.raises(RecipeError, match="^fp8_recipe.amax_compute_algo: a callable makes "
                       "TransformerEngine update scales with its unfused Python path"):
        FP8Recipe(amax_compute_algo=max)  # TE's callable: quantization.py:687-691, not modelled


@pytest.mark.parametrize(("margin", "why"), [
    (-1, "a negative margin scales the amax above E4M3's max: the largest elements saturate"),
    (18, "a larger margin scales even the amax below E4M3's smallest subnormal: the tensor "
         "flushes to 0"),
])
def test_a_margin_out_of_bounds_is_explained_by_its_side(margin, why):
    """TE scales by `fp8_max * 2**-margin / amax` (common/recipe/delayed_scaling.cu:331, 239):
    margin -1 maps the amax to 896, which E4M3 (max 448) saturates; the old message spoke of a
    larger margin for it."""
    with pytest.raises(RecipeError) as raised:
        FP8Recipe(margin=margin)
    assert str(raised.value) == (f"fp8_recipe.margin: must be an integer from 0 to 17, got "
                                 f"{margin} ({why}) (fix: use 0 unless you see overflows)")
