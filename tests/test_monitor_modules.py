"""Which layers FP8Monitor watches and which tensors each module type exposes, with stand-ins for
TE's Linear/LayerNormLinear/LayerNormMLP (classes whose __module__ starts with
transformer_engine) and a stand-in for TE's FP8 global state. The real TE path needs a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.health import layer_key, parse_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, NoLayersError, select_layers
from foundry_fp8.numerics import tensor_stats

TE_MODULE = "transformer_engine.pytorch.module.fake"


class _TELinear(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return nn.functional.linear(inp, self.weight)


class _TELayerNormLinear(_TELinear):
    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return super().forward(nn.functional.layer_norm(inp, inp.shape[-1:]))


class _TELayerNormMLP(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.randn(2 * n, n))
        self.fc2_weight = nn.Parameter(torch.randn(n, 2 * n) * 3)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        hidden = nn.functional.gelu(nn.functional.linear(
            nn.functional.layer_norm(inp, inp.shape[-1:]), self.fc1_weight))
        return nn.functional.linear(hidden, self.fc2_weight)


# TE's class names, from a transformer_engine module
Linear = type("Linear", (_TELinear,), {"__module__": TE_MODULE})
LayerNormLinear = type("LayerNormLinear", (_TELayerNormLinear,), {"__module__": TE_MODULE})
LayerNormMLP = type("LayerNormMLP", (_TELayerNormMLP,), {"__module__": TE_MODULE})
UserLinear = type("UserLinear", (Linear,), {"__module__": "mylib"})  # a subclass of TE's
NotTELinear = type("Linear", (_TELinear,), {"__module__": "mylib.layers"})  # same name only


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), EmulatedFP8Linear(8, 8), Linear(8), LayerNormLinear(8),
                         LayerNormMLP(8), UserLinear(8), NotTELinear(8))


def _step(model: nn.Module, monitor: FP8Monitor) -> tuple[dict, dict]:
    """One logging step; returns the metrics and the hand-captured tensors of the LN-MLP."""
    seen: dict[str, torch.Tensor] = {}
    x = torch.randn(4, 8)
    monitor.start_step()
    h = x
    for i, layer in enumerate(model):
        h = layer(h)
        if i == 4:
            h.register_hook(lambda g: seen.__setitem__("mlp_grad_output", g.clone()))
    (h * 2).sum().backward()
    return monitor.finish_step(), seen


def test_selects_linear_emulated_and_te_modules_by_class_name():
    model = _model()
    assert sorted(select_layers(model, MonitorConfig())) == ["0", "1", "2", "3", "4", "5"]
    assert sorted(select_layers(model, MonitorConfig(layers="[1-4]", exclude="3"))) == [
        "1", "2", "4"]


def test_each_module_type_exposes_its_tensors():
    model = _model()
    metrics, seen = _step(model, FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None))
    tensors = {}
    for key in metrics:
        if parsed := parse_key(key):  # not the summary series
            tensors.setdefault(parsed[2], set()).add(parsed[1])
    linear = {"activation", "weight", "gradient"}
    assert tensors == {"0": linear, "1": linear, "2": linear, "5": linear,
                       "3": {"weight", "gradient"},  # the hook's input is pre-norm: not reported
                       "4": {"fc1_weight", "fc2_weight", "gradient"}}
    mlp = model[4]
    assert metrics[layer_key("amax", "fc2_weight", "4")] == pytest.approx(tensor_stats(mlp.fc2_weight)["amax"])
    assert metrics[layer_key("underflow_pct", "fc1_weight", "4")] == pytest.approx(
        tensor_stats(mlp.fc1_weight)["underflow_pct"])
    grad = tensor_stats(seen["mlp_grad_output"], "e5m2")  # fc2's dY is the module's grad output
    assert metrics[layer_key("amax", "gradient", "4")] == pytest.approx(grad["amax"])
    assert metrics[layer_key("mse", "gradient", "4")] == pytest.approx(grad["mse"])
    only_weights = FP8Monitor(model, MonitorConfig(tensors=("weight",)))
    metrics, _ = _step(model, only_weights)
    assert {parsed[1] for k in metrics if (parsed := parse_key(k))} == {
        "weight", "fc1_weight", "fc2_weight"}


class _FakeStateManager:
    """TE's FP8GlobalStateManager as the monitor reads it: enabled, with a recipe."""

    enabled = True
    recipe = type("DelayedScaling", (), {"fp8_format": types.SimpleNamespace(name="HYBRID")})()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.enabled

    @classmethod
    def get_fp8_recipe(cls):
        return cls.recipe


