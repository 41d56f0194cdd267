"""A real Composer resume under another delayed-scaling recipe (`fp8_state: {strict: false}`):
the restored scales are the ones the new recipe gives, checked against TE's formula applied to
the checkpoint's own history, read back with torch.load. TE keeps a loaded scale until its
next update, so before this fix the first step cast with the old recipe's scales (HYBRID ->
E4M3: gradients scaled for E5M2's 57344 saturated at E4M3's 448)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from composer import Trainer
from composer.core import Callback

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.state import FP8State, FP8StateError
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta
from tests.test_kill_resume import BATCHES, SAVE_EVERY
from tests.test_state_restore import TwoBlocks, _InfGradientSkipped

HISTORY = 4
#: The formats' largest values (OCP FP8: E4M3 448, E5M2 57344), written here, not imported.
E4M3, E5M2 = 448.0, 57344.0


def _trainer(folder: Path, duration: str, recipe: dict[str, Any], strict: bool = True,
             extra: list[Callback] | None = None, **kwargs: Any) -> Trainer:
    """`TwoBlocks` under te_swap's emulated FP8 with `recipe` (history HISTORY), fp8_state
    kept, a checkpoint every SAVE_EVERY batches in `folder/checkpoints`."""
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * 3, torch.randint(0, 16, (8 * BATCHES,)))
    return Trainer(
        model=ComposerClassifier(TwoBlocks(), num_classes=16), seed=17,
        train_dataloader=DataLoader(data, batch_size=8), max_duration=duration,
        algorithms=[TESwap(backend="emulate",
                           fp8_recipe={"amax_history_len": HISTORY, **recipe})],
        callbacks=[FP8State(strict=strict), *(extra or [])], device="cpu", progress_bar=False,
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl"))],
        save_folder=str(folder / "checkpoints"), save_interval=f"{SAVE_EVERY}ba",
        save_overwrite=True, **kwargs)


def _saved(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """fp8_state's modules as the checkpoint holds them, read with plain torch.load."""
    entry = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return entry["state"]["callbacks"]["FP8State"]["modules"]


def _restored(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The FP8 state right after Composer's load (in the Trainer's constructor), before any
    step could update it."""
    return {name: read_fp8_meta(module) for name, module in fp8_modules(trainer.state.model)}


def _te_scale(history: torch.Tensor, fp8_max: float, margin: int, algo: str) -> torch.Tensor:
    """TE's delayed-scaling scale from a restored window (kernel_bulk,
    transformer_engine/common/recipe/delayed_scaling.cu:204-217, 238-249 and 331):
    `fp8_max * 2**-margin / amax`, amax the window's max or its last amax."""
    past = history[1:]  # row 0: amaxes no update has used
    amax = past[-1] if algo == "most_recent" else past.max(dim=0).values
    return torch.full_like(amax, fp8_max * 2.0 ** -margin) / amax


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    """A HYBRID run (margin 0, max), checkpoint after SAVE_EVERY batches: 2 updates into a
    history of 4, so the window still holds every amax its scales came from."""
    folder = tmp_path_factory.mktemp("hybrid")
    _trainer(folder, f"{SAVE_EVERY}ba", {}).fit()
    return folder / "checkpoints" / f"ep0-ba{SAVE_EVERY}-rank0.pt"


