"""The `te_swap` Composer algorithm: options, refusal, and real LLM-Foundry runs with the
emulated backend whose FP8 state follows the YAML's recipe."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.emulate import EmulatedFP8Linear, is_fp8_enabled
from foundry_fp8.numerics import FP8_MAX, delayed_scale_update
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.te.facts import parse_version
from tests.fake_te import _CurrentScaling220, _DelayedScaling, _Format
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

    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.fp8_recipe\.fp8_format: .*E5M2"):
        TESwap(backend="emulate", fp8_recipe={"fp8_format": "E5M2"})
    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.fp8_recipe\.amax_history_len: "):
        TESwap(backend="emulate", fp8_recipe={"scaling": "current", "amax_history_len": 4})
    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.backend: must be one of"):
        TESwap(backend="fp8")
    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.min_gemm_size: "):
        TESwap(backend="emulate", min_gemm_size=-4)
    # through LLM-Foundry's train() (without fp8_lint, which would catch it first): the error
    # comes before any batch, on one line
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {"algorithms": {"te_swap": {"fp8_recipe": {
        "interval": 1}}}})
    del cfg.callbacks["fp8_lint"]
    with pytest.raises(ValueError) as error:
        train(cfg)
    assert str(error.value).startswith("algorithms.te_swap.fp8_recipe.interval: ")
    assert "\n" not in str(error.value)
    assert not list(tmp_path.rglob("*.pt"))


#: The audit's values: (options, key path in the message).
BAD_OPTIONS = [
    ({"fp8_recipe": "delayed"}, "fp8_recipe"), ({"fp8_recipe": ["scaling"]}, "fp8_recipe"),
    ({"fp8_recipe": {"scaling": "delayd"}}, "fp8_recipe.scaling"),
    ({"include": 5}, "include"), ({"exclude": "("}, "exclude"),
    ({"tokens_per_microbatch": True}, "tokens_per_microbatch"),
    ({"tokens_per_microbatch": 0}, "tokens_per_microbatch"),
    ({"keep_first_blocks": "1"}, "keep_first_blocks"), ({"keep_last_blocks": -1}, "keep_last_blocks"),
    ({"keep_lm_head": "false"}, "keep_lm_head"), ({"fuse_ln_mlp": 1}, "fuse_ln_mlp"),
    ({"strict": "false"}, "strict"), ({"module_filter_fn": "my.fn"}, "module_filter_fn"),
]


@pytest.mark.parametrize(("options", "key"), BAD_OPTIONS, ids=[k for _, k in BAD_OPTIONS])
def test_bad_options_name_their_key_path(options, key):
    from foundry_fp8.composer.te_swap import TESwap

    with pytest.raises(ValueError) as error:
        TESwap(backend="emulate", **options)
    message = str(error.value)
    assert message.startswith(f"algorithms.te_swap.{key}: ") and "(fix: " in message
    assert "\n" not in message


def test_python_callers_keep_working():
    import re

    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.swap import SwapConfig

    swap = TESwap(backend="emulate", include=r"blocks\.\d+", tokens_per_microbatch=8,
                  module_filter_fn=lambda module, name: True, strict=False,
                  fp8_recipe={"scaling": "current"})
    assert swap.config.tokens_per_microbatch == 8 and swap.recipe.scaling == "current"
    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.include: takes str"):
        SwapConfig(include=re.compile("x"))  # annotated str: a pattern's source, not a Pattern


def test_te_backend_without_te_names_emulate():
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.te.probe import te_available

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


class _TELinear(torch.nn.Module):
    """What te.probe reads of a TE GEMM module (`fp8_meta` and TE's `init_fp8_metadata`), as
    `fc_type: te` builds them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16))
        self.fp8_meta: dict = {}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        del num_gemms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def _blocks_net(*layers: torch.nn.Module) -> torch.nn.Module:
    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList(layers)
    net.forward = lambda x: net.blocks[-1](net.blocks[0](x))
    return net


