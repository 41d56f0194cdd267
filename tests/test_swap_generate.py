"""te_swap backend te: `model.generate` in Composer's Generate callback (LLM-Foundry's
`generate_callback`) runs the converted TE layers in high precision, as Composer's eval does.
The callback wraps generation in `get_precision_context(state.precision)`, an enabled TE
autocast (composer/callbacks/generate.py:106, 0.32): before, every decode step's GEMMs ran in
FP8 on batch x 1 tokens, which TE's FP8 GEMM refuses, and fed inference amaxes to the training
scales. Against the TE stand-in, with TE's global FP8 switch modelled: a TE module runs in FP8
exactly when an enabled autocast is innermost (FP8GlobalStateManager.is_fp8_enabled())."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import transformers

from foundry_fp8.te import probe

FP8: list[tuple[bool, Any]] = []  # TE's autocast stack: (enabled, recipe)


@contextmanager
def _autocast(enabled: bool = True, recipe: Any = None) -> Iterator[None]:
    FP8.append((enabled, recipe))
    try:
        yield
    finally:
        FP8.pop()


@pytest.fixture
def te_run(fake_te, monkeypatch) -> tuple[torch.nn.Module, list[bool], Any]:
    """A tiny Llama after te_swap's INIT (backend te, amp_fp8), what its TE layers saw, and
    te_swap."""
    from composer.core import Event, Precision, State
    from composer.devices import DeviceCPU
    from composer.loggers import Logger

    from foundry_fp8.composer import te_swap

    fake_te()
    te = sys.modules["transformer_engine.pytorch"]
    te.autocast = _autocast
    monkeypatch.setattr(probe, "active_recipe",
                        lambda: FP8[-1][1] if FP8 and FP8[-1][0] else None)
    seen: list[bool] = []
    forward = te.Linear.forward

    def recording(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(bool(FP8) and FP8[-1][0])  # TE: FP8 iff the innermost autocast is enabled
        return forward(self, x)

    monkeypatch.setattr(te.Linear, "forward", recording)
    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)  # no GPU here
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    state = State(model=model, rank_zero_seed=0, run_name="gen", device=DeviceCPU(),
                  precision=Precision.AMP_FP8)
    swap = te_swap.TESwap(backend="te")
    swap.apply(Event.INIT, state, Logger(state))
    assert type(model.model.layers[0].mlp.up_proj) is te.Linear
    return model, seen, swap


def test_generation_inside_composer_s_fp8_autocast_runs_in_high_precision(te_run):
    model, seen, _ = te_run
    reference = transformers.AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(model.state_dict())  # the same weights, plain torch layers
    ids = torch.randint(0, 256, (1, 5))
    model.eval()
    with _autocast(enabled=True, recipe="composer's DelayedScaling"):  # the Generate callback's
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen and not any(seen)  # 14 layers x 3 forwards, none in FP8
    assert len(seen) == 14 * 3
    assert torch.equal(out, reference.eval().generate(ids, max_new_tokens=3, do_sample=False,
                                                      pad_token_id=0))
    assert FP8 == []


def test_a_training_forward_still_runs_in_fp8(te_run):
    model, seen, _ = te_run
    ids = torch.randint(0, 256, (2, 8))
    model.train()
    with _autocast(enabled=True, recipe="te_swap's"):
        model(ids, labels=ids).loss.backward()
    assert len(seen) == 14 and all(seen)


def test_a_forward_with_grad_in_eval_mode_trains_in_fp8(te_run):
    """A user's loop (RL, distillation) that trains the model in eval mode, dropout off, inside
    an enabled autocast: TE runs it in FP8, so te_swap must too (it ran 0 of 14 in FP8)."""
    model, seen, _ = te_run
    ids = torch.randint(0, 256, (2, 8))
    model.eval()
    with _autocast(enabled=True, recipe="te_swap's"):
        model(ids, labels=ids).loss.backward()
    assert len(seen) == 14 and all(seen)


def _state_of(model: torch.nn.Module) -> Any:
    from composer.core import Precision, State
    from composer.devices import DeviceCPU

    return State(model=model, rank_zero_seed=0, run_name="gen", device=DeviceCPU(),
                 precision=Precision.AMP_FP8)


def test_fp8_inference_after_the_run_is_the_user_s_and_a_new_fit_holds_it_again(te_run):
    """After FIT_END, a user's own FP8 inference (eval, no grad, an enabled TE autocast) runs in
    FP8 as TE would: te_swap's eval hooks came off (they stayed on for good and made it BF16).
    A later fit() (FIT_START) puts them back, for its Generate callback."""
    from composer.core import Event
    from composer.loggers import Logger

    model, seen, swap = te_run
    state = _state_of(model)
    ids = torch.randint(0, 256, (8, 16))
    model.eval()
    swap.apply(Event.FIT_END, state, Logger(state))
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    with torch.no_grad(), _autocast(enabled=True, recipe="user's"):
        model(ids)
    assert len(seen) == 14 and all(seen)
    swap.apply(Event.FIT_START, state, Logger(state))
    with torch.no_grad(), _autocast(enabled=True, recipe="the Generate callback's"):
        model(ids)
    assert len(seen) == 28 and not any(seen[14:])
