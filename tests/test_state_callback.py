"""fp8_state: a resumed run reaches the same FP8 state and the same losses as an uninterrupted
one (real LLM-Foundry runs with te_swap's emulated backend); mismatches are named."""

from __future__ import annotations

import logging
import pickle
import pickletools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from composer.core import Algorithm, Event
from composer.loggers import Logger
from torch import nn

from foundry_fp8.composer import state as state_module
from foundry_fp8.composer.state import (
    FP8State,
    FP8StateError,
    fp8_state_from_checkpoint,
    recompute_settings,
    stale_backward_modules,
)
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta, write_fp8_meta
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.te.extra_state import without_pickled_extra_state
from tests.test_state_restore import DEVICE_ERRORS
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


@pytest.mark.parametrize(("options", "key"), [
    ({"watch_batches": -1}, "watch_batches"), ({"watch_batches": "8"}, "watch_batches"),
    ({"watch_batches": 2.5}, "watch_batches"), ({"watch_batches": True}, "watch_batches"),
    ({"strict": "false"}, "strict"), ({"strict": None}, "strict"),
])
def test_bad_options_name_their_key_path(options, key):
    with pytest.raises(ValueError) as error:
        FP8State(**options)
    assert str(error.value).startswith(f"callbacks.fp8_state.{key}: ")
    assert "(fix: " in str(error.value) and "\n" not in str(error.value)
    assert FP8State(strict=False, watch_batches=0).watch_batches == 0


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
    with pytest.raises(ValueError, match=r"1 in FP8 now without saved state: 1; 1 saved, not in "
                                         r"FP8 now: 7 "):
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


# row 0 zero: a checkpoint's pending amaxes are not restored (foundry_fp8.restore)
SAVED = {"fwd_scale": torch.full((3,), 2.0),
         "fwd_amax_history": torch.ones(4, 3).index_fill(0, torch.tensor([0]), 0.0),
         "bwd_scale": torch.full((2,), 3.0),
         "bwd_amax_history": torch.ones(4, 2).index_fill(0, torch.tensor([0]), 0.0)}


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


def _broken_write(monkeypatch, error: Exception,
                  target: str = "foundry_fp8.composer.state.write_fp8_meta") -> list[int]:
    """`target` (the restore's write, by default) raising `error`; the calls made to it."""
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise error

    monkeypatch.setattr(target, broken)
    return calls


@pytest.mark.parametrize("target", ["foundry_fp8.composer.state.write_fp8_meta",
                                    "foundry_fp8.te.backend.init_fp8_state"])
def test_a_failure_of_the_deferred_restore_is_one_warning_naming_the_module(monkeypatch, caplog,
                                                                            target):
    """The restore at a TE module's first FP8 forward runs inside the training forward: a
    failure of ours there was a full traceback (`log.exception`) per module, naming none, and
    said "starts fresh" whatever `strict`; it is one warning naming module and error, the
    training forward goes on, and the hook is gone, also where creating TE's state failed
    (not retried and warned at every forward)."""
    module = _resume_lazy(history_len=4, strict=False)
    calls = _broken_write(monkeypatch, RuntimeError("our bug\nsecond line"), target)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.DEBUG, logger="foundry_fp8.composer.state"):
        out = module(x)
        module(x)
    assert torch.equal(out, nn.functional.linear(x, module.weight, module.bias))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "fp8_state: the checkpoint's FP8 state could not be restored at the module's first FP8 "
        "forward (RuntimeError: our bug) (0); continuing with that module not restored"]
    assert warnings[0].exc_info is None  # the traceback is at debug only
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)
    assert calls == [1] and not module._forward_pre_hooks
    # TE's fresh state (its own forward created it), not written later than the line says
    assert torch.equal(read_fp8_meta(module)["fwd_scale"], torch.ones(3))


def test_a_failure_of_the_deferred_restore_under_strict_is_one_line(monkeypatch):
    """Under `strict` the failure was logged and training went on with fresh state."""
    module = _resume_lazy(history_len=4)
    calls = _broken_write(monkeypatch, RuntimeError("our bug"))
    with pytest.raises(FP8StateError) as error:
        module(torch.randn(2, 4))
    assert str(error.value) == (
        "fp8_state: the checkpoint's FP8 state could not be restored at the module's first FP8 "
        "forward (RuntimeError: our bug) (0) (set fp8_state: {strict: false} to continue with "
        "that module not restored)")
    assert error.value.__suppress_context__  # one line: the RuntimeError is not chained
    module(torch.randn(2, 4))
    assert calls == [1] and not module._forward_pre_hooks


