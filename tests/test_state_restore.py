"""fp8_state's restore: poisoned, malformed or mismatched FP8 state in a checkpoint is refused in
one line naming module and field (`strict`), or repaired by TE's rules (`strict: false`); a
restore never leaves state that trains into NaN or into scales near zero, and what TE itself
writes (an inf amax after an overflowing step) restores as it was."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import pickle
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from composer import Trainer
from composer.core import Callback, Precision, State
from composer.loggers import Logger
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.state import FP8State, FP8StateError, fp8_state_from_checkpoint
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fault import InjectOutlier, find_layer
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.numerics import FP8_MAX
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.restore import FIELDS, combine_ranks
from foundry_fp8.te.extra_state import holds_te_scaling_state
from tests.test_kill_resume import BATCHES, SAVE_EVERY, _assert_same_run

HISTORY = 4
RECIPE = FP8Recipe(amax_history_len=HISTORY)
LOGGER = "foundry_fp8.composer.state"


class TwoBlocks(nn.Module):
    """Two linear blocks, named as te_swap converts them (`blocks.N`), for real Trainers."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))


def _step(model: nn.Module, recipe: FP8Recipe = RECIPE, seed: int = 1) -> torch.Tensor:
    """One forward and backward under FP8 (scales update as in TE); the output."""
    with fp8_autocast(recipe=recipe):
        out = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)))
    out.sum().backward()
    return out.detach()


def _saved(recipe: FP8Recipe = RECIPE, steps: int = 3) -> dict:
    """What fp8_state saves for `_layers()` trained `steps` steps under `recipe`."""
    model = _layers()
    for seed in range(steps):
        _step(model, recipe, seed)
    saver = _callback(model, recipe)
    return saver.state_dict()


def _callback(model: nn.Module, recipe: FP8Recipe | None = RECIPE, strict: bool = True,
              precision: Precision | None = None) -> FP8State:
    """An fp8_state that went through INIT of a run with te_swap's emulated `recipe`, under
    `precision`; by default amp_fp8, where TE modules (the stand-ins some tests add) run in FP8,
    and without a recipe fp32, where none is known (amp_fp8 has Composer's default)."""
    callback = FP8State(strict=strict)
    algorithms = [] if recipe is None else [
        TESwap(backend="emulate", fp8_recipe={k: v for k, v in recipe.as_config().items()})]
    if precision is None:
        precision = Precision.FP32 if recipe is None else Precision.AMP_FP8
    state = SimpleNamespace(model=model, precision=precision, precision_config=None,
                            algorithms=algorithms, fsdp_config=None, fsdp_config_version=0)
    callback._init(state)
    return callback


def _valid(tensors: dict[str, torch.Tensor], recipe: FP8Recipe = RECIPE) -> bool:
    """TE-valid state: finite positive scales, non-negative amaxes (inf, which TE records, but
    no NaN, which it skips), no finite amax larger than the scale allows."""
    for direction in ("fwd", "bwd"):
        scale, history = tensors[f"{direction}_scale"], tensors[f"{direction}_amax_history"]
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            return False
        if not (history >= 0).all():  # NaN fails too
            return False
        fp8_max = FP8_MAX[recipe.format_for("forward" if direction == "fwd" else "backward")]
        amax = history[1:].amax(0) if history.shape[0] > 1 else torch.zeros_like(scale)
        if (torch.isfinite(amax) & (amax * scale > fp8_max * 1.001)).any():
            return False
    return True


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and text.startswith("fp8_state: ")
    return text


# -- poisoned values ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf])
def test_a_bad_scale_is_refused_naming_module_and_field(value):
    saved = _saved()
    saved["modules"]["1"]["bwd_scale"][1] = value
    model = _layers()
    before = {n: read_fp8_meta(m) for n, m in model.named_children()}
    with pytest.raises(FP8StateError) as error:
        _callback(model).load_state_dict(saved)
    assert "1.bwd_scale:" in _one_line(error.value) and "strict: false" in str(error.value)
    after = {n: read_fp8_meta(m) for n, m in model.named_children()}
    assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])


@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf])
def test_a_bad_scale_starts_its_column_fresh_when_not_strict(value, caplog):
    """Only the column whose scale is bad starts fresh (scale 1, no amax): the module's other
    columns and modules keep their saved state, and the next steps train finitely."""
    saved = _saved()
    column = 0  # the input's slot, which records amaxes
    assert saved["modules"]["1"]["fwd_amax_history"][1:, column].any()
    saved["modules"]["1"]["fwd_scale"][column] = value
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(saved)
    assert "repaired by TE's rules: 1.fwd_scale:" in caplog.text
    restored, kept = read_fp8_meta(model[1]), saved["modules"]["1"]
    assert _valid(restored)
    assert restored["fwd_scale"][column].item() == 1.0
    assert not restored["fwd_amax_history"][:, column].any()
    others = [i for i in range(3) if i != column]
    assert torch.equal(restored["fwd_scale"][others], kept["fwd_scale"][others])
    assert torch.equal(restored["fwd_amax_history"][1:, others], kept["fwd_amax_history"][1:, others])
    assert torch.equal(read_fp8_meta(model[0])["fwd_scale"], saved["modules"]["0"]["fwd_scale"])
    assert torch.isfinite(_step(model)).all()


