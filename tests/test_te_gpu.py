"""TransformerEngine on an H100: the TE #1190 regression, the case that still fails, our watch
for it, and checkpoint resume without TE's pickled `_extra_state`.

Never run on the CPU machines this was written on (skipped without CUDA).
"""

from __future__ import annotations

import copy

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


def _iterations(te, layer, forward, steps: int = 2):
    """Input gradient and FP8 state after each of `steps` iterations (same data every call)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for step in range(steps):
        x = (torch.randn(32, 768, device="cuda", generator=generator) * (step + 1))
        x.requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=_recipe()):
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
    """#1190 regression on the installed TE: identical x.grad and scaling_bwd."""
    got = _iterations(te, copy.deepcopy(layer), lambda m, x: te.distributed.checkpoint(
        m, x, use_reentrant=use_reentrant))
    for (grad, state), (want_grad, want_state) in zip(got, reference, strict=True):
        assert torch.equal(grad, want_grad)
        for key in ("bwd_scale", "bwd_amax_history", "fwd_scale", "fwd_amax_history"):
            assert torch.equal(state[key], want_state[key]), key
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
    EXTRA_STATE unset; the next step matches the uninterrupted one bit for bit."""
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    trained = copy.deepcopy(layer)
    _iterations(te, trained, lambda m, x: m(x))
    model = torch.nn.Sequential(trained)
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
    outs = []
    for m in (model, fresh):
        with te.fp8_autocast(enabled=True, fp8_recipe=_recipe()):
            outs.append(m(x))
    assert torch.equal(outs[0], outs[1])
    for key, value in read_fp8_meta(model[0]).items():
        assert torch.equal(read_fp8_meta(fresh[0])[key], value), key
