"""FSDP activation checkpointing without `fp8_state`: Composer recomputes the blocks in the
backward outside te_swap's FP8 autocast (TE #1190). The emulated layers stopped the first
backward with torch's `CheckpointError: A different number of tensors was saved`; TE layers
under FSDP1's default reentrant checkpoint trained on high-precision recompute gradients,
silently. te_swap now refuses at INIT in one line, with the fix (`fp8_state`, which sets or
refuses the FSDP fields: `foundry_fp8.te.recompute.recompute_plan`, its policy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from composer.core import Precision
from composer.utils.parallelism import FSDP2Config, FSDPConfig

from foundry_fp8.composer import te_swap
from tests.test_s28_swap_exclude_names import tiny_mpt
from tests.test_swap_sharded_layout import one_rank_env


def _trainer(activation_checkpointing: bool):
    from composer import Trainer
    from composer.optim import DecoupledAdamW
    from torch.utils.data import DataLoader

    model = tiny_mpt()
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))
    fsdp = FSDP2Config(activation_checkpointing=activation_checkpointing)
    return Trainer(
        model=model,
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-2),
        train_dataloader=DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=8),
        max_duration="1ba",
        algorithms=[te_swap.TESwap(backend="emulate")],
        loggers=[],
        device="cpu",
        parallelism_config={"fsdp": fsdp},
        progress_bar=False,
        seed=17,
    )


@pytest.mark.filterwarnings("ignore")
def test_emulated_layers_under_fsdp_recompute_are_refused_at_init(one_rank_group, monkeypatch):
    one_rank_env(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"^te_swap: fsdp_config.activation_checkpointing would "
        r"recompute te_swap's emulated FP8 layers outside FP8",
    ):
        _trainer(activation_checkpointing=True)
    trainer = _trainer(activation_checkpointing=False)  # the same run without recompute trains
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 1
    trainer.close()


def _state(fsdp: FSDPConfig) -> SimpleNamespace:
    return SimpleNamespace(fsdp_config=fsdp, precision=Precision.AMP_FP8, fsdp_config_version=1)


def test_te_layers_under_composers_default_recompute_are_refused_naming_the_fix(monkeypatch):
    """Composer's FSDP1 defaults: reentrant torch checkpointing, no te_checkpoint_wrapper; the
    fields fp8_state would set are named. Once set (as fp8_state does before te_swap's INIT),
    the run goes on."""
    from foundry_fp8.te import probe

    monkeypatch.setattr(probe, "te_version", lambda: (2, 20, 2))
    with pytest.raises(
        ValueError,
        match=r"add callbacks: \{fp8_state: \{\}\}, which sets them, "
        r"or set fsdp_config te_checkpoint_wrapper: true, "
        r"activation_checkpointing_reentrant: false$",
    ):
        te_swap._refuse_recompute_outside_fp8(
            _state(FSDPConfig(activation_checkpointing=True)), "te"
        )
    te_swap._refuse_recompute_outside_fp8(
        _state(
            FSDPConfig(
                activation_checkpointing=True,
                te_checkpoint_wrapper=True,
                activation_checkpointing_reentrant=False,
            )
        ),
        "te",
    )
    te_swap._refuse_recompute_outside_fp8(_state(FSDPConfig()), "te")  # nothing recomputed