def _trainer_with(net: torch.nn.Module, **options: Any) -> Any:
    from composer import Trainer
    from composer.models import ComposerClassifier

    from foundry_fp8.composer.te_swap import TESwap

    model = ComposerClassifier(net, num_classes=16)
    return Trainer(model=model, algorithms=[TESwap(backend="emulate", **options)], device="cpu",
                   optimizers=torch.optim.SGD(model.parameters(), lr=0.1), loggers=[],
                   progress_bar=False)


def test_a_lazy_layer_is_kept_with_its_reason_and_the_run_trains(tmp_path):
    """An `nn.LazyLinear` has no weight shape at INIT: te_swap keeps it, says why in the coverage
    table (hparams.json), and the run trains with fp8_stats and fp8_guard (it crashed counting
    the uninitialized parameter)."""
    import json

    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.jsonl import read_jsonl

    net = _blocks_net(torch.nn.LazyLinear(16), torch.nn.Linear(16, 16))
    model = ComposerClassifier(net, num_classes=16)
    data = TensorDataset(torch.randn(24, 16), torch.randint(0, 16, (24,)))
    trainer = Trainer(model=model, algorithms=[TESwap(backend="emulate")], device="cpu",
                      callbacks=[FP8Stats(interval=1, image_interval=None), FP8Guard()],
                      train_dataloader=DataLoader(data, batch_size=8), max_duration="3ba",
                      loggers=[JSONLLogger(path=str(tmp_path / "metrics.jsonl"))],
                      progress_bar=False)
    trainer.fit()
    trainer.close()
    coverage = json.loads((tmp_path / "hparams.json").read_text())["fp8/coverage"]
    assert ("| no | linear | 1 | 0 | 0.0% | not materialized when te_swap ran: nn.LazyLinear "
            "(no size yet, so not in the shares) |") in coverage.splitlines()
    assert "| yes | linear | 1 | 272 | 100.0% | converted |" in coverage.splitlines()
    assert [step for step, m in read_jsonl(tmp_path / "metrics.jsonl")
            if "loss/train/total" in m] == [0, 1, 2]


def test_a_model_of_lazy_layers_only_is_refused_in_one_line():
    net = _blocks_net(torch.nn.LazyLinear(16), torch.nn.LazyLinear(16))
    with pytest.raises(ValueError, match=r"^te_swap: precision fp32 but no module would run in "
                                         r"FP8 \(every layer kept: not materialized when te_swap "
                                         r"ran: nn\.LazyLinear"):
        _trainer_with(net)


def test_a_model_already_holding_emulated_fp8_layers_is_not_refused(capsys):
    """Emulated layers run in FP8 at any precision (fp32 here): te_swap counts them as such, not
    as TE layers that only Composer's amp_fp8 would run in FP8, and leaves them as they are."""
    from foundry_fp8.swap import SwapConfig, convert_to_fp8, fp8_module_counts

    net = _blocks_net(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    convert_to_fp8(net, SwapConfig(backend="emulate"))
    layers = list(net.blocks)
    assert fp8_module_counts(net) == (0, 2)
    _trainer_with(net, include="nothing matches this")
    assert "0 modules converted (emulate)" in capsys.readouterr().out
    assert list(net.blocks) == layers
    trainer = _trainer_with(net)
    assert {d.reason for d in trainer.state.algorithms[0].plan.decisions} == {
        "already in FP8 (EmulatedFP8Linear)"}
    assert list(net.blocks) == layers


def test_a_model_holding_te_layers_at_fp32_is_refused():
    """TE layers run in FP8 only under amp_fp8: at fp32, with every linear kept, nothing does."""
    from foundry_fp8.swap import fp8_module_counts

    net = _blocks_net(_TELinear(), torch.nn.Linear(16, 16))
    assert fp8_module_counts(net) == (1, 0)
    with pytest.raises(ValueError, match=r"^te_swap: precision fp32 but no module would run in "
                                         r"FP8 \(every layer kept: not matched by include\)"):
        _trainer_with(net, include="nothing matches this")


def test_a_forward_that_raises_leaves_the_recipe_autocast():
    """Composer's auto micro-batching retries a forward that ran out of memory: te_swap's
    autocast must be left before Composer's, not at the next forward."""
    from composer import Trainer
    from composer.models import ComposerClassifier

    from foundry_fp8.composer.te_swap import TESwap

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16)])
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](x)
            if self.fail:
                raise RuntimeError("simulated out of memory")
            return x

    net = Net()
    trainer = Trainer(model=ComposerClassifier(net, num_classes=16), device="cpu", loggers=[],
                      algorithms=[TESwap(backend="emulate")], progress_bar=False)
    model, batch = trainer.state.model.train(), (torch.randn(4, 16), torch.zeros(4).long())
    with pytest.raises(RuntimeError, match="simulated"):
        model(batch)
    assert not is_fp8_enabled()
    net.fail = False
    model(batch)
    assert not is_fp8_enabled()