def test_a_bad_scale_beside_a_planted_amax_does_not_flush_the_tensor():
    """No scale, so nothing checks the history: recomputing the scale from it, as the repair
    did, gave 448 / 1e30 = 4.5e-28 and flushed the layer's inputs to zero in FP8 for
    `amax_history_len` steps (found by the never-poison property below)."""
    saved = _saved()
    saved["modules"]["0"]["fwd_scale"][0] = 0.0
    saved["modules"]["0"]["fwd_amax_history"][2, 0] = 1e30
    model = _layers()
    _callback(model, strict=False).load_state_dict(saved)
    for seed in range(HISTORY):
        _step(model, seed=seed)
        assert read_fp8_meta(model[0])["fwd_scale"][0] > 1.0, seed


def test_a_repaired_scale_without_an_amax_is_te_initial_1_under_a_margin():
    """A fresh column's scale is TE's initial 1 under any margin (TE keeps the old scale for
    amax 0, delayed_scaling.cu:238-242, and starts at 1); it was 2**-margin, the margin applied
    to 1."""
    recipe = FP8Recipe(amax_history_len=HISTORY, margin=1)
    saved = _saved(recipe)
    assert not saved["modules"]["1"]["bwd_amax_history"][:, 1].any()  # slot 1 records nothing
    saved["modules"]["1"]["bwd_scale"][1] = math.nan
    model = _layers()
    _callback(model, recipe, strict=False).load_state_dict(saved)
    assert read_fp8_meta(model[1])["bwd_scale"][1].item() == 1.0


def test_an_absurd_amax_is_refused_and_would_have_flushed_the_layer_to_zero(caplog):
    """The issue's case: an amax of 1e30 planted in a history. Restored as it is (the old
    behaviour, `write_fp8_meta` directly), the next update sets the scale to 448 / 1e30 and
    every input of the layer flushes to zero in FP8."""
    saved = _saved()
    saved["modules"]["0"]["fwd_amax_history"][2, 0] = 1e30
    poisoned = _layers()
    from foundry_fp8.fp8_meta import write_fp8_meta

    write_fp8_meta(poisoned[0], saved["modules"]["0"])
    _step(poisoned)
    assert read_fp8_meta(poisoned[0])["fwd_scale"][0] < 1e-27
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert "0.fwd_amax_history: amax 1e+30 is more than scale" in _one_line(error.value)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(saved)
    restored = read_fp8_meta(model[0])
    assert _valid(restored) and restored["fwd_amax_history"].max() < 1e3
    _step(model)
    assert read_fp8_meta(model[0])["fwd_scale"][:2].min() > 1.0  # slot 2 records nothing


def test_an_inf_amax_restores_as_saved_and_te_keeps_the_scale_through_it():
    """TE's amax keeps inf (fmaxf), so a step that overflowed leaves inf in the history and
    TE's update keeps the scale while it is in the window: state TE writes, restored as saved
    (it was refused, and a checkpoint after one skipped Inf step could not be resumed)."""
    saved = _saved()
    saved["modules"]["0"]["fwd_amax_history"][2, 0] = math.inf
    model = _layers()
    _callback(model).load_state_dict(saved)
    restored = read_fp8_meta(model[0])
    assert restored["fwd_amax_history"][2, 0] == math.inf and _valid(restored)
    assert torch.equal(restored["fwd_scale"], saved["modules"]["0"]["fwd_scale"])
    _step(model)  # the inf is still in the window: TE keeps the input's scale
    assert read_fp8_meta(model[0])["fwd_scale"][0] == saved["modules"]["0"]["fwd_scale"][0]


def test_a_nan_amax_restores_as_nothing_recorded():
    """TE's amax skips NaN and its update's max skips a NaN row: a NaN (an earlier emulation
    recorded some) is 0 to the update, so it restores as 0, without a problem."""
    saved = _saved()
    saved["modules"]["0"]["fwd_amax_history"][1, 0] = math.nan
    model = _layers()
    _callback(model).load_state_dict(saved)
    restored = read_fp8_meta(model[0])
    assert restored["fwd_amax_history"][1, 0] == 0 and _valid(restored)


@pytest.mark.parametrize("value", [-1.5, -math.inf])
def test_an_amax_te_never_records_is_refused_or_dropped(value, caplog):
    """TE's amax is never negative: such an entry is not TE's state."""
    saved = _saved()
    saved["modules"]["0"]["fwd_amax_history"][1, 0] = value
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert f"0.fwd_amax_history: {value} is not an amax TE records" in _one_line(error.value)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(saved)
    restored = read_fp8_meta(model[0])
    assert restored["fwd_amax_history"][1, 0] == 0 and _valid(restored)


def test_a_state_saved_before_recipes_were_recorded_restores():
    saved = _saved()
    del saved["recipe"]
    model = _layers()
    _callback(model).load_state_dict(saved)
    assert torch.equal(read_fp8_meta(model[0])["fwd_scale"], saved["modules"]["0"]["fwd_scale"])


@pytest.mark.parametrize(("payload", "match"), [
    ({"modules": {"0": {"fwd_scale": [1.0, 1.0, 1.0]}}}, r"modules\.0\.fwd_scale: expected a tensor"),
    ({"modules": [1, 2]}, "modules: expected a mapping"),
    ({"modules": {}, "extra": 1}, "unknown key 'extra'"),
    ({"modules": {}, "recipe": {"amax_history_len": object()}}, "recipe: expected a mapping of"),
])
def test_a_payload_that_is_not_ours_is_refused_in_one_line(payload, match, caplog):
    with pytest.raises(FP8StateError, match=match) as error:
        _callback(_layers()).load_state_dict(payload)
    _one_line(error.value)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(payload)
    assert "started fresh" in caplog.text and read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0


