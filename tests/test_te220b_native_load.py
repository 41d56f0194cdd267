"""A checkpoint without TE's `_extra_state` (a bf16 run's torch layers) loaded into a model with
native TE layers (LLM-Foundry's `fc_type: te`): "continue a bf16 run with FP8 on".

Composer 0.32.1 loads every checkpoint through torch's `set_model_state_dict`
(core/state.py `load_model_state`), with `full_state_dict` under FSDP `state_dict_type: full`
(Composer's FSDP1 default). torch then hands each TE module whose key the checkpoint lacks its
`_EXTRA_STATE()` placeholder (torch/distributed/checkpoint/state_dict.py
`_iterate_valid_model_state`, `_load_model_state_dict`), which TE 2.20.2's `set_extra_state`
refuses: "Unsupported checkpoint format." (pytorch/module/base.py:1443), a traceback at Trainer
init, strict or not. Without FSDP a strict weights-only load (LLM-Foundry's default
`load_strict_model_weights: true`) stops on the missing keys instead; sharded loads and HF's
`from_pretrained` never call `set_extra_state` for a missing key. `fp8_state` gives such a module
the inert state (TE keeps its fresh FP8 metadata) while its Trainer lives. The stand-in TE
(tests/fake_te.py) loads `_extra_state` as TE 2.20.2 does.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from tests.ranks import init_rank, run_ranks


def _bf16_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A bf16 run's checkpoint (torch layers), saved by Composer; its weights."""
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(3)
    model = ComposerClassifier(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
                               num_classes=16)
    trainer = Trainer(model=model, device="cpu", loggers=[], progress_bar=False)
    trainer.save_checkpoint(path)
    trainer.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _fp8_trainer(load_path: str, callbacks: list, **kwargs: Any) -> Any:
    """The same network with TE's layers (`fc_type: te`), loading the bf16 weights."""
    import transformer_engine.pytorch as te
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(4)
    model = ComposerClassifier(nn.Sequential(te.Linear(16, 16, device="cpu"),
                                             te.Linear(16, 16, device="cpu")), num_classes=16)
    assert "module.0._extra_state" in model.state_dict()
    return Trainer(model=model, callbacks=callbacks, device="cpu", loggers=[],
                   progress_bar=False, load_path=load_path, load_weights_only=True, **kwargs)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_strict_weights_only_load_of_a_bf16_checkpoint_without_fsdp(fake_te, tmp_path):
    """LLM-Foundry's default strict weights-only load: TE's `_extra_state` keys were missing."""
    from foundry_fp8.composer.state import FP8State

    fake_te("2.20.2")
    saved = _bf16_checkpoint(str(tmp_path / "bf16.pt"))
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*module\.0\._extra_state'):
        _fp8_trainer(str(tmp_path / "bf16.pt"), [])
    trainer = _fp8_trainer(str(tmp_path / "bf16.pt"), [FP8State()])
    assert _same(_weights(trainer.state.model), saved)
    trainer.close()


def test_torch_s_full_state_dict_load_gives_te_the_inert_state_until_close(fake_te, tmp_path):
    """Composer's call under FSDP `state_dict_type: full`, on the model of a live Trainer with
    fp8_state: the weights arrive, strict or not; after `Trainer.close` the model is TE's own
    again and the same load meets TE's refusal."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from foundry_fp8.composer.state import FP8State

    fake_te("2.20.2")
    saved = _bf16_checkpoint(str(tmp_path / "bf16.pt"))
    trainer = _fp8_trainer(str(tmp_path / "bf16.pt"), [FP8State()],
                           load_strict_model_weights=False)
    model = trainer.state.model
    for strict in (True, False):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        set_model_state_dict(model, dict(saved), options=StateDictOptions(
            full_state_dict=True, strict=strict))
        assert _same(_weights(model), saved)
    trainer.close()
    assert not any(m._load_state_dict_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="Unsupported checkpoint format"):
        set_model_state_dict(model, dict(saved), options=StateDictOptions(full_state_dict=True))


def _fsdp_worker(rank: int, rendezvous: str, folder: str, out: str) -> None:
    """Real Composer Trainers on 2 gloo ranks under FSDP2, per `state_dict_type` (full: FSDP1's
    default, whose load is the same `set_model_state_dict` call, and Composer's FSDP1 needs
    CUDA; sharded: FSDP2's default): a weights-only `load_path` of a bf16 FSDP run's checkpoint,
    without and with fp8_state."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.utils.parallelism import FSDP2Config
    from torch.distributed.tensor import DTensor

    from foundry_fp8.composer.state import FP8State
    from tests.fake_te import install_fake_te

    init_rank(rank, rendezvous)
    install_fake_te(pytest.MonkeyPatch())

    def gathered(model: nn.Module) -> dict[str, torch.Tensor]:  # each rank's shards joined
        return {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in _weights(model).items()}

    result: dict[str, Any] = {}
    saved, paths, fsdp = {}, {}, {}
    for kind in ("full", "sharded"):
        fsdp[kind] = {"parallelism_config": {"fsdp": FSDP2Config(state_dict_type=kind)}}
        torch.manual_seed(3)
        bf16 = Trainer(model=ComposerClassifier(nn.Sequential(nn.Linear(16, 16),
                                                              nn.Linear(16, 16)), num_classes=16),
                       device="cpu", loggers=[], progress_bar=False,
                       save_folder=os.path.join(folder, kind), **fsdp[kind])
        bf16.save_checkpoint_to_save_folder()
        saved[kind] = {k: v.clone() for k, v in gathered(bf16.state.model).items()}
        bf16.close()
        paths[kind] = os.path.join(folder, kind, "ep0-ba0" + ("-rank0.pt" if kind == "full"
                                                              else ""))
    for kind in ("full", "sharded"):  # before any fp8_state: it wraps Composer's sharded load
        try:
            _fp8_trainer(paths[kind], [], **fsdp[kind]).close()
            result[f"{kind} without"] = "loaded"
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            result[f"{kind} without"] = str(error).strip().splitlines()[-1]
    for kind in ("full", "sharded"):
        trainer = _fp8_trainer(paths[kind], [FP8State()], **fsdp[kind])
        result[f"{kind} with"] = _same(gathered(trainer.state.model), saved[kind])
        trainer.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_a_bf16_checkpoint_loads_into_te_layers_under_fsdp(tmp_path):
    """What a user sees under FSDP: without fp8_state, TE 2.20.2's refusal at Trainer init
    (full) or DCP's (sharded); with it, the bf16 weights."""
    run_ranks(_fsdp_worker, tempfile.mkdtemp(dir=tmp_path), str(tmp_path), deadline_s=240)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["full without"] == "Unsupported checkpoint format."
        assert result["sharded without"] == ("RuntimeError: Missing key in checkpoint "
                                             "state_dict: state.model.module.0._extra_state.")
        assert result["full with"] is True
        assert result["sharded with"] is True
