"""A refused recipe's one line gives the true reason: a margin's bound or type, and TE's
Float8CurrentScaling class attributes named as such. The reference for what TE takes is a
pydantic dataclass declared as TE's recipes are (`margin: int`; unannotated QParams class
attributes: transformer_engine/common/recipe/__init__.py:12, 253, 304-306 at d0067d0), with
pydantic's defaults as TE takes them."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from foundry_fp8.recipe import (
    REMOVED_TE_KEYS,
    TE_CURRENT_SCALING_QPARAMS,
    FP8Recipe,
    RecipeError,
)

E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class _QParams:
    power_2_scale: bool = False


@pydantic_dataclass
class _TEDelayed:
    """TE's DelayedScaling's margin field, as TE declares it."""

    margin: int = 0


@pydantic_dataclass
class _TECurrent:
    """TE's Float8CurrentScaling's QParams, as TE declares them (no annotation)."""

    use_power_2_scales: bool = False
    fp8_quant_fwd_inp = _QParams()
    fp8_quant_fwd_weight = _QParams()
    fp8_quant_bwd_grad = _QParams()


def _margin_line(margin: Any) -> str:
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options({"margin": margin})
    message = str(error.value)
    assert message.startswith("fp8_recipe.margin: must be an integer") and "\n" not in message
    return message


def _e4m3(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).to(E4M3).float().item()


def test_an_integral_float_out_of_range_gets_the_bound_not_write_n():
    """`margin: 100.0` was told "a float: write 100", then 100 was refused too."""
    amax = 448.0  # E4M3's max: scaled by 2**-margin, as TE's scale does
    flushed = _margin_line(100.0)
    assert _e4m3(amax * 2.0**-100) == 0.0  # the reference: even the amax flushes
    assert "write 100" not in flushed and "flushes to 0" in flushed
    saturated = _margin_line(-1.0)
    assert amax * 2.0**1 > torch.finfo(E4M3).max  # the reference: the amax exceeds E4M3's max
    assert "write -1" not in saturated and "saturate" in saturated


def test_an_integral_float_in_range_is_told_the_integer_te_would_read():
    assert _TEDelayed(margin=2.0).margin == 2  # TE's recipe reads 2.0 as 2
    assert "(a float: write 2)" in _margin_line(2.0)


@pytest.mark.parametrize("margin", [math.nan, math.inf, -math.inf, 2.5])
def test_a_margin_te_refuses_is_not_said_to_be_taken_by_te(margin):
    with pytest.raises(ValidationError):
        _TEDelayed(margin=margin)
    message = _margin_line(margin)
    assert "would take" not in message
    if math.isfinite(margin):
        assert "which pydantic 2 refuses and pydantic 1 truncates to 2" in message
    else:
        assert f"got {margin!r} (not a finite number)" in message


@pytest.mark.parametrize("value", [np.int64(2), np.int32(2), np.uint8(2)])
def test_a_numpy_integer_is_the_integer_it_is(value):
    """TE's recipe reads a numpy integer as the int; so does FP8Recipe, as a plain int (a
    numpy one in `as_config()` broke `json.dumps` of a run's config)."""
    assert _TEDelayed(margin=value).margin == 2
    recipe = FP8Recipe.from_options({"margin": value, "amax_history_len": value})
    assert recipe == FP8Recipe(margin=2, amax_history_len=2)
    config = json.loads(json.dumps(recipe.as_config()))
    assert config["margin"] == 2 and config["amax_history_len"] == 2
    assert type(recipe.margin) is int and type(recipe.amax_history_len) is int


def test_a_numpy_integer_of_the_other_mode_is_still_refused():
    with pytest.raises(RecipeError, match=r"^fp8_recipe\.margin: only applies to delayed"):
        FP8Recipe(scaling="current", margin=np.int64(0))


@pytest.mark.parametrize(("margin", "why"), [
    ("2", "a str, not a number"), (True, "a bool, not a number"), ([2], "a list, not a number"),
    (None, "null, not a number"),
])
def test_a_margin_of_another_type_is_named_with_its_type(margin, why):
    assert f"got {margin!r} ({why})" in _margin_line(margin)


@pytest.mark.parametrize("key", TE_CURRENT_SCALING_QPARAMS)
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_te_s_qparams_class_attributes_are_named_not_unknown(key, scaling):
    """Copied from a TE recipe's repr, they were refused as an "unknown recipe key"."""
    assert key not in {f.name for f in dataclasses.fields(_TECurrent)}
    ignored = _TECurrent(**{key: _QParams(power_2_scale=True)})  # TE drops the keyword
    assert getattr(ignored, key).power_2_scale is False
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options({"scaling": scaling, key: {}})
    assert str(error.value) == (
        f"fp8_recipe.{key}: a class attribute of TransformerEngine's Float8CurrentScaling, not "
        "an option a recipe can set (TE's constructor ignores it, as its pydantic recipes do "
        "every unknown keyword) (fix: remove it; for "
        "power-of-2 scales write use_power_2_scales: true with scaling: current)")


def test_interval_is_said_to_be_ignored_by_te_not_refused():
    """TE 2.2 removed the `interval` field (common/recipe/__init__.py:136 at v2.1, absent at
    v2.2); its pydantic recipe then drops the keyword without a word."""

    @pydantic_dataclass
    class _TEDelayed22:
        margin: int = 0

    assert not hasattr(_TEDelayed22(interval=1), "interval")
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options({"interval": 1})
    message = str(error.value)
    assert message.startswith("fp8_recipe.interval: ") and "\n" not in message
    assert "refuses" not in message and "silently from 2.2" in message


@pytest.mark.parametrize("key", sorted(REMOVED_TE_KEYS))
def test_a_removed_te_key_is_said_to_be_unused_not_refused(key):
    """TE's current recipes take either key without a word (no such field: `interval` left at
    v2.2, `override_linear_precision` at v2.0, common/recipe/__init__.py:136/140 at v1.13), so
    the line said 'no longer accepts' beside a fix saying TE ignores it."""

    @pydantic_dataclass
    class _TEDelayedNow:
        margin: int = 0

    assert not hasattr(_TEDelayedNow(**{key: 1}), key)
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options({key: 1})
    assert str(error.value).startswith(
        f"fp8_recipe.{key}: TransformerEngine no longer uses this key (fix: remove it")