@pytest.mark.parametrize("tensor", [torch.ones(3).to_sparse(), torch.empty(3, device="meta")])
def test_a_tensor_without_values_is_refused_in_one_line_not_by_torch(tensor, caplog):
    """A sparse or meta scale: torch's own ops raised NotImplementedError / RuntimeError out of
    the load, a multi-line traceback that stopped the run even with `strict: false`."""
    saved = _saved()
    saved["modules"]["0"]["fwd_scale"] = tensor
    with pytest.raises(FP8StateError, match=r"modules\.0\.fwd_scale: expected a dense tensor "
                                            r"of values, got a (sparse_coo|strided) tensor on "
                                            r"(cpu|meta)") as error:
        _callback(_layers()).load_state_dict(saved)
    _one_line(error.value)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(saved)
    assert "started fresh" in caplog.text and read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0


@pytest.mark.parametrize(("field", "cut", "expected"), [
    ("fwd_amax_history", lambda t: t[:, :2], "0.fwd_amax_history: shape (4, 2), expected [rows, 3] "
                                             "as the scale"),
    ("fwd_scale", lambda t: t[:2], "0.fwd_scale: 2 values, expected 3 per GEMM"),
    ("bwd_scale", lambda t: None, "0.bwd_scale: missing"),
])
def test_a_malformed_field_is_named_as_itself_and_its_module_said_fresh(field, cut, expected,
                                                                         caplog):
    """A truncated history was reported as `0.fwd_scale: amax_history: ...` (the field picked by
    the word `scale` in the message), and the repair warning did not say the module started
    fresh."""
    saved = _saved()
    saved["modules"]["0"][field] = cut(saved["modules"]["0"][field])
    if saved["modules"]["0"][field] is None:
        del saved["modules"]["0"][field]
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert f"refused: {expected} (set" in _one_line(error.value)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(saved)
    assert _ours(caplog) == [f"fp8_state: checkpoint FP8 state repaired by TE's rules: {expected} "
                             "(beyond repair, started fresh: 0)"]
    assert read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0
    assert torch.equal(read_fp8_meta(model[1])["fwd_scale"], saved["modules"]["1"]["fwd_scale"])


# -- the property: valid state or one line, never poison -----------------------------------------

_VALUES = st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 1e-30, 0.5, 3.0])


@st.composite
def _payloads(draw) -> dict:
    """A real saved state, then: modules dropped, added, renamed; fields dropped, added,
    reshaped; values poisoned."""
    saved = _saved()
    modules = saved["modules"]
    for name in list(modules):
        if draw(st.booleans()) and draw(st.booleans()):
            del modules[name]
    if draw(st.booleans()) and draw(st.booleans()):
        modules["2"] = {k: v.clone() for k, v in next(iter(_saved()["modules"].values())).items()}
    for tensors in modules.values():
        for field in FIELDS:
            action = draw(st.sampled_from(["keep"] * 6 + ["poison", "poison", "drop", "shape"]))
            if action == "drop":
                del tensors[field]
            elif action == "shape":
                rows = draw(st.integers(0, 6))
                tensors[field] = torch.rand(rows, draw(st.integers(1, 4))) if \
                    field.endswith("history") else torch.rand(draw(st.integers(0, 7)))
            elif action == "poison":
                flat = tensors[field].view(-1)
                if flat.numel():
                    flat[draw(st.integers(0, flat.numel() - 1))] = draw(_VALUES)
        if draw(st.booleans()) and draw(st.booleans()):
            tensors["fwd_scale_inv"] = torch.ones(3)
        if draw(st.integers(0, 9)) == 0:
            tensors[draw(st.sampled_from(FIELDS))] = torch.tensor(1.0)  # 0-d
    return saved


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_payloads(), strict=st.booleans(),
       recipe=st.sampled_from([RECIPE, FP8Recipe(scaling="current"), None]))
def test_restore_gives_valid_state_or_one_line_never_poison(payload, strict, recipe):
    """Under the checkpoint's recipe, a current-scaling one, and none known (a model with FP8
    layers of its own, no te_swap)."""
    model = _layers()
    before = {n: read_fp8_meta(m) for n, m in model.named_children()}
    try:
        _callback(model, recipe, strict=strict).load_state_dict(payload)
    except FP8StateError as error:
        assert strict
        _one_line(error)
        after = {n: read_fp8_meta(m) for n, m in model.named_children()}
        assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
        return
    for name, module in model.named_children():
        state = read_fp8_meta(module)
        if state["fwd_amax_history"].numel():
            assert _valid(state), (name, state)
    for seed in range(2):
        assert torch.isfinite(_step(model, recipe or RECIPE, seed=seed)).all()
    for module in model:
        state = read_fp8_meta(module)
        assert _valid(state)
        assert state["fwd_scale"][:2].min() > 1e-3  # not flushed to zero by a planted amax


# -- a recipe change on resume --------------------------------------------------------------------


def test_a_shorter_history_is_refused_as_a_recipe_change():
    """The refusal says what `strict: false` would do, not as if it had been done."""
    saved = _saved(FP8Recipe(amax_history_len=16))
    with pytest.raises(FP8StateError) as error:
        _callback(_layers(), FP8Recipe(amax_history_len=4)).load_state_dict(saved)
    assert _one_line(error.value) == (
        "fp8_state: checkpoint FP8 state does not fit (recipe changed?): amax_history_len "
        "16 -> 4 (set fp8_state: {strict: false} to continue with the saved state, histories "
        "fitted to the new length as TE does, scales recomputed under this recipe at the next "
        "update)")


