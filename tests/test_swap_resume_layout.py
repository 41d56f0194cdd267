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

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import run_ranks
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


def _fsdp_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """A 2-rank FSDP (Composer's default: FSDP1, use_orig_params) MPT's full model and
    optimizer state dicts, as Composer saves them (torch's get_*_state_dict), loaded through
    te_swap's `load_plain` with torch's full-state-dict loaders into a model in the other
    layout; both read back gathered, by MPT's names."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap
    from tests.fake_te import install_fake_te
    from tests.ranks import init_rank

    init_rank(rank, rendezvous)
    install_fake_te(pytest.MonkeyPatch())
    config = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=64,
                       vocab_size=512, attn_config={"attn_impl": "torch"})
    full = StateDictOptions(full_state_dict=True)

    def build(fuse: bool, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = MPTForCausalLM(config)
        apply_swap(model, plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=fuse)))
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    results = {}
    for fused_saved in (False, True):
        results["fused-plain" if fused_saved else "plain-fused"] = _other_layout(
            build, fused_saved, rank, full)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _other_layout(build: Any, fused_saved: bool, rank: int, full: Any) -> dict[str, Any]:
    """One direction of `_fsdp_worker`: (all exact, fused blocks after, parameters with state)."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from foundry_fp8.composer.plain import load_plain

    source, optimizer = build(fused_saved, 5)
    source(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank))
           ).logits.square().mean().backward()
    optimizer.step()
    saved = {"model": get_model_state_dict(source, options=full),
             "optimizers": {"AdamW": get_optimizer_state_dict(source, optimizer, options=full)}}
    expected = {"model": _by_plain_name({k: v.clone() for k, v in saved["model"].items()}),
                "moments": _by_plain_name({k: {n: t.clone() for n, t in v.items()} for k, v in
                                           saved["optimizers"]["AdamW"]["state"].items()})}

    target, target_optimizer = build(not fused_saved, 17)

    def load_model_state(state_dict: dict[str, Any]) -> None:  # Composer's, in short
        set_model_state_dict(target, state_dict["model"], options=StateDictOptions(
            full_state_dict=True, strict=True))
        set_optimizer_state_dict(target, target_optimizer, state_dict["optimizers"]["AdamW"],
                                 options=full)

    state = SimpleNamespace(model=target, load_model_state=load_model_state)
    load_plain(state)  # type: ignore[arg-type]
    state.load_model_state(saved)
    model = get_model_state_dict(target, options=full)
    moments = get_optimizer_state_dict(target, target_optimizer, options=full)["state"]
    fused_now = sum(".ffn.fc1_weight" in k for k in model)
    got = {"model": _by_plain_name(model), "moments": _by_plain_name(moments)}
    same = (sorted(got["model"]) == sorted(expected["model"])
            and all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
            and sorted(got["moments"]) == sorted(expected["moments"])
            and all(torch.equal(got["moments"][k][n], t) for k, v in expected["moments"].items()
                    for n, t in v.items()))
    return {"same": same, "fused_now": fused_now, "moments": len(expected["moments"])}


def test_fsdp_full_state_dicts_load_into_the_other_layout_exactly(tmp_path):
    """Under FSDP, torch's full-state-dict loaders (Composer's default) keep only the model's
    own names: the renames must come first, for the optimizer state as for the weights."""
    run_ranks(_fsdp_worker, str(tmp_path))
    for rank in range(2):  # 28: the tiny MPT's parameters, all trained
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "plain-fused": {"same": True, "fused_now": 2, "moments": 28},
            "fused-plain": {"same": True, "fused_now": 0, "moments": 28}}
