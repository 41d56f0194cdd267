"""A sharded (DCP, FSDP `state_dict_type: sharded`) checkpoint resumed with te_swap's block
layout changed (`fuse_ln_mlp` turned on or off): DCP's planner stopped the resume with
`Missing key in checkpoint state_dict: state.model.model.transformer.blocks.0.ffn.fc1_weight`
(or `...norm_2.weight`). Now each such key is read from the other layout's name, the optimizer's
parameter names with it, as the whole-file path renames them (composer/plain.py).

Real Composer Trainers (one gloo rank, FSDP2 on the CPU, `te` backend on tests/fake_te.py) save
and resume; the reference is the saving run's own parameters and Adam moments at the save, by
MPT's names (`TE_TO_MPT`, tests/test_plain_interop.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_plain_interop import _plain_name

FUSED = {"fuse_ln_mlp": True}
PLAIN = {"fuse_ln_mlp": False, "exclude": "ffn"}


def _trainer(folder, swap: dict | None, monkeypatch, load_path: str | None = None,
             batches: int = 2, mlp_decay: float = 0.0, callbacks: tuple = ()) -> Any:
    """A tiny MPT's Trainer, FSDP2 sharded checkpoints; te_swap with `swap`'s options (None: no
    te_swap)."""
    from composer import Trainer
    from composer.optim import DecoupledAdamW
    from composer.utils.parallelism import FSDP2Config
    from llmfoundry.models.mpt import ComposerMPTCausalLM
    from torch.utils.data import DataLoader

    from foundry_fp8 import swap as swap_module
    from foundry_fp8.composer import te_swap
    from foundry_fp8.composer.te_swap import TESwap

    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)
    monkeypatch.setattr(swap_module, "would_run_fp8", lambda *args: True)
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tokenizer=None, d_model=64, n_heads=4, n_layers=2,
                                max_seq_len=16, vocab_size=128, loss_fn="torch_crossentropy",
                                attn_config={"attn_impl": "torch"})
    ids = torch.randint(0, 128, (8 * batches, 16), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": x, "labels": x} for x in ids]
    # a param group of the norm_2 + MLP parameters alone, all renamed with the layout
    mlp = [p for n, p in model.named_parameters() if ".ffn." in n or ".norm_2." in n]
    rest = [p for n, p in model.named_parameters() if not (".ffn." in n or ".norm_2." in n)]
    optimizer = DecoupledAdamW([{"params": rest}, {"params": mlp, "weight_decay": mlp_decay}],
                               lr=1e-2)
    return Trainer(
        model=model, optimizers=optimizer,
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{batches}ba",
        algorithms=[] if swap is None else [TESwap(backend="te", **swap)],
        callbacks=list(callbacks), loggers=[], device="cpu",
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="sharded")},
        progress_bar=False, save_folder=str(folder), save_interval=f"{batches}ba",
        save_overwrite=True, load_path=load_path, seed=17)


def one_rank_env(monkeypatch) -> None:
    """Composer's dist reads these beside the one-rank group."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0"}.items():
        monkeypatch.setenv(name, value)


def _by_plain_name(trainer: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(parameters, Adam state per parameter) gathered, by MPT's names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, (optimizer,) = trainer.state.model, trainer.state.optimizers
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = get_model_state_dict(model, options=full)
    moments = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    return ({_plain_name(k): v.clone() for k, v in params.items()},
            {_plain_name(k): {n: t.clone() for n, t in v.items()} for k, v in moments.items()})


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("saved", "resumed"), [(FUSED, PLAIN), (PLAIN, FUSED)],
                         ids=["fused-to-plain", "plain-to-fused"])
def test_a_sharded_checkpoint_resumes_in_the_other_block_layout(
        tmp_path, one_rank_group, fake_te, monkeypatch, saved, resumed):
    fake_te()
    one_rank_env(monkeypatch)
    saving = _trainer(tmp_path / "a", saved, monkeypatch, mlp_decay=0.25)
    saving.fit()
    expected_params, expected_moments = _by_plain_name(saving)
    saving.close()
    checkpoint = tmp_path / "a" / "ep0-ba2"
    assert (checkpoint / ".metadata").is_file()  # a DCP checkpoint folder

    resuming = _trainer(tmp_path / "b", resumed, monkeypatch, load_path=str(checkpoint),
                        batches=3)
    fused = any(n.endswith(".ffn.fc1_weight") for n, _ in
                resuming.state.model.named_parameters())
    assert fused is resumed["fuse_ln_mlp"]
    assert resuming.state.timestamp.batch.value == 2
    # the saved group's hyperparameters (DecoupledAdamW's default 1e-5, and 0.25), found by its
    # renamed parameter names (not renamed: torch's optimizer load raised KeyError weight_decay)
    assert [g["weight_decay"] for g in resuming.state.optimizers[0].param_groups] == [1e-5, 0.25]
    params, moments = _by_plain_name(resuming)
    assert sorted(params) == sorted(expected_params)
    for name, value in expected_params.items():
        assert torch.equal(params[name], value), name
    assert sorted(moments) == sorted(expected_moments) and len(moments) > 20
    for name, state in expected_moments.items():
        for key, value in state.items():
            assert torch.equal(moments[name][key], value), (name, key)
    resuming.fit()  # and trains on
    assert resuming.state.timestamp.batch.value == 3
    resuming.close()
