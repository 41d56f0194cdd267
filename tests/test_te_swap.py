"""The `te_swap` Composer algorithm: options, refusal, and real LLM-Foundry runs with the
emulated backend whose FP8 state follows the YAML's recipe."""

from __future__ import annotations

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.emulate import EmulatedFP8Linear, is_fp8_enabled
from foundry_fp8.numerics import FP8_MAX, delayed_scale_update
from foundry_fp8.recipe import RecipeError
from tests.tiny_run import run_tiny, tiny_config

LAYER = "model.transformer.blocks.0.attn.Wqkv"


class _Recorder(Callback):
    """Records, per training forward, one converted layer's FP8 state before and after, the
    amaxes of what it really cast (seen by a hook of our own), and its weight at start."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.amaxes: list[torch.Tensor] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        del logger  # not INIT: Composer runs callbacks before algorithms there (engine.py)
        self.layer = dict(state.model.named_modules())[LAYER]
        self.initial_weight = self.layer.weight.detach().clone()

        def hook(module, args):
            if is_fp8_enabled():
                self.amaxes.append(torch.stack([args[0].detach().abs().max(),
                                                module.weight.detach().abs().max()]))

        self.layer.register_forward_pre_hook(hook)

    def _meta(self) -> dict[str, torch.Tensor]:
        meta = self.layer.fp8_meta["scaling_fwd"]
        return {"history": meta.amax_history.clone(), "scale": meta.scale.clone()}

    def before_forward(self, state: State, logger: Logger) -> None:
        self.steps.append({f"before_{k}": v for k, v in self._meta().items()})

    def after_forward(self, state: State, logger: Logger) -> None:
        self.steps[-1].update({f"after_{k}": v for k, v in self._meta().items()})


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_data):
    from llmfoundry.registry import callbacks

    callbacks.register("te_swap_test_recorder", func=_Recorder)
    recipe = {"amax_history_len": 4, "amax_compute_algo": "most_recent"}
    trainer = run_tiny(tmp_path_factory.mktemp("te_swap"), tiny_data, {
        "max_duration": "6ba", "save_interval": "6ba",
        "callbacks": {"te_swap_test_recorder": {}},
        "algorithms": {"te_swap": {"backend": "emulate", "fp8_recipe": recipe}}})
    recorder, = (c for c in trainer.state.callbacks if isinstance(c, _Recorder))
    return trainer, recorder


@pytest.mark.slow
def test_real_run_trains_the_converted_weights(recorded_run):
    trainer, recorder = recorded_run
    layers = {n: m for n, m in trainer.state.model.named_modules()
              if isinstance(m, EmulatedFP8Linear)}
    assert len(layers) == 8  # 2 blocks x (Wqkv, out_proj, up_proj, down_proj)
    optimizer = trainer.state.optimizers[0]
    optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for layer in layers.values():  # LLM-Foundry built the optimizer before the swap
        assert id(layer.weight) in optimized
        assert optimizer.state[layer.weight]["exp_avg"].abs().sum() > 0
    assert not torch.equal(layers[LAYER].weight.detach(), recorder.initial_weight)


@pytest.mark.slow
def test_real_run_forward_scales_replay_the_recipe(recorded_run):
    """History length 4, most_recent: every step's update equals an independent replay from the
    amaxes the layer really saw, and the scale is 448 / that step's amax."""
    _, recorder = recorded_run
    assert len(recorder.steps) == 6 and len(recorder.amaxes) == 6
    for step, amax in zip(recorder.steps, recorder.amaxes, strict=True):
        history = step["before_history"]
        if history.shape[0] == 0:  # sized by the recipe at the first FP8 forward
            history = torch.zeros(4, 3)
        history = history.clone()
        history[0, :2] = torch.maximum(history[0, :2], amax)
        want_history, want_scale = delayed_scale_update(history, step["before_scale"],
                                                        FP8_MAX["e4m3"], "most_recent")
        assert step["after_history"].shape == (4, 3)
        assert torch.equal(step["after_history"], want_history)
        assert torch.equal(step["after_scale"], want_scale)
        assert step["after_scale"][:2].tolist() == pytest.approx(
            [448.0 / a for a in amax.tolist()], rel=1e-6)
        assert step["after_scale"][2] == step["before_scale"][2]  # output amax never recorded


@pytest.mark.slow
def test_real_run_backward_scales_follow_the_recipe(recorded_run):
    trainer, _ = recorded_run
    for layer in (m for m in trainer.state.model.modules() if isinstance(m, EmulatedFP8Linear)):
        meta = layer.fp8_meta["scaling_bwd"]
        assert meta.amax_history.shape == (4, 2)
        newest = meta.amax_history[-1, 0]  # most_recent: rolled to the end by the update
        assert newest > 0
        assert meta.scale[0].item() == pytest.approx(FP8_MAX["e5m2"] / newest.item(), rel=1e-6)


@pytest.mark.slow
def test_real_run_with_current_scaling_keeps_no_history(tmp_path, tiny_data):
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {"max_duration": "3ba", "save_interval": "3ba",
                                            "eval_interval": "3ba"})
    # replace (not merge) the YAML's delayed recipe: history keys are errors with current
    cfg.algorithms.te_swap.fp8_recipe = {"scaling": "current"}
    trainer = train(cfg)
    layers = [m for m in trainer.state.model.modules() if isinstance(m, EmulatedFP8Linear)]
    assert len(layers) == 8
    for layer in layers:
        for which in ("scaling_fwd", "scaling_bwd"):
            meta = layer.fp8_meta[which]
            assert meta.amax_history.numel() == 0 and torch.all(meta.scale == 1)


def test_bad_options_fail_before_training_naming_the_key(tmp_path, tiny_data):
    from foundry_fp8.composer.te_swap import TESwap

    with pytest.raises(RecipeError, match=r"^fp8_recipe\.fp8_format: .*E5M2"):
        TESwap(backend="emulate", fp8_recipe={"fp8_format": "E5M2"})
    with pytest.raises(RecipeError, match=r"^fp8_recipe\.amax_history_len: "):
        TESwap(backend="emulate", fp8_recipe={"scaling": "current", "amax_history_len": 4})
    with pytest.raises(ValueError, match="te_swap.backend"):
        TESwap(backend="fp8")
    with pytest.raises(ValueError, match="te_swap.min_gemm_size"):
        TESwap(backend="emulate", min_gemm_size=-4)
    # through LLM-Foundry's train() (without fp8_lint, which would catch it first): the error
    # comes before any batch, on one line
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {"algorithms": {"te_swap": {"fp8_recipe": {
        "interval": 1}}}})
    del cfg.callbacks["fp8_lint"]
    with pytest.raises(RecipeError) as error:
        train(cfg)
    assert str(error.value).startswith("fp8_recipe.interval: ") and "\n" not in str(error.value)
    assert not list(tmp_path.rglob("*.pt"))


def test_te_backend_without_te_names_emulate():
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.te_backend import te_available

    if te_available():
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(RuntimeError, match="backend: emulate"):
        TESwap()


def test_refuses_when_nothing_would_run_in_fp8():
    from composer import Trainer
    from composer.models import ComposerClassifier

    from foundry_fp8.composer.te_swap import TESwap

    model = ComposerClassifier(torch.nn.Sequential(torch.nn.Linear(16, 16)), num_classes=16)
    with pytest.raises(ValueError, match="no module would run in FP8.*outside the transformer"):
        Trainer(model=model, algorithms=[TESwap(backend="emulate")], device="cpu")
