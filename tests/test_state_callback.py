"""fp8_state: a resumed run reaches the same FP8 state and the same losses as an uninterrupted
one (real LLM-Foundry runs with te_swap's emulated backend); mismatches are named."""

from __future__ import annotations

import logging
import pickle
import pickletools
from types import SimpleNamespace

import pytest
import torch
from composer.core import Algorithm, Event
from composer.loggers import Logger
from torch import nn

from foundry_fp8.composer.state import (
    FP8State,
    FP8StateError,
    fp8_state_from_checkpoint,
    recompute_settings,
    without_pickled_extra_state,
)
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta
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


class _LazyStateLinear(nn.Linear):
    """TE's lazy FP8 state (module/base.py, init_fp8_metadata): no scaling state until a forward
    under FP8 autocast creates it for the active recipe (3 forward and 2 backward tensors per
    GEMM); a current-scaling recipe's state has no scale or history."""

    def __init__(self, history_len: int | None = 4):
        super().__init__(4, 4)
        self.fp8_meta: dict = {}
        self.fp8, self.fp8_on, self.history_len = False, False, history_len

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8 = self.fp8_on
        if not self.fp8 or "scaling_fwd" in self.fp8_meta:
            return
        for key, n in (("scaling_fwd", 3 * num_gemms), ("scaling_bwd", 2 * num_gemms)):
            self.fp8_meta[key] = SimpleNamespace() if self.history_len is None else \
                SimpleNamespace(scale=torch.ones(n), amax_history=torch.zeros(self.history_len, n))

    def forward(self, x):
        self.init_fp8_metadata()
        return super().forward(x)


SAVED = {"fwd_scale": torch.full((3,), 2.0), "fwd_amax_history": torch.ones(4, 3),
         "bwd_scale": torch.full((2,), 3.0), "bwd_amax_history": torch.ones(4, 2)}


def _resume_lazy(history_len: int | None, strict: bool = True) -> _LazyStateLinear:
    module = _LazyStateLinear(history_len)
    loader = FP8State(strict=strict)
    loader._model = nn.Sequential(module)
    loader.load_state_dict({"modules": {"0": SAVED}})
    loader._model(torch.randn(2, 4))  # FP8 off (an eval forward): nothing to restore into yet
    assert read_fp8_meta(module) == {} and module._forward_pre_hooks
    module.fp8_on = True
    return module


def test_restore_waits_for_the_first_fp8_forward():
    module = _resume_lazy(history_len=4)
    module(torch.randn(2, 4))
    got = read_fp8_meta(module)
    assert got.keys() == SAVED.keys() and all(torch.equal(got[k], v) for k, v in SAVED.items())
    assert not module._forward_pre_hooks


@pytest.mark.parametrize(("history_len", "match"), [(None, "keeps none"), (8, "does not fit")])
def test_deferred_restore_reports_a_recipe_that_does_not_fit(history_len, match, caplog):
    with pytest.raises(FP8StateError, match=rf"{match}.*\(0\)"):
        _resume_lazy(history_len)(torch.randn(2, 4))
    module = _resume_lazy(history_len, strict=False)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        module(torch.randn(2, 4))
        module(torch.randn(2, 4))
    assert caplog.text.count(match) == 1 and not module._forward_pre_hooks


# -- TE's pickled _extra_state ---------------------------------------------------------------


class PickledExtraStateLinear(EmulatedFP8Linear):
    """TE's extra-state contract: a pickle in a uint8 tensor on save. On load, TE >= 2.16.1
    refuses a pickle that resolves globals (a delayed-scaling state) without
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE (pytorch/_extra_state.py), and TE before 2.4 unpickles
    whatever tensor it gets, an empty one included (module/base.py, set_extra_state)."""

    def get_extra_state(self):
        payload = pickle.dumps({"scale_fwd": self.fp8_meta["scaling_fwd"].scale.clone()})
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def set_extra_state(self, state):
        data = state.numpy().tobytes()
        if any(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in pickletools.genops(data)):
            raise RuntimeError("refusing to unpickle _extra_state")
        assert pickle.loads(data) is None  # TE: no state to load