def test_a_shorter_history_is_fitted_as_te_does_when_not_strict(caplog):
    saved = _saved(FP8Recipe(amax_history_len=16), steps=6)
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, FP8Recipe(amax_history_len=4), strict=False).load_state_dict(saved)
    assert "amax_history_len 16 -> 4; continuing with the saved state, histories fitted" in \
        caplog.text
    restored = read_fp8_meta(model[0])
    assert torch.equal(restored["fwd_amax_history"], saved["modules"]["0"]["fwd_amax_history"][:4])
    assert torch.equal(restored["fwd_scale"], saved["modules"]["0"]["fwd_scale"])


@pytest.mark.parametrize(("saved_len", "run_len"), [(16, 4), (4, 8)])
def test_a_changed_history_length_is_one_warning_not_a_repair_of_every_module(
        saved_len, run_len, caplog):
    """`strict: false`: the recipe change is the one line; a second warning called the fitted
    histories "repaired by TE's rules: ... rows do not fit the recipe's N" for every module."""
    saved = _saved(FP8Recipe(amax_history_len=saved_len), steps=saved_len + 2)  # rows filled
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, FP8Recipe(amax_history_len=run_len), strict=False).load_state_dict(saved)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"fp8_state: checkpoint FP8 state does not fit (recipe changed?): amax_history_len "
        f"{saved_len} -> {run_len}; continuing with the saved state, histories fitted to the new "
        "length as TE does, scales recomputed under this recipe at the next update"]
    kept = min(saved_len, run_len)
    for name, module in model.named_children():
        restored = read_fp8_meta(module)
        for key in ("fwd_amax_history", "bwd_amax_history"):
            # TE's adjust_amax_history_length (pytorch/module/base.py): the first rows kept,
            # zero rows appended; row 0, no update's yet, is not restored
            want = saved["modules"][name][key]
            expected = torch.zeros(run_len, want.shape[1])
            expected[1:kept] = want[1:kept]
            assert want[1:kept].abs().sum() > 0 and torch.equal(restored[key], expected)
        assert torch.equal(restored["fwd_scale"], saved["modules"][name]["fwd_scale"])


@pytest.mark.parametrize("strict", [True, False])
def test_delayed_to_current_scaling_keeps_no_dead_state(strict, caplog):
    saved = _saved()
    model = _layers()
    callback = _callback(model, FP8Recipe(scaling="current"), strict=strict)
    line = ("fp8_state: checkpoint FP8 state does not fit (recipe changed?): scaling delayed -> "
            "current, which keeps no amax histories")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if strict:
            with pytest.raises(FP8StateError) as error:
                callback.load_state_dict(saved)
            assert _one_line(error.value) == (f"{line} (set fp8_state: {{strict: false}} to "
                                              "continue with nothing restored)")
        else:
            callback.load_state_dict(saved)
            assert _ours(caplog) == [f"{line}; continuing with nothing restored"]
    saved.pop("recipe")  # saved before recipes were recorded: the histories named
    with pytest.raises(FP8StateError, match=r"it holds delayed-scaling amax histories \(0, "
                                            r"\.\.\.\), this run's recipe keeps none"):
        _callback(_layers(), FP8Recipe(scaling="current")).load_state_dict(saved)
    assert read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0  # nothing restored


def test_current_to_delayed_scaling_starts_fresh():
    saved = _saved(FP8Recipe(scaling="current"))
    assert saved["recipe"]["scaling"] == "current"
    with pytest.raises(FP8StateError, match=r"scaling current -> delayed.*started fresh"):
        _callback(_layers()).load_state_dict(saved)
    model = _layers()
    _callback(model, strict=False).load_state_dict(saved)
    assert read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0


def test_other_recipe_changes_are_named():
    saved = _saved(FP8Recipe(amax_history_len=HISTORY, margin=1))
    with pytest.raises(FP8StateError, match=r"recipe changed\?\): margin 1 -> 0") as error:
        _callback(_layers()).load_state_dict(saved)
    assert "fitted" not in str(error.value)  # same length: no history is fitted


def test_a_scaling_change_names_the_scaling_not_every_key_of_either():
    """current -> delayed listed six keys, `amax_history_len - -> 4` and the like, that belong
    to one scaling only."""
    saved = _saved(FP8Recipe(scaling="current"))
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert _one_line(error.value) == ("fp8_state: checkpoint FP8 state does not fit (recipe "
                                      "changed?): scaling current -> delayed (set fp8_state: "
                                      "{strict: false} to continue with FP8 scaling started fresh)")


def test_ranks_of_other_shapes_are_named_not_silently_dropped(caplog):
    """Per-rank state from 2 ranks into this 1-rank run, rank 1's history cut to 2 rows: it was
    left out of the combination without a word, even with `strict`."""
    saved = _saved()
    other = {n: {f: v.clone() for f, v in t.items()} for n, t in saved["modules"].items()}
    other["1"]["bwd_amax_history"] = other["1"]["bwd_amax_history"][:2]
    saved["ranks"] = [saved["modules"], other]
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert ("refused: ranks[1].1.bwd_amax_history: shape (2, 2), ranks[0] saved (4, 2) (left "
            "out) (set") in _one_line(error.value)
    model = _layers()
    _callback(model, strict=False).load_state_dict(saved)
    assert torch.equal(read_fp8_meta(model[1])["bwd_amax_history"][1:],
                       saved["modules"]["1"]["bwd_amax_history"][1:])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