def _te_state(module: nn.Module, fwd: list[float], bwd: list[float]) -> None:
    module.fp8_meta = {"scaling_fwd": types.SimpleNamespace(scale=torch.tensor(fwd)),
                       "scaling_bwd": types.SimpleNamespace(scale=torch.tensor(bwd))}


@pytest.mark.parametrize("te", [None, (2, 3, 0), (2, 20, 2)], ids=["no-te", "te-2.3", "te-2.20"])
def test_te_modules_under_delayed_fp8_report_their_own_scales(monkeypatch, te):
    from foundry_fp8.te import probe

    monkeypatch.setattr(probe, "te_version", lambda: te)  # not whatever TE is installed
    fake = types.ModuleType("transformer_engine.pytorch.quantization")
    fake.FP8GlobalStateManager = _FakeStateManager
    monkeypatch.setitem(__import__("sys").modules, fake.__name__, fake)
    model = _model()
    _te_state(model[2], [4.0, 8.0, 1.0], [16.0, 1.0])
    _te_state(model[3], [1.0, 32.0, 1.0], [64.0, 1.0])
    _te_state(model[4], [1.0, 2.0, 1.0, 1.0, 0.5, 1.0], [128.0, 1.0, 256.0, 1.0])
    metrics, seen = _step(model, FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None))
    assert metrics[layer_key("scale", "activation", "2")] == 4.0
    assert metrics[layer_key("scale", "weight", "2")] == 8.0
    assert metrics[layer_key("scale", "gradient", "2")] == 16.0
    assert metrics[layer_key("scale", "weight", "3")] == 32.0 and metrics[layer_key("scale", "gradient", "3")] == 64.0
    assert metrics[layer_key("scale", "fc1_weight", "4")] == 2.0 and metrics[layer_key("scale", "fc2_weight", "4")] == 0.5
    assert metrics[layer_key("overflow_pct", "fc2_weight", "4")] == pytest.approx(
        tensor_stats(model[4].fc2_weight, scale=0.5)["overflow_pct"])
    # fc2's grad-output slot depends on TE's version: GRAD_OUTPUT1 (0) up to TE 2.3, GRAD_OUTPUT2
    # (2) from 2.4; without TE it is not known, so that gradient falls back to the what-if recipe
    # (current scaling)
    if te is None:
        current = 57344.0 / seen["mlp_grad_output"].abs().max().item()
        assert metrics[layer_key("scale", "gradient", "4")] == pytest.approx(current)
    else:
        assert metrics[layer_key("scale", "gradient", "4")] == (256.0 if te >= (2, 4) else 128.0)
    # outside TE's FP8 autocast the same modules run in high precision: what-if (current)
    monkeypatch.setattr(_FakeStateManager, "enabled", False)
    metrics, _ = _step(model, FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None))
    assert metrics[layer_key("scale", "weight", "2")] == pytest.approx(
        448.0 / model[2].weight.abs().max().item())
    assert metrics[layer_key("scale_ratio", "weight", "2")] == 1.0


def test_wrapped_layers_keep_their_plain_names():
    """FSDP and activation checkpointing insert wrapper segments into module names; metric
    names and the layer regexes see the model's own names, as fp8_state's keys do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8))
    model[0] = checkpoint_wrapper(model[0])
    assert "0._checkpoint_wrapped_module.0" in dict(model.named_modules())
    assert list(select_layers(model, MonitorConfig(layers=r"^0\.0$"))) == ["0.0"]
    monitor = FP8Monitor(model, MonitorConfig())
    x = torch.randn(4, 8)
    monitor.start_step()
    model(x).sum().backward()
    metrics = monitor.finish_step()
    assert metrics[layer_key("amax", "activation", "0.0")] == pytest.approx(tensor_stats(x)["amax"])
    assert not any("_checkpoint_wrapped_module" in k for k in metrics)


def test_layers_that_match_nothing_fail_naming_the_key_and_real_names():
    model = _model()
    with pytest.raises(NoLayersError) as caught:
        FP8Monitor(model, MonitorConfig(layers="^transformer"))
    assert str(caught.value) == ("callbacks.fp8_stats.layers: '^transformer' matches none of the "
                                 "model's 6 linear layers (fix: a regex that re.search finds in "
                                 "their names, e.g. 0, 1, 2, 3, ...)")
    with pytest.raises(NoLayersError, match="minus exclude '.'"):
        FP8Monitor(model, MonitorConfig(exclude="."))
    with pytest.raises(NoLayersError, match="no linear layer"):
        FP8Monitor(nn.Sequential(nn.ReLU()), MonitorConfig())
