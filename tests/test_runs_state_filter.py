"""An LLM-Foundry `autoresume` into a run whose te_swap selects other layers than the run that
saved the checkpoint (a new `exclude`, as fp8_guard's "next time" YAML suggests): fp8_state's
one line names the change, counts each side and shows at most 5 names (a real model has hundreds
of FP8 layers; before, every name was listed, under "do not match the model")."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from foundry_fp8.composer.state import FP8StateError, fp8_state_from_checkpoint
from tests.tiny_run import run_folder, run_tiny, tiny_config

EXCLUDE = r"ffn|attn\.out_proj"  # 6 of the tiny MPT's 8 linear layers


def _autoresume(tmp_path, tiny_data, name: str, batches: int, swap: dict, state: dict):
    return run_tiny(tmp_path, tiny_data, {
        "variables": {"run_name": name}, "autoresume": True, "save_overwrite": False,
        "max_duration": f"{batches}ba", "save_interval": "2ba", "eval_interval": f"{batches}ba",
        "algorithms": {"te_swap": swap}, "callbacks": {"fp8_state": state}})


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def test_resuming_with_fewer_fp8_layers_is_one_line_naming_the_change(tmp_path, tiny_data):
    _autoresume(tmp_path, tiny_data, "fewer", 2, {}, {})
    saved = sorted(fp8_state_from_checkpoint(
        run_folder(tmp_path, "fewer") / "checkpoints" / "ep0-ba2-rank0.pt"))
    gone = [n for n in saved if re.search(EXCLUDE, n)]
    assert len(saved) == 8 and len(gone) == 6
    with pytest.raises(FP8StateError) as raised:
        _autoresume(tmp_path, tiny_data, "fewer", 4, {"exclude": EXCLUDE}, {})
    assert str(raised.value) == (
        "fp8_state: the checkpoint's FP8 modules differ from this run's (te_swap's "
        "include/exclude/keep_first_blocks/keep_last_blocks changed, or another model?): 0 in "
        f"FP8 now without saved state; 6 saved, not in FP8 now: {_shown(gone)} (set "
        "fp8_state: {strict: false} to continue with the modules in both restored, the "
        "others' FP8 state fresh)")


class _Lines(logging.Handler):
    """fp8_state's records, read on its logger (LLM-Foundry's train sets up logging so that
    pytest's caplog does not see them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_resuming_with_more_fp8_layers_warns_and_trains_on(tmp_path, tiny_data):
    _autoresume(tmp_path, tiny_data, "more", 2, {"exclude": EXCLUDE}, {})
    saved = sorted(fp8_state_from_checkpoint(
        run_folder(tmp_path, "more") / "checkpoints" / "ep0-ba2-rank0.pt"))
    assert len(saved) == 2
    handler, logger = _Lines(), logging.getLogger("foundry_fp8.composer.state")
    logger.addHandler(handler)
    try:
        trainer = _autoresume(tmp_path, tiny_data, "more", 4, {}, {"strict": False})
    finally:
        logger.removeHandler(handler)
    assert int(trainer.state.timestamp.batch) == 4
    [line] = [m for m in handler.lines if "differ from this run's" in m]
    new = sorted(n for n in fp8_state_from_checkpoint(
        run_folder(tmp_path, "more") / "checkpoints" / "ep0-ba4-rank0.pt") if n not in saved)
    assert len(new) == 6
    assert f": 6 in FP8 now without saved state: {_shown(new)}; 0 saved, not in FP8 now;" in line
    assert "\n" not in line


def test_load_ignore_keys_of_the_fp8_state_entry_is_named(tmp_path, tiny_data):
    """`load_ignore_keys: [state/callbacks/FP8State*]`: Composer drops the entry before
    fp8_state sees the checkpoint, which then reads as one saved without fp8_state."""
    run_tiny(tmp_path, tiny_data, {"variables": {"run_name": "saved"}, "max_duration": "2ba",
                                   "save_interval": "2ba", "eval_interval": "2ba"})
    checkpoint = str(run_folder(tmp_path, "saved") / "checkpoints" / "ep0-ba2-rank0.pt")
    handler, logger = _Lines(), logging.getLogger("foundry_fp8.composer.state")
    logger.addHandler(handler)
    try:
        run_tiny(tmp_path, tiny_data, {
            "variables": {"run_name": "ignored"}, "max_duration": "3ba", "eval_interval": "3ba",
            "load_path": checkpoint, "load_ignore_keys": ["state/callbacks/FP8State*"]})
    finally:
        logger.removeHandler(handler)
    assert handler.lines == [
        f"fp8_state: {checkpoint} holds no FP8 state though its run computed in FP8 (te_swap or "
        "amp_fp8; saved without fp8_state, or left out by load_ignore_keys); FP8 scales and amax "
        "histories start fresh, not continued from that run"]