def test_a_rank_of_another_dtype_is_named_not_combined_or_raised_by_torch(dtype, caplog):
    """Rank 1's state in complex: torch's minimum raised out of the load (even with `strict:
    false`); in bool it was combined silently (min(scale, True) = 1)."""
    saved = _saved()
    saved["ranks"] = [saved["modules"], {n: {f: v.to(dtype) for f, v in t.items()}
                                         for n, t in saved["modules"].items()}]
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert (f"refused: ranks[1].0.fwd_scale: a {dtype} tensor, expected a floating one (left "
            "out)") in _one_line(error.value)
    model = _layers()
    _callback(model, strict=False).load_state_dict(saved)
    for name, tensors in saved["modules"].items():  # rank 0's, the only floating one
        for field, value in tensors.items():
            restored = read_fp8_meta(model[int(name)])[field]
            assert torch.equal(restored[1:] if "history" in field else restored,
                               value[1:] if "history" in field else value), (name, field)


def test_a_field_not_floating_is_said_the_same_way_in_a_module_and_in_a_rank():
    """A module's int64 scale read `a 1-d torch.int64 tensor, expected a 1-d floating one`, a
    rank's `a torch.int64 tensor, expected a floating one`: one fact, two wordings."""
    saved = _saved()
    saved["modules"]["0"]["fwd_scale"] = saved["modules"]["0"]["fwd_scale"].long()
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(saved)
    assert ("refused: 0.fwd_scale: a torch.int64 tensor, expected a floating one (set"
            in _one_line(error.value))


def test_a_float8_rank_is_combined_in_float32_not_raised_by_torch():
    """Rank 1's state stored in float8: torch refused to promote it against rank 0's float32
    (RuntimeError out of the load); its values are amaxes and scales as any other rank's."""
    saved = _saved()
    low = {n: {f: v.to(torch.float8_e4m3fn) for f, v in t.items()}
           for n, t in saved["modules"].items()}
    saved["ranks"] = [saved["modules"], low]
    model = _layers()
    _callback(model, strict=False).load_state_dict(saved)
    restored = read_fp8_meta(model[0])
    assert _valid(restored)  # a value float8 turned into NaN (e4m3fn has no inf) repaired
    assert restored["fwd_scale"][0] == min(saved["modules"]["0"]["fwd_scale"][0],
                                           float(low["0"]["fwd_scale"][0]))


def test_a_failure_inside_the_restore_is_one_line_and_not_strict_continues(monkeypatch, caplog):
    """An exception from our own code while restoring went out of Composer's load as a
    traceback, stopping even a `strict: false` run."""
    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("fwd_scale")

    monkeypatch.setattr("foundry_fp8.restore.check_module", broken)
    with pytest.raises(FP8StateError) as error:
        _callback(_layers()).load_state_dict(_saved())
    assert _one_line(error.value) == ("fp8_state: the checkpoint's FP8 state could not be "
                                      "restored (KeyError: 'fwd_scale') (set fp8_state: {strict: "
                                      "false} to continue with the modules not yet restored "
                                      "fresh)")
    model = _layers()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, strict=False).load_state_dict(_saved())
    assert len(_ours(caplog)) == 1 and read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0
    # one line: the KeyError is logged at debug, not chained under the refusal's traceback
    assert "During handling" not in "".join(traceback.format_exception(error.value))


def test_a_strict_refusal_leaves_every_module_as_it_was():
    """Module 1's state does not fit (2 GEMMs saved, 1 in the model): module 0 had already been
    written with the checkpoint's state when the refusal was raised."""
    saved = _saved()
    saved["modules"]["1"] = {key: torch.cat([value, value], dim=-1)
                             for key, value in saved["modules"]["1"].items()}
    model = _layers()
    _step(model, seed=7)
    before = [read_fp8_meta(layer) for layer in model]
    with pytest.raises(FP8StateError, match=r"1 \(fwd_scale has shape \(6,\) in the checkpoint, "
                                            r"\(3,\) in the model\)"):
        _callback(model).load_state_dict(saved)
    for layer, was in zip(model, before, strict=True):
        now = read_fp8_meta(layer)
        assert all(torch.equal(now[key], was[key]) for key in FIELDS)
    assert not torch.equal(before[0]["fwd_scale"], saved["modules"]["0"]["fwd_scale"])


# The device errors fp8_state raises as they came, worded as each raiser words them.
_TE_AT = "/opt/transformer_engine/common/gemm/cublaslt_gemm.cu:512 in function cublas_gemm: "
DEVICE_ERRORS = [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
    # torch's c10/cuda/CUDAException.cpp c10_cuda_check_implementation
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors..."),
    # torch's ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( ...)`"),
    # torch's c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK
    RuntimeError("CUDA driver error: an illegal memory access was encountered"),
    # TransformerEngine's common/util/logging.h: NVTE_ERROR's "<file>:<line> in function <f>: "
    # then NVTE_CHECK_CUDA's "CUDA Error: ", NVTE_CHECK_CUBLAS's "cuBLAS Error: "
    RuntimeError(f"{_TE_AT}CUDA Error: an illegal memory access was encountered"),
    RuntimeError(f"{_TE_AT}cuBLAS Error: the function failed to launch on the GPU"),
]


@pytest.mark.parametrize("raised", DEVICE_ERRORS)
def test_a_device_error_while_restoring_is_raised_as_it_came(monkeypatch, raised):
    """A CUDA error (sticky) or out-of-memory was reported as a restore failure advising
    `strict: false`, which cannot continue past it."""
    def write(module: nn.Module, tensors: dict, check_only: bool = False) -> None:
        if not check_only:
            raise raised

    monkeypatch.setattr("foundry_fp8.composer.state.write_fp8_meta", write)
    with pytest.raises(type(raised)) as error:
        _callback(_layers(), strict=False).load_state_dict(_saved())
    assert error.value is raised


