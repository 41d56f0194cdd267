"""fp8_state under Composer's sharded load (FSDP `state_dict_type: sharded`, FSDP2's default):
Composer asks every callback for its state as the template torch.distributed.checkpoint fills
in place (composer/utils/checkpoint.py, `load_sharded_checkpoint`: `state.state_dict()`), before
any forward. An emulated layer's amax history is `[0, n]` until its first FP8 forward, and DCP
refused the saved `[len, n]` one ("Size mismatch between saved torch.Size([16, 3]) and current:
torch.Size([0, 3])"): a 2-rank FSDP2 run of the tiny MPT could not resume. Checked with DCP's
own save and load (one process)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.state import FP8State
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.test_guard import repromotion_run

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


def _guarded_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": EmulatedFP8Linear(16, 16), "b": EmulatedFP8Linear(16, 16)})


def _new_guard() -> FP8Guard:
    return FP8Guard(consecutive=2, repromote_after=3, max_fallback_share=0.5)


def _fit_start(guard: FP8Guard, model: nn.Module, timestamp: int) -> FP8Guard:
    """`guard` at fit_start in a run of `model` (what it reads of Composer's State)."""
    state = SimpleNamespace(callbacks=[FP8Stats(), guard], model=model, algorithms=[],
                            precision=SimpleNamespace(value="fp32"),
                            timestamp=SimpleNamespace(batch=timestamp))
    guard.fit_start(state, None)
    return guard


def test_fp8_guards_decisions_survive_dcps_load_into_its_state_before_fit(tmp_path):
    """fp8_guard's state before fit was `{}`: DCP's template kept nothing of the saved state, so
    after an FSDP2 resume the faulty layer ran in FP8 again and fell back only at step 8 where
    the run that did not stop moved it at step 6. Now a sharded resume at any step takes the
    decisions of the run that did not stop (REPROMOTION_TABLES: `a` falls back at 1, is
    re-promoted at 5, falls back again at 7), and a layer in fallback runs in high precision."""
    straight = _fit_start(_new_guard(), _guarded_model(), 0)
    assert straight.core is not None and straight.core.layers == ["a", "b"]
    decided = repromotion_run(straight.core, range(8))
    assert decided == [([], []), (["a"], []), ([], []), ([], []), ([], []), ([], ["a"]),
                       ([], []), (["a"], [])]
    x = torch.randn(8, 16)
    for cut in range(1, 8):
        saving = _fit_start(_new_guard(), _guarded_model(), 0)
        assert saving.core is not None
        repromotion_run(saving.core, range(cut))
        dcp.save({"guard": saving.state_dict()}, checkpoint_id=tmp_path / str(cut), no_dist=True)

        model = _guarded_model()
        loading = _new_guard()  # the Trainer's constructor: the template, DCP's load, then fit
        template = {"guard": loading.state_dict()}
        dcp.load(template, checkpoint_id=tmp_path / str(cut), no_dist=True)
        loading.load_state_dict(template["guard"])
        _fit_start(loading, model, cut)
        assert loading.core is not None
        in_fallback = cut in (2, 3, 4, 5)  # fell back at 1, back in FP8 from 6
        assert list(loading.core.fallbacks) == (["a"] if in_fallback else []), cut
        with fp8_autocast(recipe=RECIPE):
            out = model["a"](x)
        high = nn.functional.linear(x, model["a"].weight, model["a"].bias)
        assert torch.equal(out, high) is in_fallback, cut  # FP8 rounds the GEMM's inputs
        assert repromotion_run(loading.core, range(cut, 8)) == decided[cut:], cut
        assert loading.core.records() == straight.core.records(), cut


def test_a_checkpoint_saved_before_the_decisions_key_still_resumes_its_fallbacks():
    """Checkpoints saved before `decisions` hold fp8_guard's core state as the dict `core`."""
    saving = _fit_start(_new_guard(), _guarded_model(), 0)
    assert saving.core is not None
    repromotion_run(saving.core, range(3))
    loading = _new_guard()
    loading.load_state_dict({"core": saving.core.state_dict()})
    _fit_start(loading, _guarded_model(), 3)
    assert loading.core is not None and list(loading.core.fallbacks) == ["a"]
    assert loading.core.fallbacks["a"].step == 1
