"""te_swap's block layout changed between save and resume (QA 20, B20's finding): a plain
checkpoint loaded into a run that fuses norm_2 + MLP into te.LayerNormMLP (`fuse_ln_mlp`, a bf16
warm start or `fuse_ln_mlp` turned on), or a fused checkpoint into a run that no longer fuses
(`fuse_ln_mlp: false`, `exclude`, `keep_first_blocks`). A full load failed in torch's optimizer
loader (`KeyError: '...ffn.layer_norm_weight'`, `'...norm_2.weight'`): the model's keys were
renamed, the optimizer state's were not, and only plain -> fused. Weights-only loads of a fused
checkpoint failed LLM-Foundry's strict load on every MLP key.

The reference is the checkpoint file itself, read with torch.load: every tensor and every
optimizer moment must arrive exactly, under the names `TE_TO_MPT` (tests/test_plain_interop.py,
from TE's and MPT's sources) maps. The `te` backend runs on CPU with tests/fake_te.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_plain_interop import _plain_name, _te_run
from tests.tiny_run import run_folder, run_plain

FUSED = {"fuse_ln_mlp": True, "convert_layernorm": True}
#: the MLP left unconverted (nn.Linear), and converted but not fused (te.Linear)
UNFUSED = {"fuse_ln_mlp": False, "convert_layernorm": False, "exclude": "ffn"}
LINEAR = {"fuse_ln_mlp": False, "convert_layernorm": False}
#: block 0 plain, block 1 fused
MIXED = {**FUSED, "keep_first_blocks": 1}


def _by_plain_name(named: dict[str, Any]) -> dict[str, Any]:
    return {_plain_name(name.removeprefix("model.")): value for name, value in named.items()}


def _saved(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(model tensors, optimizer state per parameter) of a Composer checkpoint, by MPT's names."""
    state = torch.load(path, map_location="cpu", weights_only=False)["state"]
    (optimizer,) = state["optimizers"].values()
    return _by_plain_name(state["model"]), _by_plain_name(optimizer["state"])


def _at_fit_start(monkeypatch) -> dict[str, Any]:
    """Fills with the resumed run's parameters, optimizer state and batch as `fit` starts, just
    after Composer's load."""
    import composer

    seen: dict[str, Any] = {}
    fit = composer.Trainer.fit

    def snapshot(self, *args: Any, **kwargs: Any) -> Any:
        params = dict(self.state.model.named_parameters())
        (optimizer,) = self.state.optimizers
        seen["params"] = _by_plain_name({n: p.detach().clone() for n, p in params.items()})
        seen["moments"] = _by_plain_name({
            n: {k: v.clone() for k, v in optimizer.state[p].items()}
            for n, p in params.items() if p in optimizer.state})
        seen["batch"] = self.state.timestamp.batch.value
        seen["fused"] = sorted(n for n in params if ".ffn.fc1_weight" in n)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(composer.Trainer, "fit", snapshot)
    return seen


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("saved,resumed,weights_only,fused", [
    (None, FUSED, False, 2),       # a plain (bf16) run resumed, or warm-started, fused
    (FUSED, UNFUSED, False, 0),    # fused -> MLP excluded
    (FUSED, UNFUSED, True, 0),
    (FUSED, LINEAR, True, 0),      # fused -> fuse_ln_mlp off, MLP in te.Linear
    (FUSED, MIXED, False, 1),      # fused -> keep_first_blocks: 1
    (MIXED, FUSED, False, 2),
], ids=["plain-fused", "fused-excluded", "fused-excluded-weights", "fused-linear-weights",
        "fused-mixed", "mixed-fused"])
def test_a_checkpoint_in_another_block_layout_loads_every_tensor_exactly(
        tmp_path, tiny_data, monkeypatch, fake_te, saved, resumed, weights_only, fused):
    overrides = {"max_duration": "2ba", "save_interval": "2ba", "eval_interval": "2ba"}
    if saved is None:
        run_plain(tmp_path / "a", tiny_data, overrides)
    else:
        _te_run(tmp_path / "a", tiny_data, monkeypatch, fake_te,
                {"algorithms": {"te_swap": saved}})
    checkpoint = run_folder(tmp_path / "a") / "checkpoints" / "ep0-ba2-rank0.pt"
    weights, moments = _saved(checkpoint)

    seen = _at_fit_start(monkeypatch)
    trainer = _te_run(tmp_path / "b", tiny_data, monkeypatch, fake_te, {
        "algorithms": {"te_swap": resumed}, "load_path": str(checkpoint), "max_duration": "3ba",
        "load_weights_only": weights_only, "callbacks": {"fp8_state": {"strict": False}}})

    assert len(seen["fused"]) == fused  # the layout asked for
    assert sorted(seen["params"]) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(seen["params"][name], value), name
    if weights_only:
        assert seen["batch"] == 0 and seen["moments"] == {}
    else:
        assert seen["batch"] == 2
        assert sorted(seen["moments"]) == sorted(moments)
        for name, state in moments.items():
            assert sorted(seen["moments"][name]) == sorted(state), name
            for key, value in state.items():
                assert torch.equal(seen["moments"][name][key], value), (name, key)
    assert trainer.state.timestamp.batch.value == 3  # and trained on


@pytest.mark.filterwarnings("ignore")
def test_a_fused_resume_into_a_fused_run_stays_bit_identical(
        tmp_path, tiny_data, monkeypatch, fake_te):
    """Same layout: nothing renamed, the resumed run's weights after batch 3 are the
    uninterrupted run's, bit for bit."""
    whole = _te_run(tmp_path / "whole", tiny_data, monkeypatch, fake_te, {
        "max_duration": "3ba", "save_interval": "3ba", "eval_interval": "3ba"})
    expected = {n: p.detach().clone() for n, p in whole.state.model.named_parameters()}
    _te_run(tmp_path / "a", tiny_data, monkeypatch, fake_te, {})
    checkpoint = run_folder(tmp_path / "a") / "checkpoints" / "ep0-ba2-rank0.pt"
    resumed = _te_run(tmp_path / "b", tiny_data, monkeypatch, fake_te, {
        "load_path": str(checkpoint), "max_duration": "3ba", "eval_interval": "3ba",
        "save_interval": "3ba"})
    got = dict(resumed.state.model.named_parameters())
    assert any(".ffn.fc1_weight" in n for n in got)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name].detach(), value), name
