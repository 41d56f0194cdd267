"""te_swap's new parameters take the old ones' place in real LLM-Foundry runs: frozen stays frozen
(`optimizer.disable_grad`) and each keeps its own param group (`optimizer.param_groups`)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_run import run_plain, run_tiny

FROZEN = "ffn"
SHORT = {"max_duration": "3ba", "eval_interval": "3ba", "save_interval": "3ba"}


def _ffn_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.state.model.named_parameters()
            if f".{FROZEN}." in n}


@pytest.mark.filterwarnings("ignore")
def test_layers_frozen_by_disable_grad_stay_frozen(tmp_path, tiny_data):
    """LLM-Foundry freezes by name before any algorithm runs; the converted layers used to come
    back trainable. The plain run's frozen weights are the init both runs share (seed 17)."""
    frozen = {**SHORT, "optimizer": {"disable_grad": FROZEN}}
    swapped = run_tiny(tmp_path / "swap", tiny_data, frozen)
    plain = run_plain(tmp_path / "plain", tiny_data, frozen)
    assert _ffn_weights(swapped).keys() == _ffn_weights(plain).keys()
    assert all(not p.requires_grad for n, p in swapped.state.model.named_parameters()
               if f".{FROZEN}." in n)
    for name, value in _ffn_weights(swapped).items():
        assert torch.equal(value, _ffn_weights(plain)[name]), name
    trained = [n for n, p in swapped.state.model.named_parameters() if p.requires_grad]
    assert trained and all(f".{FROZEN}." not in n for n in trained)


@pytest.mark.filterwarnings("ignore")
def test_biases_keep_their_own_param_group(tmp_path, tiny_data):
    """LLM-Foundry's `param_str_match: bias` puts every bias in a group of its own (no weight
    decay), a layer's weight in another: Composer's module surgery refused that at INIT."""
    trainer = run_tiny(tmp_path, tiny_data, {**SHORT, "optimizer": {
        "weight_decay": 0.1, "param_groups": [{"param_str_match": "bias", "weight_decay": 0.0}]}})
    groups = trainer.state.optimizers[0].param_groups
    named = dict(trainer.state.model.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sorted(by_id[id(p)] for p in groups[1]["params"]) == sorted(
        n for n in named if "bias" in n)
    assert sorted(by_id[id(p)] for g in groups for p in g["params"]) == sorted(named)
    converted = dict(trainer.state.model.named_modules())["model.transformer.blocks.0.attn.Wqkv"]
    assert type(converted).__name__ == "EmulatedFP8Linear"
    assert any(p is converted.bias for p in groups[1]["params"])