def test_histories_saved_under_current_scaling_into_current_scaling_are_named():
    """A checkpoint saved under current scaling that holds amax histories anyway (written by
    another tool): the scaling did not change, so the line names the histories, not `scaling
    current -> current`."""
    saved = _saved()
    saved["recipe"] = FP8Recipe(scaling="current").as_config()
    model = _layers()
    with pytest.raises(FP8StateError) as error:
        _callback(model, FP8Recipe(scaling="current")).load_state_dict(saved)
    assert _one_line(error.value).startswith(
        "fp8_state: checkpoint FP8 state does not fit (recipe changed?): it holds "
        "delayed-scaling amax histories (0, ...), this run's recipe keeps none")
    assert read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0


def test_load_ignore_keys_of_the_modules_is_not_called_a_run_without_fp8(tmp_path, caplog):
    """Composer's `load_ignore_keys: [state/callbacks/FP8State/modules]` leaves the entry
    without `modules`, which every save writes: it was reported as "saved by a run without FP8
    modules"."""
    _trainer(tmp_path, "2ba", [FP8State()]).fit()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _trainer(tmp_path, "3ba", [FP8State()], load_path=str(_checkpoint(tmp_path, 2)),
                 load_ignore_keys=["state/callbacks/FP8State/modules"]).fit()
    assert _ours(caplog) == ["fp8_state: the checkpoint's fp8_state entry holds no modules (left "
                             "out by load_ignore_keys?); FP8 scales and amax histories start "
                             "fresh"]


def test_modules_left_out_by_a_load_ignore_keys_glob_are_not_blamed_on_te_swap(tmp_path):
    """Composer's globs (`load_ignore_keys: [state/callbacks/FP8State/modules/*blocks.0*]`)
    drop some modules' saved state: the one line named only te_swap's selection or another
    model as the cause, sending the user to a YAML that did not change."""
    _trainer(tmp_path, "2ba", [FP8State()]).fit()
    saved = fp8_state_from_checkpoint(_checkpoint(tmp_path, 2))
    assert sorted(saved) == ["module.blocks.0", "module.blocks.1"]
    with pytest.raises(FP8StateError) as error:
        _trainer(tmp_path, "3ba", [FP8State()], load_path=str(_checkpoint(tmp_path, 2)),
                 load_ignore_keys=["state/callbacks/FP8State/modules/*blocks.0*"]).fit()
    assert str(error.value) == (
        "fp8_state: the checkpoint's FP8 modules differ from this run's (te_swap's "
        "include/exclude/keep_first_blocks/keep_last_blocks changed, another model, or saved "
        "state left out by load_ignore_keys?): 1 in FP8 now without saved state: "
        "module.blocks.0; 0 saved, not in FP8 now (set fp8_state: {strict: false} to "
        "continue with the modules in both restored, the others' FP8 state fresh)")


# -- real Composer runs: save, resume -------------------------------------------------------------


def _trainer(folder: Path, duration: str, callbacks: list[Callback], history: int | None = HISTORY,
             model: nn.Module | None = None, **kwargs: Any) -> Trainer:
    """`test_kill_resume`'s run in this process: `TwoBlocks` under te_swap's emulated FP8 with a
    history of `history` (None: no te_swap, a plain high-precision run), its losses in
    `folder/metrics.jsonl`, a checkpoint every SAVE_EVERY batches in `folder/checkpoints`."""
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * 3, torch.randint(0, 16, (8 * BATCHES,)))
    algorithms = [] if history is None else [
        TESwap(backend="emulate", fp8_recipe={"amax_history_len": history})]
    return Trainer(
        model=model or ComposerClassifier(TwoBlocks(), num_classes=16), seed=17,
        train_dataloader=DataLoader(data, batch_size=8), max_duration=duration,
        algorithms=algorithms, callbacks=callbacks, device="cpu", progress_bar=False,
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl"))],
        save_folder=str(folder / "checkpoints"), save_interval=f"{SAVE_EVERY}ba",
        save_overwrite=True, **kwargs)


def _checkpoint(folder: Path, batch: int) -> Path:
    return folder / "checkpoints" / f"ep0-ba{batch}-rank0.pt"


def _ours(caplog: pytest.LogCaptureFixture) -> list[str]:
    """fp8_state's warnings."""
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_a_recipe_change_stops_a_real_composer_resume(tmp_path):
    """Through Composer's own checkpoint save and load: history 4, resumed with history 2."""
    _trainer(tmp_path, "2ba", [FP8State()]).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    saved = fp8_state_from_checkpoint(checkpoint)
    assert saved["module.blocks.0"]["fwd_amax_history"].shape == (4, 3)
    with pytest.raises(FP8StateError, match=r"amax_history_len 4 -> 2"):
        _trainer(tmp_path, "3ba", [FP8State()], history=2, load_path=checkpoint).fit()
    resumed = _trainer(tmp_path, "3ba", [FP8State()], load_path=checkpoint)
    resumed.fit()
    assert int(resumed.state.timestamp.batch) == 3