def test_a_deferred_restore_failing_in_every_module_is_one_warning_counting_them(monkeypatch,
                                                                                 caplog):
    """A failure shared by every waiting TE module (the same bug, or a recipe that keeps no
    state) was one warning per module, 8 in the tiny MPT and hundreds in a real model; it is
    one line counting the modules and naming the first 5, said once every waiting module has
    had its first FP8 forward. A module that restores is not counted."""
    modules = [_LazyStateLinear(4) for _ in range(7)]
    loader = FP8State(strict=False)
    loader._model = nn.Sequential(*modules)
    loader.load_state_dict({"modules": {str(i): SAVED for i in range(7)}})
    for module in modules:
        module.fp8_on = True
    real_write, calls = write_fp8_meta, []

    def write(mod: nn.Module, tensors: dict, **kwargs: Any) -> None:
        calls.append(1)
        if mod is modules[3]:
            return real_write(mod, tensors, **kwargs)
        raise RuntimeError("our bug")

    monkeypatch.setattr("foundry_fp8.composer.state.write_fp8_meta", write)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        loader._model(torch.randn(2, 4))
        loader._model(torch.randn(2, 4))
    assert [r.getMessage() for r in caplog.records] == [
        "fp8_state: the checkpoint's FP8 state could not be restored at the module's first FP8 "
        "forward (RuntimeError: our bug) (6 modules: 0, 1, 2, 4, 5 and 1 more); continuing "
        "with those modules not restored"]
    assert len(calls) == 7 and not any(m._forward_pre_hooks for m in modules)
    assert torch.equal(read_fp8_meta(modules[3])["fwd_scale"], SAVED["fwd_scale"])
    assert torch.equal(read_fp8_meta(modules[0])["fwd_scale"], torch.ones(3))


def test_a_deferred_failure_of_a_module_not_yet_run_is_said_at_the_batch_end(monkeypatch,
                                                                             caplog):
    """A waiting module that had no FP8 forward yet (unused in this forward) does not hold back
    the warning of those that failed: it is said at the callback's batch end."""
    modules = [_LazyStateLinear(4) for _ in range(2)]
    loader = FP8State(strict=False, watch_batches=0)
    loader._model = nn.Sequential(*modules)
    loader.load_state_dict({"modules": {str(i): SAVED for i in range(2)}})
    modules[0].fp8_on = True
    _broken_write(monkeypatch, RuntimeError("our bug"))
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        modules[0](torch.randn(2, 4))
        assert not caplog.records
        loader.batch_end(None, None)
        loader.batch_end(None, None)
    assert [r.getMessage() for r in caplog.records] == [
        "fp8_state: the checkpoint's FP8 state could not be restored at the module's first FP8 "
        "forward (RuntimeError: our bug) (0); continuing with that module not restored"]
    assert modules[1]._forward_pre_hooks


@pytest.mark.parametrize("raised", DEVICE_ERRORS)
def test_a_device_error_in_the_deferred_restore_is_raised_as_it_came(monkeypatch, raised):
    """An out-of-memory or CUDA error at the first FP8 forward was logged as our internal error
    and training went on, on a device that a CUDA error leaves unusable."""
    module = _resume_lazy(history_len=4, strict=False)
    _broken_write(monkeypatch, raised)
    with pytest.raises(type(raised)) as error:
        module(torch.randn(2, 4))
    assert error.value is raised and not module._forward_pre_hooks


def test_a_deferred_restore_that_fails_midway_leaves_forward_and_backward_fresh(monkeypatch,
                                                                                caplog):
    """The forward state was written before the backward one was moved to the device: a
    failure there left the module half restored (forward scale 2, backward 1) while the log
    said its state started fresh."""
    module = _resume_lazy(history_len=4, strict=False)

    class Unmovable:  # a backward history whose move to the device fails
        shape = SAVED["bwd_amax_history"].shape

        def to(self, *args: Any) -> None:
            raise RuntimeError("cannot move")

    def write(mod: nn.Module, tensors: dict, **kwargs: Any) -> None:
        write_fp8_meta(mod, {**tensors, "bwd_amax_history": Unmovable()}, **kwargs)

    monkeypatch.setattr("foundry_fp8.composer.state.write_fp8_meta", write)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        module(torch.randn(2, 4))
    got = read_fp8_meta(module)
    assert torch.equal(got["fwd_scale"], torch.ones(3))  # as TE created it, not SAVED's 2
    assert torch.equal(got["fwd_amax_history"], torch.zeros(4, 3))
    assert "(RuntimeError: cannot move) (0); continuing with that module not restored" in caplog.text