def test_a_weights_only_fine_tune_says_its_fp8_scaling_starts_fresh(tmp_path, tiny_data):
    """`load_weights_only: true` (fine-tuning from another run's checkpoint): Composer loads the
    model alone (`state.load_model_state`), and fp8_state keeps the FP8 state out of the
    model's weights, so the fine-tune starts FP8 scaling fresh. Before, silently."""
    swap = {"te_swap": {"fp8_recipe": {"amax_history_len": 4}}}
    run_tiny(tmp_path, tiny_data, {"variables": {"run_name": "pretrain"}, "max_duration": "3ba",
                                   "save_interval": "3ba", "eval_interval": "3ba",
                                   "algorithms": swap})
    checkpoint = str(run_folder(tmp_path, "pretrain") / "checkpoints" / "ep0-ba3-rank0.pt")
    handler, logger = _Lines(), logging.getLogger("foundry_fp8.composer.state")
    logger.addHandler(handler)
    try:
        run_tiny(tmp_path, tiny_data, {
            "variables": {"run_name": "tuned"}, "max_duration": "1ba", "save_interval": "1ba",
            "eval_interval": "1ba", "algorithms": swap, "load_path": checkpoint,
            "load_weights_only": True})
    finally:
        logger.removeHandler(handler)
    assert handler.lines == [
        f"fp8_state: {checkpoint} loaded with load_weights_only: FP8 scales and amax histories "
        "are not part of the model's weights and start fresh (a full load restores them)"]
    # what the line says: the pretrain's input amax histories hold its 3 updates' amaxes (rows
    # 1-3), the fine-tune's after one batch only that batch's (row 3; rows 1-2 as TE starts: 0)
    pretrain = fp8_state_from_checkpoint(checkpoint)
    tuned = fp8_state_from_checkpoint(
        run_folder(tmp_path, "tuned") / "checkpoints" / "ep0-ba1-rank0.pt")
    assert pretrain.keys() == tuned.keys() and len(tuned) == 8
    for name in tuned:
        assert (pretrain[name]["fwd_amax_history"][1:, 0] > 0).all(), name
        history = tuned[name]["fwd_amax_history"][:, 0]
        assert (history[1:3] == 0).all() and history[3] > 0, name


def test_resuming_an_fp8_checkpoint_with_fp8_off_says_so(tmp_path, tiny_data):
    """A resume with te_swap left out (an FP8 run continued in high precision after a
    divergence) and fp8_state kept: the line said te_swap's include/exclude changed."""
    from llmfoundry.command_utils import train

    run_tiny(tmp_path, tiny_data, {"variables": {"run_name": "fp8"}, "max_duration": "2ba",
                                   "save_interval": "2ba", "eval_interval": "2ba"})
    checkpoint = run_folder(tmp_path, "fp8") / "checkpoints" / "ep0-ba2-rank0.pt"
    saved = fp8_state_from_checkpoint(checkpoint)
    cfg = tiny_config(tmp_path, tiny_data, {
        "variables": {"run_name": "high"}, "max_duration": "3ba", "eval_interval": "3ba",
        "load_path": str(checkpoint)})
    del cfg.algorithms["te_swap"], cfg.callbacks["fp8_stats"]
    with pytest.raises(FP8StateError) as raised:
        train(cfg)
    assert str(raised.value) == (
        f"fp8_state: the checkpoint holds the FP8 state of {len(saved)} modules, this run has no "
        "FP8 module (te_swap left out, or FP8 turned off?) (set fp8_state: {strict: false} to "
        "continue with nothing restored)")
    assert len(saved) == 8


