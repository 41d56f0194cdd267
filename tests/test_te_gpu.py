"""TransformerEngine on an H100: the TE #1190 regression, the case that still fails, our watch
for it, and checkpoint resume without TE's pickled `_extra_state`.

Never run on the CPU machines this was written on (skipped without CUDA).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from foundry_fp8.composer.state import (
    FP8State,
    recompute_settings,
    stale_backward_modules,
    without_pickled_extra_state,
)
from foundry_fp8.fp8_meta import is_fp8_module, read_fp8_meta

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def te():
    return pytest.importorskip("transformer_engine.pytorch")


def _recipe():
    from transformer_engine.common.recipe import DelayedScaling, Format

    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def _autocast(te):
    """TE's FP8 autocast with `_recipe()`: `te.autocast` from TE 2.9, `te.fp8_autocast` before."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=_recipe())
    return te.fp8_autocast(enabled=True, fp8_recipe=_recipe())


def _recorded(history: torch.Tensor) -> torch.Tensor:
    """The amax rows a delayed-scaling history recorded, oldest first (zero rows dropped)."""
    return history[history.abs().sum(dim=1) > 0]


def _iterations(te, layer, forward, steps: int = 2):
    """Input gradient and FP8 state after each of `steps` iterations (same data every call)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for step in range(steps):
        x = (torch.randn(32, 768, device="cuda", generator=generator) * (step + 1))
        x.requires_grad_()
        with _autocast(te):
            out = forward(layer, x)
        out.backward(torch.randn(out.shape, device="cuda", generator=generator))
        torch.cuda.synchronize()
        results.append((x.grad.clone(), read_fp8_meta(layer)))
    return results


@pytest.fixture(scope="module")
def layer(te):
    torch.manual_seed(0)
    return te.Linear(768, 768, device="cuda")


@pytest.fixture(scope="module")
def reference(te, layer):
    return _iterations(te, copy.deepcopy(layer), lambda m, x: m(x))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_te_checkpoint_matches_no_checkpoint(te, layer, reference, use_reentrant):
    """#1190 regression on the installed TE: identical x.grad, scaling_bwd and forward scales.

    The forward amax history holds the same amaxes in the same order, but not necessarily at
    the same rows: TE's recompute runs in its own autocast, whose exit outside any other runs
    one more forward update (TE 2.20 quantization.py, autocast_exit), shifting every delayed-
    scaling module's forward history by a row of zeros.
    """
    got = _iterations(te, copy.deepcopy(layer), lambda m, x: te.distributed.checkpoint(
        m, x, use_reentrant=use_reentrant))
    for (grad, state), (want_grad, want_state) in zip(got, reference, strict=True):
        assert torch.equal(grad, want_grad)
        for key in ("bwd_scale", "bwd_amax_history", "fwd_scale"):
            assert torch.equal(state[key], want_state[key]), key
        assert torch.equal(_recorded(state["fwd_amax_history"]),
                           _recorded(want_state["fwd_amax_history"]))
    assert not torch.equal(reference[1][1]["bwd_scale"], torch.ones_like(
        reference[1][1]["bwd_scale"]))


def test_plain_torch_checkpoint_still_differs_and_is_caught(te, layer, reference):
    """Plain torch.utils.checkpoint around TE modules (reentrant, torch's old default) recomputes
    outside fp8_autocast. Our answer: Composer runs get te_checkpoint_wrapper set by fp8_state,
    and the watch reports this symptom."""
    got = _iterations(te, copy.deepcopy(layer), lambda m, x: torch.utils.checkpoint.checkpoint(
        m, x, use_reentrant=True))
    assert any(not torch.equal(g, want) for (g, _), (want, _) in zip(got, reference, strict=True))
    before, after = {"l": got[0][1]}, {"l": got[1][1]}
    assert stale_backward_modules(before, after, grads_nonzero={"l"}) == ["l"]
    assert stale_backward_modules({"l": reference[0][1]}, {"l": reference[1][1]}, {"l"}) == []


def test_guard_settings_on_installed_te(te):
    from foundry_fp8.te_backend import te_version

    fsdp = {"activation_checkpointing": True, "activation_checkpointing_reentrant": True}
    assert recompute_settings("amp_fp8", fsdp, 1, te_version(), emulated=False) == {
        "te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}


def test_resume_without_unsafe_pickle(te, layer, tmp_path, monkeypatch):
    """TE's amax/scale survive a save/load through our state, with NVTE_ALLOW_UNSAFE_PICKLE_
    EXTRA_STATE unset; the next step matches the uninterrupted one bit for bit.

    Both forwards share one autocast: TE's delayed-scaling update at an autocast's exit
    updates every module it has registered (its global amax buffers), run or not.
    """
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    trained = copy.deepcopy(layer)
    _iterations(te, trained, lambda m, x: m(x))
    model = torch.nn.Sequential(trained)
    if importlib.util.find_spec("transformer_engine.pytorch._extra_state") is not None:
        with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"):
            te.Linear(768, 768, device="cuda").load_state_dict(trained.state_dict())
    saver = FP8State()
    saver._model = model
    torch.save({"model": without_pickled_extra_state(model.state_dict()),
                "fp8": saver.state_dict()}, tmp_path / "ckpt.pt")

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(te.Linear(768, 768, device="cuda"))
    assert is_fp8_module(fresh[0]) and read_fp8_meta(fresh[0]) == {}  # no state before forward
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh.load_state_dict(checkpoint["model"], strict=True)
    loader = FP8State()
    loader._model = fresh
    loader.load_state_dict(checkpoint["fp8"])  # applied at fresh[0]'s first FP8 forward

    x = torch.randn(32, 768, device="cuda")
    with _autocast(te):
        outs = [m(x) for m in (model, fresh)]
    assert torch.equal(outs[0], outs[1])
    restored = read_fp8_meta(fresh[0])
    assert restored.keys() == read_fp8_meta(model[0]).keys()
    for key, value in read_fp8_meta(model[0]).items():
        assert torch.equal(restored[key], value), key