def test_the_deferred_restore_runs_eagerly_under_torch_compile():
    """LLM-Foundry's `compile_config` compiles the model: traced by Dynamo, the restore hook
    went into TE's state creation (`init_fp8_metadata`, 4 graph breaks on CPU); it now runs
    eagerly, as fp8_guard's and fp8_stats' hooks do, and still restores the saved state."""
    compiling: list[bool] = []

    class Recording(_LazyStateLinear):
        def init_fp8_metadata(self, num_gemms: int = 1) -> None:
            compiling.append(torch.compiler.is_compiling())
            super().init_fp8_metadata(num_gemms)

    module = Recording(history_len=4)
    model = nn.Sequential(module)
    loader = FP8State()
    loader._model = model
    loader.load_state_dict({"modules": {"0": SAVED}})
    compiled = torch.compile(model, backend="eager")
    module.fp8_on = True
    compiled(torch.randn(2, 4))
    assert compiling and not compiling[0]  # the hook's call, before the forward's own
    got = read_fp8_meta(module)
    assert got.keys() == SAVED.keys() and all(torch.equal(got[k], v) for k, v in SAVED.items())
    assert not module._forward_pre_hooks


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


class _DetachedFirst(_Net):
    """The first FP8 layer of the forward feeds only a detached diagnostic: it holds the
    autocast's first-module flag (TE's, and the emulation's), so the backward scale update that
    its backward would run never runs; no activation recompute anywhere."""

    def __init__(self, checkpoint):
        super().__init__(checkpoint)
        self.blocks[0].aux = nn.Linear(16, 16)

    def forward(self, x):
        self.diagnostic = self.blocks[0].aux(x).detach().norm()
        return super().forward(x)