def _model_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_trainers_on_one_model_each_wrap_its_forwards_once_and_leave_no_hooks(monkeypatch):
    """A notebook builds one Trainer per stage on the same model: each closed Trainer takes
    te_swap's hooks off (a fit that raised too, and one never fitted), and the next one's
    training forwards enter the recipe autocast once each, not once per earlier Trainer."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    import foundry_fp8.emulate
    from foundry_fp8.composer.te_swap import TESwap

    entered, depth = [], [0]
    real = foundry_fp8.emulate.fp8_autocast

    @contextlib.contextmanager
    def counting(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        entered.append(depth[0])
        try:
            with real(*args, **kwargs):
                yield
        finally:
            depth[0] -= 1

    monkeypatch.setattr(foundry_fp8.emulate, "fp8_autocast", counting)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)])
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise RuntimeError("simulated failure")
            return self.blocks[1](torch.relu(self.blocks[0](x)))

    net = Net()
    model = ComposerClassifier(net, num_classes=4)
    assert _model_hooks(model) == 0
    data = TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))

    def trainer() -> Any:
        return Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                       max_duration="4ba", algorithms=[TESwap(backend="emulate")], device="cpu",
                       loggers=[], progress_bar=False)

    trainer().close()  # built, never fitted
    assert _model_hooks(model) == 0
    failing = trainer()
    net.fail = True
    with pytest.raises(RuntimeError, match="simulated failure"):
        failing.fit()
    failing.close()
    net.fail = False
    assert _model_hooks(model) == 0
    for _ in range(3):
        stage = trainer()
        entered.clear()
        stage.fit()
        assert entered == [1, 1, 1, 1]  # 4 batches, one training forward each, not nested
        stage.close()
        assert _model_hooks(model) == 0
    assert not is_fp8_enabled()


# -- TE facts, against the stand-in `transformer_engine` of tests/fake_te.py ------------


@pytest.mark.parametrize("version", ["2.20.2", "2.8.0"])
def test_a_fallback_region_carries_the_enclosing_recipe(fake_te, monkeypatch, version):
    """TE stores a disabled region's recipe (its default when given none) under a key that
    leaves out `amax_compute_algo`, and the outermost exit updates with the recipe stored last
    (pytorch/quantization.py:675, 740-745 in TE 2.20): fp8_guard's region must hand TE the
    run's recipe (outside an enabled autocast: the layer's own), through `te.autocast` from
    TE 2.9 and `te.fp8_autocast` before."""
    from contextlib import nullcontext

    from foundry_fp8.te import backend, probe

    fake_te(version)
    te, calls = sys.modules["transformer_engine.pytorch"], []
    if parse_version(version) >= (2, 9):
        te.autocast = lambda **kwargs: calls.append(("autocast", kwargs)) or nullcontext()
    te.fp8_autocast = lambda **kwargs: calls.append(("fp8_autocast", kwargs)) or nullcontext()
    run_recipe, layer_recipe, active = object(), object(), []
    monkeypatch.setattr(probe, "active_recipe", lambda: active[0] if active else None)
    layer = torch.nn.Linear(4, 4)
    layer.fp8_meta = {"recipe": layer_recipe}  # what TE keeps of the layer's last FP8 forward
    for now, want in ((run_recipe, run_recipe), (None, layer_recipe)):
        active[:], calls[:] = [now], []
        with backend.te_high_precision(layer):  # in the run's autocast; in a recompute outside
            pass
        assert calls == ([("autocast", {"enabled": False, "recipe": want})]
                         if parse_version(version) >= (2, 9) else
                         [("fp8_autocast", {"enabled": False, "fp8_recipe": want})])


def test_a_fallback_region_with_no_recipe_known_enters_no_te_autocast(fake_te, monkeypatch):
    """Outside an enabled autocast, for a layer that never ran in FP8 (an eval forward of a
    layer resumed in fallback): handed no recipe, TE 2.20.2's autocast builds its default one,
    DelayedScaling() on Hopper (pytorch/quantization.py:740, 249-254), which fails its assert
    under NVTE_BACKWARD_OVERRIDE (common/recipe/__init__.py:268-270). The stand-in autocast
    refuses a None recipe as that TE does; FP8 is off there already, so no region is needed."""
    from foundry_fp8.te import backend, probe

    fake_te("2.20.2")
    te = sys.modules["transformer_engine.pytorch"]

    def autocast(enabled: bool, recipe: object):
        if recipe is None:
            raise ValueError("Assertion failed, Delayed scaling only supports "
                             "backward_override=None.")
        raise AssertionError("not reached: FP8 is off and no recipe is known")

    te.autocast = autocast
    monkeypatch.setattr(probe, "active_recipe", lambda: None)
    layer = torch.nn.Linear(4, 4)
    layer.fp8_meta = {}  # TE's before the layer's first FP8 forward
    x = torch.randn(2, 4)
    with backend.te_high_precision(layer):
        out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_meta_layers_stay_on_meta_for_fsdp_to_initialise(fake_te):
    """TE defers init only for `device == "meta"`, which a torch.device never equals: handed
    one, TE would materialise the layer (on CUDA) and the copy from meta would fail."""
    from foundry_fp8.te import backend as te_backend

    fake_te()
    with torch.device("meta"):
        block = torch.nn.Module()
        block.norm_2, block.ffn = torch.nn.LayerNorm(64), torch.nn.Module()
        block.ffn.up_proj, block.ffn.down_proj = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    linear = te_backend.make_te_linear(block.ffn.up_proj)
    assert linear.weight.is_meta and linear.bias.is_meta
    fused = te_backend.make_te_layernorm_mlp(block, "LayerNorm", "gelu")
    assert all(p.is_meta for p in fused.parameters())
    assert te_backend.te_device(torch.empty(1)) == torch.device("cpu")


@pytest.mark.parametrize("version", ["2.20.2", "1.12.0"])
def test_layernorm_arguments_follow_the_te_version(fake_te, version):
    from foundry_fp8.te import backend as te_backend

    fake_te(version)
    src = torch.nn.LayerNorm(32, eps=1e-6)
    torch.nn.init.normal_(src.weight)
    new = te_backend.make_te_layernorm(src)
    assert torch.equal(new.weight, src.weight) and torch.equal(new.bias, src.bias)


@pytest.mark.parametrize("version", ["2.20.2", "2.2.0"])
@pytest.mark.parametrize("power_2", [True, False])
def test_current_scaling_power_of_2_reaches_the_gemm_quantizers(fake_te, version, power_2):
    """te.Linear sets its input, weight and grad quantizers' power-of-2 flag from the recipe's
    QParams (module/linear.py, _customize_quantizers_float8_current_scaling)."""
    from foundry_fp8.te import backend as te_backend

    fake_te(version)
    recipe = te_backend.to_te_recipe(FP8Recipe(scaling="current", fp8_format="E4M3",
                                               use_power_2_scales=power_2))
    assert recipe.fp8_format is _Format.E4M3
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        assert getattr(recipe, name).power_2_scale is power_2, name
    assert _CurrentScaling220.fp8_quant_fwd_inp.power_2_scale is False  # class left alone


def test_te_older_than_checked_is_refused_by_name(fake_te):
    from foundry_fp8.te import backend as te_backend

    fake_te("1.11.0")
    with pytest.raises(RuntimeError, match=r"TransformerEngine >= 1\.12, found 1\.11\.0"):
        te_backend.require_te()
    fake_te("2.1.0")
    te_backend.require_te()
    with pytest.raises(RuntimeError, match=r"'current' needs TransformerEngine >= 2\.2"):
        te_backend.to_te_recipe(FP8Recipe(scaling="current"))


def test_delayed_recipe_becomes_composers_precision_config(fake_te):
    """Composer builds `DelayedScaling(**state.precision_config)` every batch."""
    from composer.core import Precision
    from composer.core import State as ComposerState
    from composer.devices import DeviceCPU

    from foundry_fp8.composer.te_swap import _set_precision_config

    fake_te()
    state = ComposerState(model=torch.nn.Linear(2, 2), rank_zero_seed=0, run_name="x",
                          device=DeviceCPU(), precision=Precision.FP32)
    recipe = FP8Recipe(amax_history_len=7, amax_compute_algo="most_recent", margin=1)
    _set_precision_config(state, recipe)
    built = _DelayedScaling(**state.precision_config)
    assert (built.fp8_format, built.amax_history_len, built.amax_compute_algo, built.margin,
            built.reduce_amax) == (_Format.HYBRID, 7, "most_recent", 1, True)
    _set_precision_config(state, recipe)  # the same again: fine
    with pytest.raises(ValueError, match="give the recipe in one place only"):
        _set_precision_config(state, FP8Recipe(amax_history_len=8))


_RECIPE_7 = FP8Recipe(amax_history_len=7, amax_compute_algo="most_recent", margin=1)


def _state_with(precision_config: dict[str, Any]) -> Any:
    from composer.core import Precision
    from composer.core import State as ComposerState
    from composer.devices import DeviceCPU

    return ComposerState(model=torch.nn.Linear(2, 2), rank_zero_seed=0, run_name="x",
                         device=DeviceCPU(), precision=Precision.FP32,
                         precision_config=precision_config)


@pytest.mark.parametrize(("given", "recipe"), [
    ({"fp8_format": "HYBRID", "amax_history_len": 7, "amax_compute_algo": "most_recent",
      "margin": 1}, _RECIPE_7),
    ({"fp8_format": "hybrid", "amax_history_len": 7, "amax_compute_algo": "most_recent",
      "margin": 1, "reduce_amax": True, "fp8_dpa": False}, _RECIPE_7),
    ({"fp8_format": _Format.HYBRID, "amax_history_len": 7, "amax_compute_algo": "most_recent",
      "margin": 1}, _RECIPE_7),
    # Composer's own default (composer/core/precision.py); TE's defaults fill margin, reduce_amax
    ({"fp8_format": _Format.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"},
     FP8Recipe()),
    ({"fp8_format": "E4M3", "amax_history_len": 1024}, FP8Recipe(fp8_format="E4M3",
                                                                  amax_history_len=1024)),
], ids=["string", "lower-case-with-defaults", "enum", "composer-default", "te-default-history"])
def test_a_trainer_precision_config_meaning_our_recipe_is_accepted(fake_te, given, recipe):
    """Compared on meaning: a string format is the Format member of that name, and a key left
    out is TE's default. What Composer will hand TE is ours, with the Format member."""
    from foundry_fp8.composer.te_swap import _set_precision_config

    fake_te()
    state = _state_with(given)
    _set_precision_config(state, recipe)
    built = _DelayedScaling(**state.precision_config)
    assert (built.fp8_format.name, built.amax_history_len, built.amax_compute_algo, built.margin,
            built.reduce_amax) == (recipe.fp8_format, recipe.amax_history_len,
                                   recipe.amax_compute_algo, recipe.margin, recipe.reduce_amax)