@pytest.mark.parametrize("recipe, maxes, margin, algo", [
    ({"fp8_format": "E4M3"}, {"fwd": E4M3, "bwd": E4M3}, 0, "max"),
    ({"margin": 2}, {"fwd": E4M3, "bwd": E5M2}, 2, "max"),
    ({"amax_compute_algo": "most_recent"}, {"fwd": E4M3, "bwd": E5M2}, 0, "most_recent"),
])
def test_a_resume_under_another_format_margin_or_algo_restores_the_new_recipes_scales(
        hybrid, tmp_path, caplog, recipe, maxes, margin, algo):
    saved = _saved(hybrid)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        trainer = _trainer(tmp_path, f"{SAVE_EVERY + 1}ba", recipe, strict=False,
                           load_path=str(hybrid))
    restored = _restored(trainer)
    assert restored.keys() == saved.keys() == {"module.blocks.0", "module.blocks.1"}
    changed = 0
    for name, tensors in saved.items():
        for direction in ("fwd", "bwd"):
            history, scale = tensors[f"{direction}_amax_history"], tensors[f"{direction}_scale"]
            assert not history[1].any()  # the window holds every amax the scales came from
            expected = _te_scale(history, maxes[direction], margin, algo)
            recorded = history[1:].amax(dim=0) > 0
            expected = torch.where(recorded, expected, 1.0)  # nothing recorded: TE's initial 1
            assert torch.equal(scale[~recorded], torch.ones_like(scale[~recorded]))
            assert torch.equal(restored[name][f"{direction}_scale"], expected), (name, direction)
            changed += int(not torch.equal(scale, expected))
    assert changed >= 2  # the saved scales are not the new recipe's
    warning = next(r.getMessage() for r in caplog.records if "recipe changed" in r.getMessage())
    key = next(iter(recipe))
    assert f"scales recomputed for the new {key} from the saved amax histories now" in warning
    trainer.fit()  # and the run goes on
    assert int(trainer.state.timestamp.batch) == SAVE_EVERY + 1


def test_the_first_resumed_backward_under_e4m3_casts_in_range(hybrid, tmp_path):
    """The user-visible effect: the first step's gradient amax times the scale it was cast with
    (the restored one) is within E4M3's 448 (358 and 442 measured) up to the gradient's growth
    in one step; cast with the saved E5M2 scales it was 1639 and 56600: saturated."""
    trainer = _trainer(tmp_path, f"{SAVE_EVERY + 1}ba", {"fp8_format": "E4M3"}, strict=False,
                       load_path=str(hybrid))
    before = _restored(trainer)
    trainer.fit()
    for name, tensors in _restored(trainer).items():
        first = tensors["bwd_amax_history"][-1]  # the amax the first step recorded, rolled in
        assert (first * before[name]["bwd_scale"]).max() < 2 * E4M3, name


def test_an_overflow_in_the_window_keeps_the_same_amaxs_scale_under_the_new_format(tmp_path):
    """TE kept the scale through an inf amax (delayed_scaling.cu:238-242); restored under E4M3
    it is the scale of the same amax under E4M3's max: 448/57344 = 2**-7 of the saved one."""
    skip = [_InfGradientSkipped(at=2)]
    _trainer(tmp_path, "4ba", {}, extra=skip).fit()
    checkpoint = tmp_path / "checkpoints" / "ep0-ba4-rank0.pt"
    saved = _saved(checkpoint)["module.blocks.1"]
    overflowed = torch.isposinf(saved["bwd_amax_history"]).any(dim=0)
    assert overflowed.any() and (saved["bwd_scale"][overflowed] != 1).all()
    resumed = _trainer(tmp_path / "resumed", "5ba", {"fp8_format": "E4M3"}, strict=False,
                       extra=skip, load_path=str(checkpoint))
    restored = _restored(resumed)["module.blocks.1"]["bwd_scale"]
    assert torch.equal(restored[overflowed], saved["bwd_scale"][overflowed] * (E4M3 / E5M2))


def test_turning_reduce_amax_on_is_no_recipe_change_for_default_strict(tmp_path):
    """`reduce_amax` false -> true changes nothing the checkpoint's state is laid out by; the
    default `strict` refused it as a recipe change. One rank: restored as saved."""
    _trainer(tmp_path, f"{SAVE_EVERY}ba", {"reduce_amax": False}).fit()
    checkpoint = tmp_path / "checkpoints" / f"ep0-ba{SAVE_EVERY}-rank0.pt"
    trainer = _trainer(tmp_path / "resumed", f"{SAVE_EVERY + 1}ba", {}, load_path=str(checkpoint))
    for name, tensors in _saved(checkpoint).items():
        for field, value in tensors.items():
            restored = _restored(trainer)[name][field]
            if field.endswith("_amax_history"):
                restored, value = restored[1:], value[1:]  # row 0 is not restored
            assert torch.equal(restored, value), (name, field)
    trainer.fit()
    with pytest.raises(FP8StateError, match=r"recipe changed\?\): margin 0 -> 1"):
        _trainer(tmp_path / "margin", "3ba", {"margin": 1, "reduce_amax": False},
                 load_path=str(checkpoint))