def test_a_bf16_checkpoint_saved_with_fp8_state_in_the_yaml_resumes_fresh_with_a_warning(
        tmp_path, tiny_data):
    """A bf16 run whose YAML keeps fp8_state (a shared template) saves an empty entry; its
    resume in FP8 stopped, naming te_swap's selection, where a bf16 checkpoint without the
    entry gives one warning and starts FP8 scaling fresh. Now both give the warning."""
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {"variables": {"run_name": "bf16"},
                                            "max_duration": "2ba", "save_interval": "2ba",
                                            "eval_interval": "2ba"})
    del cfg.algorithms["te_swap"], cfg.callbacks["fp8_stats"]
    train(cfg)
    checkpoint = run_folder(tmp_path, "bf16") / "checkpoints" / "ep0-ba2-rank0.pt"
    assert fp8_state_from_checkpoint(checkpoint) == {}
    handler, logger = _Lines(), logging.getLogger("foundry_fp8.composer.state")
    logger.addHandler(handler)
    try:
        trainer = run_tiny(tmp_path, tiny_data, {
            "variables": {"run_name": "fp8"}, "max_duration": "3ba", "save_interval": "3ba",
            "eval_interval": "3ba", "load_path": str(checkpoint),
            "algorithms": {"te_swap": {"fp8_recipe": {"amax_history_len": 4}}}})
    finally:
        logger.removeHandler(handler)
    assert int(trainer.state.timestamp.batch) == 3
    assert handler.lines == [
        "fp8_state: the checkpoint holds no FP8 state (saved by a run without FP8 modules); FP8 "
        "scales and amax histories start fresh, as expected when converting a bf16 checkpoint"]
    resumed = fp8_state_from_checkpoint(
        run_folder(tmp_path, "fp8") / "checkpoints" / "ep0-ba3-rank0.pt")
    assert len(resumed) == 8
    for name, tensors in resumed.items():  # one update since the fresh start: the last row
        history = tensors["fwd_amax_history"][:, 0]
        assert (history[1:3] == 0).all() and history[3] > 0, name


def test_a_full_resume_restarting_the_step_count_restores_the_fp8_state_without_a_warning(
        tmp_path, tiny_data):
    """`load_ignore_keys: [state/timestamp]` (a full resume restarting the step count, a new
    data mix): Composer drops the timestamp before `load_state_dict`
    (composer/utils/checkpoint.py:966-973, 986), and fp8_state took the load for one of a
    checkpoint saved with save_weights_only: its warning said FP8 state started fresh while
    the entry was restored."""
    swap = {"te_swap": {"fp8_recipe": {"amax_history_len": 4}}}
    run_tiny(tmp_path, tiny_data, {"variables": {"run_name": "first"}, "max_duration": "3ba",
                                   "save_interval": "3ba", "eval_interval": "3ba",
                                   "algorithms": swap})
    checkpoint = str(run_folder(tmp_path, "first") / "checkpoints" / "ep0-ba3-rank0.pt")
    handler, logger = _Lines(), logging.getLogger("foundry_fp8.composer.state")
    logger.addHandler(handler)
    try:
        trainer = run_tiny(tmp_path, tiny_data, {
            "variables": {"run_name": "restarted"}, "max_duration": "1ba",
            "save_interval": "1ba", "eval_interval": "1ba", "algorithms": swap,
            "load_path": checkpoint, "load_ignore_keys": ["state/timestamp"]})
    finally:
        logger.removeHandler(handler)
    assert int(trainer.state.timestamp.batch) == 1  # the step count did restart
    assert handler.lines == []
    first = fp8_state_from_checkpoint(checkpoint)
    restarted = fp8_state_from_checkpoint(
        run_folder(tmp_path, "restarted") / "checkpoints" / "ep0-ba1-rank0.pt")
    assert first.keys() == restarted.keys() and len(restarted) == 8
    # restored, then one update: the first run's rows 2-3 moved up to rows 1-2, this batch's
    # amax in row 3 (a fresh start holds 0 in rows 1-2, as the weights-only fine-tune's above)
    for name in restarted:
        before, after = (s[name]["fwd_amax_history"][:, 0] for s in (first, restarted))
        assert (before[2:] > 0).all() and torch.equal(after[1:3], before[2:]), name
        assert after[3] > 0, name