class _InfGradientSkipped(Callback):
    """At batch `at`, one element of `blocks.1`'s output gradient is inf (an overflowing
    backward, whose amax TE records as inf), and the step is skipped as a loss scaler skips one:
    every gradient zeroed."""

    def __init__(self, at: int):
        self.at, self._batch = at, -1

    def fit_start(self, state: State, logger: Logger) -> None:
        find_layer(state.model, "blocks.1").register_full_backward_pre_hook(self._overflow)

    def batch_start(self, state: State, logger: Logger) -> None:
        self._batch = int(state.timestamp.batch)

    def _overflow(self, module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> Any:
        if self._batch != self.at:
            return None
        grad = grad_output[0].clone()
        grad.view(-1)[0] = math.inf
        return (grad, *grad_output[1:])

    def after_backward(self, state: State, logger: Logger) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            for grad in grads:
                grad.zero_()


def test_a_run_that_skipped_an_inf_step_resumes_exactly_with_default_fp8_state(
        tmp_path_factory):
    """The QA case: one step's gradient overflows (inf amax recorded, the step skipped), the
    checkpoint two batches later still holds the inf in a history; the default (strict)
    fp8_state refused it, so autoresume failed for `amax_history_len` steps. Resumed, the run
    continues bit for bit as the uninterrupted one (losses, FP8 state)."""
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    _trainer(full, f"{BATCHES}ba", [FP8State(), _InfGradientSkipped(at=2)]).fit()
    _trainer(resumed, "4ba", [FP8State(), _InfGradientSkipped(at=2)]).fit()
    saved = fp8_state_from_checkpoint(_checkpoint(resumed, 4))["module.blocks.1"]
    assert torch.isposinf(saved["bwd_amax_history"]).any()
    _trainer(resumed, f"{BATCHES}ba", [FP8State(), _InfGradientSkipped(at=2)],
             load_path=str(_checkpoint(resumed, 4))).fit()
    _assert_same_run(resumed, full)


def test_a_checkpoint_without_fp8_state_says_fp8_scaling_starts_fresh(tmp_path, caplog):
    """A bf16 (plain) run's checkpoint loaded into an FP8 run: one line naming it."""
    _trainer(tmp_path, "2ba", [], history=None).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = _trainer(tmp_path, "3ba", [FP8State()], load_path=checkpoint)
    assert _ours(caplog) == [f"fp8_state: {checkpoint} holds no FP8 state (saved without fp8_state, "
                     "or left out by load_ignore_keys); FP8 scales and amax histories start fresh, as expected when converting "
                     "a bf16 checkpoint"]
    trainer.fit()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _trainer(tmp_path, "4ba", [FP8State()], load_path=str(_checkpoint(tmp_path, 3)))
    assert _ours(caplog) == []  # the FP8 run's checkpoint holds FP8 state


class _PickledStateLinear(nn.Linear):
    """A TE module's checkpoint contract (TE 2.20 pytorch/module/base.py): delayed-scaling state
    in `fp8_meta`, saved by `get_extra_state` as a pickled dict under TE's keys and restored as
    saved by `set_extra_state`."""

    def __init__(self):
        super().__init__(16, 16)
        self.fp8_meta = {key: SimpleNamespace(scale=torch.ones(n), amax_history=torch.zeros(4, n))
                         for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2))}

    def get_extra_state(self) -> torch.Tensor:
        meta = self.fp8_meta
        state = {"recipe": None, "extra_fp8_variables": {},
                 **{f"{name}_{d}": getattr(meta[f"scaling_{d}"], name).clone()
                    for name in ("scale", "amax_history") for d in ("fwd", "bwd")}}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        saved = pickle.loads(state.numpy().tobytes())
        if saved is None:
            return
        for d in ("fwd", "bwd"):
            self.fp8_meta[f"scaling_{d}"].scale.copy_(saved[f"scale_{d}"])
            self.fp8_meta[f"scaling_{d}"].amax_history.copy_(saved[f"amax_history_{d}"])


class _PickledStateBlocks(TwoBlocks):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_PickledStateLinear(), _PickledStateLinear()])


@pytest.mark.parametrize("weights_only", [False, True])
def test_te_state_restored_by_te_itself_is_not_said_to_start_fresh(tmp_path, caplog,
                                                                   weights_only):
    """A checkpoint of a run without fp8_state whose TE modules pickled their own state (`fc_type:
    te`): TE's `set_extra_state` restores it during the model load, and fp8_state said "FP8
    scales and amax histories start fresh" (full load and weights-only load alike)."""
    from composer.models import ComposerClassifier

    saving = _trainer(tmp_path, "2ba", [], history=None,
                      model=ComposerClassifier(_PickledStateBlocks(), num_classes=16))
    saved_meta = saving.state.model.module.blocks[1].fp8_meta["scaling_fwd"]
    saved_meta.scale.fill_(2.5)
    saved_meta.amax_history[1:] = 7.0
    saving.fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loading = _trainer(tmp_path / "b", "3ba", [FP8State()], history=None,
                           model=ComposerClassifier(_PickledStateBlocks(), num_classes=16),
                           load_path=checkpoint, load_weights_only=weights_only)
    restored = read_fp8_meta(loading.state.model.module.blocks[1])
    assert torch.equal(restored["fwd_scale"], torch.full((3,), 2.5))  # TE restored it
    assert restored["fwd_amax_history"][1:].eq(7.0).all()
    assert _ours(caplog) == [f"fp8_state: {checkpoint} holds no FP8 state of fp8_state's but "
                             "TE's own in its modules' _extra_state (saved without fp8_state): "
                             "TE restored those FP8 scales and amax histories as saved, "
                             "unchecked"]


@dataclasses.dataclass
class Recipe:
    """Stands in for TE's recipe object (DelayedScaling, Float8CurrentScaling), which TE >= 2.0
    pickles into its extra state."""

    fp8_format: str = "HYBRID"


# `fp8_meta`'s plain values TE saves as `extra_fp8_variables` (TE 1.12 module/base.py:659-680)
_EXTRA = {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0}