def _inert(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.uint8 and pickle.loads(tensor.numpy().tobytes()) is None


def test_without_pickled_extra_state_keeps_keys_and_values():
    sd = {"a.weight": torch.ones(2), "a._extra_state": torch.arange(5, dtype=torch.uint8),
          "b._extra_state_like": torch.ones(1)}
    clean = without_pickled_extra_state(sd)
    assert clean.keys() == sd.keys() and clean["a.weight"] is sd["a.weight"]
    assert _inert(clean["a._extra_state"])
    assert clean["b._extra_state_like"] is sd["b._extra_state_like"]
    assert sd["a._extra_state"].numel() == 5  # input untouched
    with pytest.raises(EOFError):  # what TE before 2.4 does with an empty tensor
        pickle.loads(torch.empty(0, dtype=torch.uint8).numpy().tobytes())


def test_composer_model_state_dict_has_no_pickled_extra_state(tmp_path):
    from composer.core import Precision, State
    from composer.devices import DeviceCPU
    from composer.models import ComposerClassifier

    def model():
        torch.manual_seed(0)
        return ComposerClassifier(nn.Sequential(PickledExtraStateLinear(16, 16)), num_classes=16)

    saved = model()
    state = State(model=saved, rank_zero_seed=0, run_name="x", device=DeviceCPU(),
                  precision=Precision.FP32)
    assert saved.state_dict()["module.0._extra_state"].numel() > 0  # before fp8_state
    callback = FP8State()
    for event in (Event.INIT, Event.BEFORE_LOAD):
        callback.run_event(event, state, Logger(state))
    sd = state.get_model_state_dict()  # what Composer writes into checkpoints
    assert _inert(sd["module.0._extra_state"])
    torch.save(sd, tmp_path / "model.pt")
    fresh = model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert torch.equal(fresh.module[0].weight, saved.module[0].weight)


class _SwapToExtraState(Algorithm):
    """Converts at INIT as te_swap does, into a module with TE's pickled `_extra_state`."""

    def match(self, event, state):
        return event == Event.INIT

    def apply(self, event, state, logger):
        from composer.utils.module_surgery import replace_module_classes

        policy = {nn.Linear: lambda module, index: PickledExtraStateLinear.from_linear(module)}
        replace_module_classes(state.model, policy, optimizers=state.optimizers)


def test_modules_converted_at_init_save_no_pickle_in_a_real_checkpoint(tmp_path):
    """Composer runs callbacks before algorithms at INIT: modules te_swap creates then must
    still save an inert `_extra_state`, so the checkpoint loads where TE refuses pickles."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    def fit(duration: str, **kwargs):
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(16, 16), torch.randint(0, 16, (16,)))
        trainer = Trainer(model=ComposerClassifier(nn.Sequential(nn.Linear(16, 16)), 16),
                          train_dataloader=DataLoader(data, batch_size=8), max_duration=duration,
                          algorithms=[_SwapToExtraState()], callbacks=[FP8State()],
                          device="cpu", progress_bar=False, loggers=[],
                          save_folder=str(tmp_path), save_interval="2ba", **kwargs)
        trainer.fit()
        return trainer

    fit("2ba")
    saved = torch.load(tmp_path / "ep0-ba2-rank0.pt", weights_only=False)["state"]["model"]
    assert _inert(saved["module.0._extra_state"])
    resumed = fit("3ba", load_path=str(tmp_path / "ep0-ba2-rank0.pt"), save_overwrite=True)
    assert isinstance(resumed.state.model.module[0], PickledExtraStateLinear)
    assert int(resumed.state.timestamp.batch) == 3


def test_emulated_te_swap_with_fsdp_activation_checkpointing_is_refused_at_init():
    """At INIT te_swap has not converted yet (callbacks run first): fp8_state reads the plan
    from the run's algorithms."""
    from types import SimpleNamespace

    from composer.core import Precision

    from foundry_fp8.composer.te_swap import TESwap

    state = SimpleNamespace(
        model=nn.Sequential(nn.Linear(16, 16)), precision=Precision.FP32,
        fsdp_config=SimpleNamespace(activation_checkpointing=True, activation_cpu_offload=False,
                                    te_checkpoint_wrapper=False,
                                    activation_checkpointing_reentrant=True),
        fsdp_config_version=1, algorithms=[TESwap(backend="emulate")])
    with pytest.raises(FP8StateError, match="emulated FP8 layers outside FP8"):
        FP8State().run_event(Event.INIT, state, None)
    state.algorithms = []
    FP8State().run_event(Event.INIT, state, None)  # nothing emulated: nothing to refuse


# -- activation checkpointing guard -----------------------------------------------------------


AC = {"activation_checkpointing": True, "activation_checkpointing_reentrant": True,
      "te_checkpoint_wrapper": False}


def test_recompute_settings():
    assert recompute_settings("amp_fp8", AC, 1, (2, 8), emulated=False) == {
        "te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}
    done = {**AC, "te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}
    assert recompute_settings("amp_fp8", done, 1, (2, 8), emulated=False) == {}
    assert recompute_settings("amp_fp8", {**AC, "activation_checkpointing": False}, 1, (2, 8),
                              emulated=False) == {}
    assert recompute_settings("amp_bf16", AC, 1, (2, 8), emulated=False) == {}
    assert recompute_settings("amp_fp8", None, 0, (2, 8), emulated=True) == {}
    with pytest.raises(FP8StateError, match=r"TransformerEngine 1\.11\.0 .*>= 1\.12"):
        recompute_settings("amp_fp8", AC, 1, (1, 11, 0), emulated=False)
    with pytest.raises(FP8StateError, match="only FSDP1"):
        recompute_settings("amp_fp8", {"activation_checkpointing": True}, 2, (2, 8),
                           emulated=False)
    with pytest.raises(FP8StateError, match="emulated FP8 layers outside FP8"):
        recompute_settings("fp32", AC, 1, None, emulated=True)
    # CPU offload alone recomputes nothing (Composer wraps in offload_wrapper only)
    offload = {"activation_checkpointing": False, "activation_cpu_offload": True}
    assert recompute_settings("amp_fp8", offload, 2, (2, 8), emulated=False) == {}
    assert recompute_settings("fp32", offload, 1, None, emulated=True) == {}


# -- the #1190 symptom watch, in real Composer training -------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, checkpoint):
        super().__init__()
        self.stem, self.head = nn.Linear(16, 16), nn.Linear(16, 4)  # kept high precision
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.checkpoint = checkpoint

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = self.checkpoint(block, x)
        return self.head(x)


def _fit(checkpoint, callback: FP8State):
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.te_swap import TESwap

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16) * 4, torch.randint(0, 4, (64,)))
    trainer = Trainer(model=ComposerClassifier(_Net(checkpoint), num_classes=4),
                      train_dataloader=DataLoader(data, batch_size=8), max_duration="6ba",
                      algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})],
                      callbacks=[callback], device="cpu", progress_bar=False, loggers=[])
    trainer.fit()
    return trainer