def _fit(checkpoint, callback: FP8State, net: type[_Net] = _Net, **kwargs):
    """6 batches of 8 under te_swap's emulated FP8; `kwargs` go to the Trainer."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.te_swap import TESwap

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16) * 4, torch.randint(0, 4, (64,)))
    trainer = Trainer(model=ComposerClassifier(net(checkpoint), num_classes=4),
                      train_dataloader=DataLoader(data, batch_size=8), max_duration="6ba",
                      algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})],
                      callbacks=[callback], device="cpu", progress_bar=False, loggers=[],
                      **kwargs)
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


def test_watch_names_a_first_fp8_module_without_gradient():
    """The symptom of #1190 without any recompute: the message names the module that holds the
    flag and gives both causes."""
    with pytest.raises(FP8StateError) as error:
        _fit(lambda block, x: block(x), FP8State(), net=_DetachedFirst)
    message = str(error.value)
    assert "module.blocks.0.aux" in message
    assert "gradient" in message and "recompute" in message


def _never_update_backward(monkeypatch) -> None:
    """TE <= 1.11's reentrant checkpoint (#1190), in the emulation: backward amaxes are recorded
    into row 0 of the history as usual, but no backward scale update ever runs."""
    from foundry_fp8 import emulate

    update = emulate._reduce_and_update

    def forward_only(direction: str) -> None:
        if direction == "forward":
            update(direction)

    monkeypatch.setattr(emulate, "_reduce_and_update", forward_only)


def test_watch_fails_when_backward_updates_never_run(monkeypatch):
    """The FP8 recompute itself is right (fp8_checkpoint), the backward update is missing."""
    _never_update_backward(monkeypatch)
    with pytest.raises(FP8StateError, match=r"module\.blocks\.0\.down, module\.blocks\.0\.up, "
                                            r"module\.blocks\.1\.down.*te_checkpoint_wrapper"):
        _fit(fp8_checkpoint, FP8State())


def test_watch_quiet_with_eval_batches_and_gradient_accumulation(caplog):
    """Composer evaluates after every batch, and each batch is 4 micro-batches (4 forward and
    4 backward updates between two BATCH_ENDs)."""
    from torch.utils.data import DataLoader, TensorDataset

    evaluation = DataLoader(TensorDataset(torch.randn(16, 16) * 8, torch.randint(0, 4, (16,))),
                            batch_size=8)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        trainer = _fit(fp8_checkpoint, FP8State(), eval_dataloader=evaluation,
                       eval_interval="1ba", device_train_microbatch_size=2)
    assert "symptom" not in caplog.text and int(trainer.state.timestamp.batch) == 6
    assert int(trainer.state.eval_timestamp.batch) == 2  # the last evaluation ran
    assert trainer.state.device_train_microbatch_size == 2


# -- the watch's check, step by step (emulated FP8 layers, no Composer) ----------------------


def _old_stale_backward_modules(before, after, grads_nonzero):
    """The check before this one: a module was stale when its forward history changed and its
    whole backward history (row 0 included) and backward scale did not."""
    stale = []
    for name in sorted(before.keys() & after.keys() & grads_nonzero):
        old, new = before[name], after[name]
        moved = [not torch.equal(old[k], new[k]) for k in ("fwd_amax_history", "bwd_amax_history")]
        if moved[0] and not moved[1] and torch.equal(old["bwd_scale"], new["bwd_scale"]):
            stale.append(name)
    return stale


DELAYED = FP8Recipe(amax_history_len=4)


def _layers(n: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(EmulatedFP8Linear(16, 16) for _ in range(n)))


def _train_watched(model: nn.Module, steps: int, callback: FP8State | None = None, *,
                   recipe: FP8Recipe = DELAYED, grow: float = 1.0, micro_batches: int = 1,
                   eval_batches: int = 0) -> list[tuple[dict, set[str]]]:
    """`steps` training steps (no optimizer) on random data, each of `micro_batches` forward and
    backward passes, the loss and so every gradient growing `grow`-fold per step; then the
    callback's BATCH_END (the watch), then `eval_batches` no-grad forwards under FP8 with
    larger inputs. Per step: the FP8 state and the modules with a non-zero weight gradient."""
    generator = torch.Generator().manual_seed(1)
    steps_seen = []
    for step in range(steps):
        for _ in range(micro_batches):
            with fp8_autocast(recipe=recipe):
                out = model(torch.randn(8, 16, generator=generator))
            (out * torch.randn(out.shape, generator=generator) * grow ** step).sum().backward()
        grads = {name for name, m in model.named_modules() if isinstance(m, EmulatedFP8Linear)
                 and m.weight.grad is not None and bool(m.weight.grad.abs().max() > 0)}
        steps_seen.append(({name: read_fp8_meta(m) for name, m in model.named_modules()
                            if isinstance(m, EmulatedFP8Linear)}, grads))
        if callback is not None:
            callback.run_event(Event.BATCH_END, None, None)
        model.zero_grad(set_to_none=True)
        for _ in range(eval_batches):
            with torch.no_grad(), fp8_autocast(recipe=recipe):
                model(8 * torch.randn(8, 16, generator=generator))
    return steps_seen


def _watching(model: nn.Module, strict: bool = True) -> FP8State:
    callback = FP8State(strict=strict, watch_batches=8)
    callback._model = model
    return callback


def _pairs(steps_seen):
    return [(before, after, grads) for (before, _), (after, grads)
            in zip(steps_seen, steps_seen[1:], strict=False)]


def test_watch_catches_row0_accumulating_which_the_old_check_missed(monkeypatch):
    """#1190 as TE <= 1.11 showed it: backward amaxes max-accumulate in row 0, never rolled in.
    With gradients growing every step row 0 grows every step: the old check, which compared
    the whole backward history, saw it move and stayed quiet; the backward rows 1.. (all zero)
    and scales (1) never moved."""
    _never_update_backward(monkeypatch)
    steps_seen = _train_watched(_layers(), 6, grow=4.0)
    for before, after, grads in _pairs(steps_seen):
        assert grads == {"0", "1"}
        assert _old_stale_backward_modules(before, after, grads) == []
        assert stale_backward_modules(before, after, grads) == ["0", "1"]
        for name in grads:
            assert after[name]["bwd_amax_history"][0, 0] > before[name]["bwd_amax_history"][0, 0]
            assert not after[name]["bwd_amax_history"][1:].any()
            assert torch.equal(after[name]["bwd_scale"], torch.ones(2))

    with monkeypatch.context() as patch:  # the callback with the old check runs through
        patch.setattr(state_module, "stale_backward_modules", _old_stale_backward_modules)
        model = _layers()
        _train_watched(model, 8, _watching(model), grow=4.0)
    model = _layers()
    with pytest.raises(FP8StateError, match=r"not updating .* in 0, 1 .*: recompute FP8 layers"):
        _train_watched(model, 8, _watching(model), grow=4.0)


def test_watch_catches_backward_history_unchanged_after_resume(monkeypatch):
    """After a resume, backward rows 1.. hold the checkpoint's amaxes: they stay unchanged."""
    trained = _layers()
    _train_watched(trained, 6)
    saved = _watching(trained).state_dict()
    _never_update_backward(monkeypatch)
    model = _layers()
    callback = _watching(model)
    callback.load_state_dict(saved)
    before = read_fp8_meta(model[1])["bwd_amax_history"]
    assert before[1:].any()
    with pytest.raises(FP8StateError, match=r"in 0, 1 "):
        _train_watched(model, 8, callback, grow=4.0)
    assert torch.equal(read_fp8_meta(model[1])["bwd_amax_history"][1:], before[1:])