@pytest.mark.parametrize("given", [
    {"fp8_format": "E4M3", "amax_history_len": 7, "amax_compute_algo": "most_recent",
     "margin": 1},
    {"fp8_format": "HYBRID", "amax_compute_algo": "most_recent", "margin": 1},  # TE's 1024
    {"fp8_format": "HYBRID", "amax_history_len": 7, "amax_compute_algo": "most_recent",
     "margin": 1, "fp8_dpa": True},
    {"fp8_format": "HYBRID", "amax_history_len": 7, "amax_compute_algo": "most_recent",
     "margin": 1, "interval": 1},
], ids=["format", "history-left-out", "fp8_dpa", "key-te-removed"])
def test_a_trainer_precision_config_meaning_another_recipe_is_refused(fake_te, given):
    from foundry_fp8.composer.te_swap import _set_precision_config

    fake_te()
    state = _state_with(given)
    with pytest.raises(ValueError, match=r"^te_swap\.fp8_recipe: the Trainer already has "
                                         r"precision_config .*give the recipe in one place only$"):
        _set_precision_config(state, _RECIPE_7)
    assert state.precision_config == given  # left as given


@pytest.mark.parametrize("spelling", ["HYBRID", "hybrid", "Format.HYBRID", _Format.HYBRID])
def test_fp8_format_spellings_are_one_format(spelling):
    recipe = FP8Recipe.from_options({"fp8_format": spelling})
    assert recipe == FP8Recipe() and recipe.format_for("backward") == "e5m2"
    assert FP8Recipe(fp8_format=spelling) == FP8Recipe()


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def _two_linears_trainer(swap: Any, **kwargs: Any) -> Any:
    """A Composer Trainer of two Linears under `swap`, on 16 random samples."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
    return Trainer(model=ComposerClassifier(_TwoLinears(), num_classes=4),
                   train_dataloader=DataLoader(data, batch_size=8), algorithms=[swap],
                   device="cpu", loggers=[], progress_bar=False, **kwargs)


def test_a_resume_from_a_checkpoint_without_the_closer_warns_of_no_private_class(tmp_path):
    """Checkpoints written before te_swap took its hooks off at Trainer.close (a2e85d1) hold no
    `_CloseWithTrainer` entry; Composer warned of it on every resume from them ("... is not in
    the state_dict"), a private, stateless class. Another callback missing from the checkpoint
    is still warned of, as Composer does."""
    import warnings

    from composer.callbacks import LRMonitor

    from foundry_fp8.composer.te_swap import TESwap

    def trainer(**kwargs: Any) -> Any:
        return _two_linears_trainer(TESwap(backend="emulate"), max_duration="2ba", **kwargs)

    first = trainer()
    first.fit()
    saved = tmp_path / "old.pt"
    from composer.utils.checkpoint import save_checkpoint

    save_checkpoint(first.state, str(saved))
    first.close()
    checkpoint = torch.load(saved, weights_only=False)
    assert "_CloseWithTrainer" in checkpoint["state"]["callbacks"]
    del checkpoint["state"]["callbacks"]["_CloseWithTrainer"]  # as written before a2e85d1
    torch.save(checkpoint, saved)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        resumed = trainer(load_path=str(saved), callbacks=[LRMonitor()])
    missing = sorted(str(w.message).split()[0] for w in seen
                     if "is not in the state_dict" in str(w.message))
    assert missing == ["LRMonitor"]  # Composer's own warning, still there for a real callback
    assert resumed.state.timestamp.batch.value == 2
    resumed.close()


def test_a_second_init_shows_a_once_warning_no_second_time():
    """QA 19: every INIT re-added te_swap's filter for the warning above, and Python clears its
    record of the warnings already shown whenever the filters change: a notebook's next Trainer
    on the same model (the next INIT) showed its `default` warnings again. The rule is Python's:
    a `default` warning is shown once per place it is raised from."""
    import warnings

    from composer.core import Event

    from foundry_fp8.composer.te_swap import TESwap

    def once() -> None:
        warnings.warn("a notebook's warning", UserWarning, stacklevel=1)

    swap = TESwap(backend="emulate")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        trainer = _two_linears_trainer(swap, max_duration="1ba")
        once()
        swap.apply(Event.INIT, trainer.state, trainer.logger)  # the INIT of the next Trainer
        once()
        trainer.close()
    assert [str(w.message) for w in seen].count("a notebook's warning") == 1