def _reentrant(fn, x):
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)


def test_watch_fails_on_frozen_backward_scales():
    with pytest.raises(FP8StateError, match=r"backward FP8 scales are not updating .* "
                                            r"module\.blocks\.0\.down, module\.blocks\.0\.up"):
        _fit(_reentrant, FP8State())


def test_watch_warns_when_not_strict(caplog):
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        _fit(_reentrant, FP8State(strict=False))
    assert "TE #1190 symptom" in caplog.text


def test_watch_quiet_with_fp8_checkpoint(caplog):
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        trainer = _fit(fp8_checkpoint, FP8State())
    assert "symptom" not in caplog.text
    layer = trainer.state.model.module.blocks[1].up
    assert isinstance(layer, EmulatedFP8Linear)
    assert layer.fp8_meta["scaling_bwd"].amax_history.abs().sum() > 0


def test_own_error_is_logged_and_training_goes_on(caplog, monkeypatch):
    """A bug inside fp8_state (here: reading the FP8 state fails) must not stop training."""
    def broken(self):
        raise RuntimeError("injected fp8_state bug")

    monkeypatch.setattr(FP8State, "_local_state", broken)
    callback = FP8State()  # strict by default: strict is about findings, not our own bugs
    with caplog.at_level(logging.ERROR, logger="foundry_fp8.composer.state"):
        trainer = _fit(fp8_checkpoint, callback)
    assert int(trainer.state.timestamp.batch) == 6
    assert "injected fp8_state bug" in caplog.text and callback.watch_batches == 0


def test_own_error_while_saving_is_logged_and_the_resume_starts_fresh(caplog, monkeypatch):
    """Composer calls state_dict() inside its checkpoint save: a bug there must not stop the
    run, and the checkpoint it leaves must resume (strict) with fresh FP8 state."""
    saver = FP8State()
    saver._model = _trained_model()

    def broken(self):
        raise RuntimeError("injected fp8_state bug")

    with monkeypatch.context() as patch:
        patch.setattr(FP8State, "_local_state", broken)
        with caplog.at_level(logging.ERROR, logger="foundry_fp8.composer.state"):
            saved = saver.state_dict()
    assert "injected fp8_state bug" in caplog.text
    loader = FP8State()  # strict
    loader._model = nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        loader.load_state_dict(saved)
    assert "holds no FP8 state" in caplog.text
    assert loader._model[0].fp8_meta["scaling_fwd"].amax_history.shape[0] == 0  # fresh