def _te1_extra_state(delayed: bool) -> io.BytesIO:
    """TE 1.12/1.13 `get_extra_state` (module/base.py, v1.12:546-576, v1.13:589-619): the state
    dict, or None outside FP8, `torch.save`d into an io.BytesIO; scale_inv kept besides scale."""
    state = None
    if delayed:
        state = {**{f"{kind}_{d}": torch.ones(n) for kind in ("scale", "scale_inv")
                    for d, n in (("fwd", 3), ("bwd", 2))},
                 "amax_history_fwd": torch.zeros(16, 3), "amax_history_bwd": torch.zeros(16, 2),
                 "extra_fp8_variables": dict(_EXTRA)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer


def _te2_extra_state(delayed: bool) -> torch.Tensor:
    """TE 2.0-2.12 `get_extra_state` (module/base.py, v2.12:846-866): the recipe, the delayed
    state only where `recipe.delayed()`, the plain values, pickled into a uint8 tensor."""
    state: dict[str, Any] = {"recipe": Recipe()}
    if delayed:
        state.update({"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
                      "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(16, 2)})
    state["extra_fp8_variables"] = dict(_EXTRA)
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


@pytest.mark.parametrize(("extra_state", "held"), [
    (lambda: _te1_extra_state(delayed=True), True),
    (lambda: _te1_extra_state(delayed=False), False),  # saved outside FP8: None
    (lambda: _te2_extra_state(delayed=True), True),
    (lambda: _te2_extra_state(delayed=False), False),  # current scaling: recipe, plain values
    (lambda: torch.empty(0, dtype=torch.uint8), False),  # TE >= 2.13 outside FP8, stateless
])
def test_te_own_delayed_scaling_state_is_told_apart_in_every_te_format(extra_state, held):
    """A TE 1.12/1.13 checkpoint's state (a BytesIO) was untested, and a key that every TE
    payload holds (`extra_fp8_variables`) would take TE 2.x current scaling's for restored
    delayed-scaling state."""
    state_dict = {"blocks.0.weight": torch.ones(2, 2), "blocks.0._extra_state": extra_state()}
    assert holds_te_scaling_state(state_dict) is held


def test_fp8_guard_fallbacks_left_behind_in_a_checkpoint_are_named(tmp_path, caplog):
    """A checkpoint of a run whose fp8_guard moved layers to high precision, resumed without
    fp8_guard: the layers run in FP8 again, said once; with fp8_guard, nothing to say."""
    def guarded() -> list[Callback]:
        return [FP8State(), FP8Stats(interval="1ba"),
                FP8Guard(consecutive=1, max_fallback_share=1.0)]

    _trainer(tmp_path, "2ba", [*guarded(), InjectOutlier(layer="blocks.1", start=0)]).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _trainer(tmp_path, "3ba", [FP8State()], load_path=checkpoint)
    assert _ours(caplog) == [f"fp8_state: {checkpoint}: fp8_guard held 2 layers in high precision "
                     "(module.blocks.0, module.blocks.1); this run has no fp8_guard, so they "
                     "run in FP8 again"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _trainer(tmp_path, "3ba", guarded(), load_path=checkpoint)
    assert _ours(caplog) == []


# -- another number of ranks ----------------------------------------------------------------------


def test_ranks_combine_as_te_amax_reduction_would():
    """Two ranks' histories and scales, each TE-computed from its own amaxes: combined, the
    history is the elementwise max (what all-reduced amaxes would have recorded) and the scale
    the one TE computes from it, the smaller one."""
    a, b = _layers(), _layers()
    for seed in range(3):
        _step(a, seed=seed)
        _step(b, seed=10 + seed)
    ranks = [{"0": read_fp8_meta(a[0])}, {"0": read_fp8_meta(b[0])}]
    combined, problems = combine_ranks(ranks)
    assert problems == []
    combined = combined["0"]
    history = torch.maximum(ranks[0]["0"]["fwd_amax_history"], ranks[1]["0"]["fwd_amax_history"])
    assert torch.equal(combined["fwd_amax_history"], history)
    te_scale = 448.0 / history[1:].amax(0)
    assert torch.allclose(combined["fwd_scale"][:2], te_scale[:2], rtol=1e-6)
    assert _valid(combined)


# -- no code runs from a crafted checkpoint -------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "crafted.pt"
    torch.save({"state": {"callbacks": {"FP8State": {"modules": {}, "x": _RunsCode(str(marker))}}}},
               path)
    with pytest.raises(FP8StateError) as error:
        fp8_state_from_checkpoint(path)
    assert "unsupported GLOBAL posix.mkdir" in _one_line(error.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what the old reader did: the code runs
    assert marker.exists()


def test_a_pickled_object_in_the_state_itself_is_refused():
    payload = {"modules": {"0": {"fwd_scale": pickle.loads(pickle.dumps(SimpleNamespace()))}}}
    with pytest.raises(FP8StateError, match=r"modules\.0\.fwd_scale: expected a tensor, got "
                                            r"SimpleNamespace"):
        _callback(_layers()).load_state_dict(payload)


# -- te_swap without fp8_state --------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [False, True])
def test_te_swap_without_fp8_state_warns_at_start_when_saving(tmp_path, caplog, with_state):
    """Without fp8_state a resume starts FP8 scaling fresh: a real resume shows it (history
    back to empty), and te_swap says so at INIT."""
    def callbacks() -> list[Callback]:
        return [FP8State()] if with_state else []

    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.te_swap"):
        _trainer(tmp_path, "2ba", callbacks()).fit()
    assert ("has no fp8_state callback" in caplog.text) != with_state
    resumed = _trainer(tmp_path, "3ba", callbacks(), load_path=str(_checkpoint(tmp_path, 2)))
    history = read_fp8_meta(resumed.state.model.module.blocks[0])["fwd_amax_history"]
    assert (history.numel() > 0) == with_state  # fresh (empty) without fp8_state