def _watch_quietly(model: nn.Module, **options) -> list[tuple[dict, set[str]]]:
    """Train 8 steps under a strict watch of 8 batches: every batch watched, nothing found
    (a finding raises; an error of the watch itself would stop it short of 8)."""
    callback = options.pop("callback", None) or _watching(model)
    steps_seen = _train_watched(model, 8, callback, **options)
    assert callback._watched == 8 and callback.watch_batches == 0
    return steps_seen


@pytest.mark.parametrize("history_len", [1, 2, 4, 16])
@pytest.mark.parametrize("grow", [0.25, 1.0, 4.0])
def test_watch_quiet_when_healthy(history_len, grow):
    """Healthy delayed scaling: quiet while the history fills (16 > 8 steps) and once it is full
    and wraps, with gradients shrinking, random or growing."""
    _watch_quietly(_layers(), recipe=FP8Recipe(amax_history_len=history_len), grow=grow)


def test_watch_quiet_with_current_scaling():
    model = _layers()
    _watch_quietly(model, recipe=FP8Recipe(scaling="current"), grow=4.0)
    assert read_fp8_meta(model[0])["fwd_amax_history"].numel() == 0  # no history to watch


def test_watch_quiet_with_micro_batches():
    """Gradient accumulation: 3 forward and 3 backward updates between two BATCH_ENDs."""
    _watch_quietly(_layers(), micro_batches=3, grow=4.0)


def test_watch_quiet_with_eval_batches():
    """No-grad FP8 forwards between batches (as TE: no update under no_grad, their amaxes wait
    in row 0 for the next training update)."""
    model = _layers()
    _watch_quietly(model, eval_batches=3, grow=4.0)
    assert read_fp8_meta(model[0])["fwd_amax_history"][0].any()


def test_watch_quiet_after_resume():
    trained = _layers()
    _train_watched(trained, 6)
    model = _layers()
    callback = _watching(model)
    callback.load_state_dict(_watching(trained).state_dict())
    assert read_fp8_meta(model[0])["bwd_amax_history"][1:].any()  # a full history restored
    _watch_quietly(model, callback=callback, grow=4.0)


