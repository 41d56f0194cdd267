"""fp8_state: a resumed run reaches the same FP8 state and the same losses as an uninterrupted
one (real LLM-Foundry runs with te_swap's emulated backend); mismatches are named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.composer.state import FP8State, fp8_state_from_checkpoint
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

SWAP = {"te_swap": {"backend": "emulate", "fp8_recipe": {"amax_history_len": 4}}}


def _losses(folder):
    return {s: m["loss/train/total"] for s, m in read_jsonl(folder / "metrics.jsonl")
            if "loss/train/total" in m}


@pytest.mark.slow
def test_resume_gives_identical_fp8_state_and_losses(tmp_path, tiny_data):
    common = {"max_duration": "8ba", "save_interval": "4ba", "eval_interval": "8ba",
              "algorithms": SWAP, "callbacks": {"fp8_state": {}}}
    run_tiny(tmp_path, tiny_data, common)
    full = run_folder(tmp_path)
    resumed_name = "mpt-tiny-cpu-resumed"
    run_tiny(tmp_path, tiny_data, {**common, "variables": {"run_name": resumed_name},
                                   "load_path": str(full / "checkpoints" / "ep0-ba4-rank0.pt")})
    resumed = run_folder(tmp_path, resumed_name)
    state_full = fp8_state_from_checkpoint(full / "checkpoints" / "ep0-ba8-rank0.pt")
    state_resumed = fp8_state_from_checkpoint(resumed / "checkpoints" / "ep0-ba8-rank0.pt")
    assert len(state_full) == 8 and state_full.keys() == state_resumed.keys()
    for name, tensors in state_full.items():
        assert tensors["fwd_amax_history"].shape == (4, 3)
        assert tensors["fwd_amax_history"].abs().sum() > 0
        for key, value in tensors.items():
            assert torch.equal(value, state_resumed[name][key]), (name, key)
    losses_full, losses_resumed = _losses(full), _losses(resumed)
    assert sorted(losses_resumed) == [4, 5, 6, 7]  # Composer logs a batch's loss at its index
    for step in (4, 5, 6, 7):
        assert losses_resumed[step] == losses_full[step]


def _trained_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))
    for _ in range(2):
        with fp8_autocast():
            out = model(torch.randn(4, 16))
        out.sum().backward()
    return model


def test_round_trip_and_named_mismatch():
    source, target = _trained_model(), nn.Sequential(EmulatedFP8Linear(16, 16),
                                                     EmulatedFP8Linear(16, 16))
    saver, loader = FP8State(), FP8State()
    saver._model, loader._model = source, target
    loader.load_state_dict(saver.state_dict())
    for a, b in zip(source, target, strict=True):
        assert torch.equal(a.fp8_meta["scaling_bwd"].scale, b.fp8_meta["scaling_bwd"].scale)
        assert torch.equal(a.fp8_meta["scaling_fwd"].amax_history,
                           b.fp8_meta["scaling_fwd"].amax_history)
    state = saver.state_dict()
    state["modules"]["7"] = state["modules"].pop("1")
    with pytest.raises(ValueError, match=r"model only: \['1'\].*checkpoint only: \['7'\]"):
        loader.load_state_dict(state)
    lenient = FP8State(strict=False)
    lenient._model = target
    lenient.load_state_dict(state)  # warns, restores the modules that match
