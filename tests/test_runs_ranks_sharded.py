"""fp8_state under Composer's sharded load (FSDP `state_dict_type: sharded`, FSDP2's default):
Composer asks every callback for its state as the template torch.distributed.checkpoint fills
in place (composer/utils/checkpoint.py, `load_sharded_checkpoint`: `state.state_dict()`), before
any forward. An emulated layer's amax history is `[0, n]` until its first FP8 forward, and DCP
refused the saved `[len, n]` one ("Size mismatch between saved torch.Size([16, 3]) and current:
torch.Size([0, 3])"): a 2-rank FSDP2 run of the tiny MPT could not resume. Checked with DCP's
own save and load (one process)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from foundry_fp8.composer.state import FP8State
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)


def _model_and_callback() -> tuple[nn.Module, FP8State]:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))
    callback = FP8State()
    callback._model, callback._recipe = model, RECIPE  # what its INIT sets from the run
    return model, callback


def test_a_fresh_models_state_is_a_template_dcp_fills_with_the_saved_state(tmp_path):
    trained, saving = _model_and_callback()
    for _ in range(3):
        with fp8_autocast(recipe=RECIPE):
            trained(torch.randn(8, 16)).sum().backward()
    saved = saving.state_dict()
    dcp.save({"fp8": saved}, checkpoint_id=tmp_path, no_dist=True)

    _, loading = _model_and_callback()  # no forward yet, as in the Trainer's constructor
    template = {"fp8": loading.state_dict()}
    dcp.load(template, checkpoint_id=tmp_path, no_dist=True)

    loaded = template["fp8"]["modules"]
    assert loaded.keys() == saved["modules"].keys() == {"0", "1"}
    for name, tensors in saved["modules"].items():
        assert tensors["fwd_amax_history"].shape == (4, 3)
        assert tensors["fwd_amax_history"].abs().sum() > 0  # amaxes were recorded
        for key, value in tensors.items():
            assert torch.equal(loaded[name][key], value), (name, key)