class _PartlyTrained(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen, self.trained, self.unused = (EmulatedFP8Linear(16, 16) for _ in range(3))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.trained(self.frozen(x))


def test_watch_quiet_for_modules_without_gradient():
    """A frozen first layer (no backward runs through it: nothing needs its gradients) and a
    layer never called. The frozen one's forward history rolls and its backward one never
    moves, which only its missing gradient tells from the symptom."""
    model = _PartlyTrained()
    steps_seen = _watch_quietly(model, grow=4.0)
    assert all(grads == {"trained"} for _, grads in steps_seen)
    everything = {"frozen", "trained", "unused"}
    assert all(stale_backward_modules(before, after, everything) == ["frozen"]
               for before, after, _ in _pairs(steps_seen))


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


def test_a_weights_only_load_is_named_as_such_whole_file_or_sharded(caplog):
    """What Composer's loads call (composer/utils/checkpoint.py): a weights-only whole-file load
    `state.load_model_state` alone (`_restore_checkpoint`), a weights-only sharded load
    `state.load_state_dict({'model': ...})` (`load_sharded_checkpoint`), a full load
    `load_state_dict`, which calls `load_model_state` (composer/core/state.py); a checkpoint
    saved with `save_weights_only` holds model, integrations and metadata (`save_checkpoint`).
    The sharded weights-only load and the full load of a weights-only checkpoint were said to
    be of a checkpoint "saved without fp8_state", and the whole-file weights-only load was
    silent."""
    calls: list[str] = []
    state = SimpleNamespace(model=_trained_model(), callbacks=[], load_path="ckpt")
    state.load_model_state = lambda serialized, *a, **k: calls.append("model")
    state.load_state_dict = lambda serialized, *a, **k: state.load_model_state(serialized)
    callback = FP8State()
    callback._model = state.model
    callback._see_loaded_entries(state)
    full = {"model": {}, "timestamp": {}, "callbacks": {"FP8State": {}}}
    # a full checkpoint resumed with `load_ignore_keys: [state/timestamp]`: Composer filters
    # it before `load_state_dict` (composer/utils/checkpoint.py:966-973, 986); it was said to
    # be saved with save_weights_only, and a missing fp8_state entry went unnamed
    no_timestamp = {"model": {}, "optimizers": {}, "rank_zero_seed": 0, "integrations": {},
                    "metadata": {}}
    lines = []
    saved = {"model": {}, "callbacks": {"FP8State": {"modules": {"0": {}}}}}
    for load, serialized in ((state.load_model_state, saved),
                             (state.load_state_dict, {"model": {}}),
                             (state.load_state_dict, full),
                             (state.load_state_dict, {"model": {}, "integrations": {},
                                                      "metadata": {}}),
                             (state.load_state_dict, {**no_timestamp,
                                                      "callbacks": {"FP8State": {}}}),
                             (state.load_state_dict, {**no_timestamp, "callbacks": {}})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
            load(serialized)
            callback._report_loaded_entries(state)
        lines.append([r.getMessage() for r in caplog.records])
    weights_only = ("fp8_state: ckpt loaded with load_weights_only: FP8 scales and amax "
                    "histories are not part of the model's weights and start fresh (a full "
                    "load restores them)")
    saved_so = ("fp8_state: ckpt was saved with save_weights_only: FP8 scales and amax "
                "histories are not part of the model's weights and start fresh (checkpoints "
                "saved in full hold them)")
    no_fp8 = ("fp8_state: ckpt holds no FP8 state (saved without fp8_state, or left out by "
              "load_ignore_keys); FP8 scales and amax histories start fresh, as expected when "
              "converting a bf16 checkpoint")
    assert lines == [[weights_only], [weights_only], [], [saved_so], [], [no_fp8]]
    assert calls == ["model"] * 6


def test_a_weights_only_load_of_a_bf16_checkpoint_says_so_not_that_a_full_load_restores(caplog):
    """A warm start from a bf16 run with `load_weights_only`: Composer hands `load_model_state`
    the checkpoint's whole state (composer/utils/checkpoint.py `_restore_checkpoint`), callbacks
    included. A checkpoint without fp8_state's entry, or with its empty one (a bf16 run with
    fp8_state in its YAML), holds no FP8 state: the line said "a full load restores them",
    which a full load of it does not."""
    state = SimpleNamespace(model=_trained_model(), callbacks=[], load_path="ckpt")
    state.load_model_state = lambda serialized, *a, **k: None
    state.load_state_dict = lambda serialized, *a, **k: state.load_model_state(serialized)
    callback = FP8State()
    callback._model = state.model
    callback._see_loaded_entries(state)
    lines = []
    for callbacks in ({}, {"FP8State": {"modules": {}, "recipe": None}}, None,
                      {"FP8State": {"modules": {}, "unsaved": True}}):
        caplog.clear()
        serialized = {"model": {}} if callbacks is None else {"model": {}, "callbacks": callbacks}
        with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
            state.load_model_state(serialized)
            callback._report_loaded_entries(state)
        lines.append([r.getMessage() for r in caplog.records])
    bf16 = ("fp8_state: ckpt (loaded with load_weights_only) holds no FP8 state (saved without "
            "fp8_state or FP8 modules); FP8 scales and amax histories start fresh, as expected "
            "when converting a bf16 checkpoint")
    weights_only = ("fp8_state: ckpt loaded with load_weights_only: FP8 scales and amax "
                    "histories are not part of the model's weights and start fresh (a full "
                    "load restores them)")
    assert lines == [[bf16], [bf16], [weights_only], [weights_only]]
