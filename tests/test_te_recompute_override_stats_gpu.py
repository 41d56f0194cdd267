"""What session 15 wrote for real TE and ran only against the stand-in (tests/fake_te.py), on a
GPU: te_swap handing transformers' gradient checkpointing TE's own checkpoint (TE #1190), te_swap's
current scaling under Composer's amp_fp8 with NVTE_BACKWARD_OVERRIDE set, and fp8_stats pooling
the micro-batches of a logging step on TE's modules.

Skipped without CUDA. Written against TE 2.20.2's Python sources (the transformer_engine 2.20.2
wheel) and transformers 4.51.3 (the kit's); not yet run on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.fixture(scope="module")
def te():
    return pytest.importorskip("transformer_engine.pytorch")


# -- transformers gradient checkpointing recomputes with TE's checkpoint (TE #1190) -----------

def _llama(checkpointing: dict | None, before_swap: bool = True):
    """A 2-layer Llama on CUDA converted by te_swap (backend te); transformers' gradient
    checkpointing enabled before the swap (te_swap hands it TE's checkpoint) or after it (it
    keeps torch's, which recomputes outside TE's autocast). Eager attention: its backward is
    matmuls, the same bits every run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundry_fp8.options import SwapConfig
    from foundry_fp8.swap import convert_to_fp8

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
        attn_implementation="eager")).cuda().train()

    def enable() -> None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing or None)

    if checkpointing is not None and before_swap:
        enable()
    plan = convert_to_fp8(model, SwapConfig(backend="te"))
    if checkpointing is not None and not before_swap:
        enable()
    return model, plan


def _train_llama(te, model) -> tuple[list[torch.Tensor], dict, dict]:
    """STEPS forward/backward passes in TE's delayed-scaling autocast, new tokens each step. No
    optimizer step: every difference comes from the FP8 scales the passes use and update.
    Returns the losses, each TE module's weight gradient summed over the steps, and each TE
    module's FP8 state at the end."""
    from transformer_engine.common.recipe import DelayedScaling, Format

    from foundry_fp8.fp8_meta import is_fp8_module, read_fp8_meta

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    generator = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (4, 32), device="cuda", generator=generator)
        with te.autocast(enabled=True, recipe=recipe):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    modules = {n: m for n, m in model.named_modules() if is_fp8_module(m)}
    return (losses, {n: m.weight.grad.clone() for n, m in modules.items()},
            {n: read_fp8_meta(m) for n, m in modules.items()})


@pytest.fixture(scope="module")
def unchecked(te):
    pytest.importorskip("transformers")
    model, _ = _llama(None)
    return _train_llama(te, model)


def _differences(got, want) -> list[str]:
    losses, grads, states = got
    want_losses, want_grads, want_states = want
    problems = [f"step {i}: loss {a.item()} != {b.item()}"
                for i, (a, b) in enumerate(zip(losses, want_losses, strict=True))
                if not torch.equal(a, b)]
    problems += [f"{name}: weight.grad differs" for name in want_grads
                 if not torch.equal(grads[name], want_grads[name])]
    for name, state in want_states.items():
        problems += [f"{name}: {key} differs (got {states[name][key].flatten()[:6].tolist()}, "
                     f"want {value.flatten()[:6].tolist()})"
                     for key, value in state.items() if not torch.equal(states[name][key], value)]
    return problems


@pytest.mark.parametrize("checkpointing", [{}, {"use_reentrant": False}],
                         ids=["transformers-default-reentrant", "non-reentrant"])
def test_hf_gradient_checkpointing_recomputes_under_the_forward_s_fp8_scales(te, unchecked,
                                                                             checkpointing):
    """te_swap hands transformers TE's checkpoint; training through it gives the losses, weight
    gradients and FP8 state (backward scales and amax histories included) of the run without
    checkpointing, bit for bit (TE recomputes in its own autocast with the forward's scales,
    distributed.py:446-451 reentrant; module/base.py:1595-1599, 1649-1651 restore them)."""
    from foundry_fp8.swap import HF_CHECKPOINT_FUNC

    model, plan = _llama(checkpointing)
    assert plan.recompute == ("model",)
    assert getattr(model.model, HF_CHECKPOINT_FUNC).func is te.checkpoint
    got = _train_llama(te, model)
    assert len(unchecked[2]) == 14  # 2 layers x (4 attention + 3 MLP); lm_head kept
    problems = _differences(got, unchecked)
    assert not problems, "\n".join(problems)
    # the reference's backward scales moved: an unchanged 1.0 would equal a never-updated one
    assert all(not torch.equal(s["bwd_scale"], torch.ones_like(s["bwd_scale"]))
               for s in unchecked[2].values())


def test_torch_s_checkpoint_left_in_place_updates_no_backward_scale(te, unchecked):
    """The sensitivity check for the test above: gradient checkpointing enabled after te_swap
    keeps torch's reentrant checkpoint, which recomputes outside TE's autocast: the backward
    runs in high precision, records no gradient amax and never updates a backward scale
    (the #1190 symptom the test above would catch)."""
    from foundry_fp8.swap import HF_CHECKPOINT_FUNC

    model, plan = _llama({}, before_swap=False)
    assert plan.recompute == ()
    assert getattr(model.model, HF_CHECKPOINT_FUNC).func is torch.utils.checkpoint.checkpoint
    got = _train_llama(te, model)
    for name, state in got[2].items():
        assert torch.equal(state["bwd_scale"], torch.ones_like(state["bwd_scale"])), name
        assert not state["bwd_amax_history"].any(), name
    assert _differences(got, unchecked)


# -- Composer's amp_fp8 recipe beside te_swap's current scaling, NVTE_BACKWARD_OVERRIDE set ----

#: Run in a fresh interpreter: TE reads NVTE_BACKWARD_OVERRIDE once, at import, into its recipe
#: classes' `backward_override` default (common/recipe/__init__.py:261, 312 in 2.20.2).
_OVERRIDE_RUN = r"""
import json, sys
import torch
from composer import Trainer
from composer.core import Callback
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformer_engine.common.recipe import DelayedScaling, Format
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.te.probe import active_recipe

try:  # Composer's default precision_config, as it builds it without te_swap's fix
    DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    bare = "built"
except Exception as err:  # pydantic's ValidationError around TE's failed assert
    bare = f"{type(err).__name__}: {err}"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))

class Seen(Callback):
    def __init__(self):
        self.seen = []
    def fit_start(self, state, logger):
        for module in state.model.modules():
            if type(module).__module__.startswith("transformer_engine"):
                module.register_forward_pre_hook(lambda m, a: self.seen.append(
                    (type(active_recipe()).__name__, active_recipe().backward_override)))

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 64), torch.randint(0, 64, (64,)))
seen = Seen()
trainer = Trainer(model=ComposerClassifier(Net(), num_classes=64),
                  train_dataloader=DataLoader(data, batch_size=16), max_duration="2ba",
                  precision="amp_fp8", device="gpu", progress_bar=False,
                  algorithms=[TESwap(backend="te", fp8_recipe={"scaling": "current"})],
                  callbacks=[seen])
trainer.fit()
config = dict(trainer.state.precision_config)
print("RESULT " + json.dumps({
    "bare": bare, "seen": sorted({f"{kind} {override}" for kind, override in seen.seen}),
    "calls": len(seen.seen),
    "backward_override": config.get("backward_override", "missing"),
    "loss": trainer.state.loss.item(), "batches": int(trainer.state.timestamp.batch)}))
"""


def test_composer_s_delayed_recipe_builds_beside_current_scaling_under_the_override(te):
    """With NVTE_BACKWARD_OVERRIDE=dequantized TE's DelayedScaling fails its constructor's
    assert (pydantic's ValidationError); Composer's amp_fp8 builds one on every batch, so te_swap gives it backward_override=None
    (te.backend.composer_delayed_kwargs). The run trains its 2 batches; TE's modules run
    under te_swap's Float8CurrentScaling carrying the variable's value."""
    env = {**os.environ, "NVTE_BACKWARD_OVERRIDE": "dequantized"}
    done = subprocess.run([sys.executable, "-c", _OVERRIDE_RUN], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    # the variable reached TE (common/recipe/__init__.py:268-270 in 2.20.2)
    assert "Delayed scaling only supports backward_override=None" in result["bare"], result
    assert result["backward_override"] is None, result
    assert result["batches"] == 2 and result["calls"] == 2 * 2, result  # 2 modules x 2 batches
    assert result["seen"] == ["Float8CurrentScaling dequantized"], result
    assert torch.isfinite(torch.tensor(result["loss"])), result


# -- fp8_stats pools every micro-batch of a logging step, on TE's modules ----------------------

BATCH, MICROBATCH, FEATURES = 32, 16, 64  # TE's FP8 GEMMs want rows % 8, features % 16
NAN_STEP, NAN_SAMPLE = 2, BATCH - 1  # in the last batch's last micro-batch


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def test_fp8_stats_pools_the_micro_batches_of_te_modules(te):
    """Composer runs each batch as 2 micro-batches, each in its own amp_fp8 autocast; fp8_stats'
    amax and NaN count on te.Linear's input and output gradient are those of the whole batch.
    Reference: the test's own hooks on the same te.Linear modules, one entry per micro-batch,
    reduced with plain torch (the first micro-batch of each batch is 10x smaller, so the first
    one alone would not match)."""
    from composer import Trainer
    from composer.core import Callback
    from composer.loggers import InMemoryLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.health import layer_key

    class Captured(Callback):
        def __init__(self) -> None:
            self.by_batch: dict[int, dict[str, list[float]]] = {}
            self.types: set[str] = set()

        def fit_start(self, state, logger) -> None:
            blocks = state.model.module.blocks
            self.types = {type(b).__module__.split(".")[0] for b in blocks}

            def forward(module, args) -> None:
                x = args[0].detach()
                now = self.by_batch[int(state.timestamp.batch)]
                now.setdefault("x_amax", []).append(x.nan_to_num(0.0).abs().max().item())
                now.setdefault("x_nan", []).append(float(x.isnan().sum()))

            def backward(module, grad_output) -> None:
                now = self.by_batch[int(state.timestamp.batch)]
                now.setdefault("dy_amax", []).append(grad_output[0].abs().max().item())

            blocks[0].register_forward_pre_hook(forward)
            blocks[1].register_full_backward_pre_hook(backward)

        def before_train_batch(self, state, logger) -> None:
            self.by_batch[int(state.timestamp.batch)] = {}

    torch.manual_seed(0)
    x = torch.randn(4 * BATCH, FEATURES)
    for start in range(0, 4 * BATCH, BATCH):
        x[start:start + MICROBATCH] *= 0.1
    x[NAN_STEP * BATCH + NAN_SAMPLE, :3] = float("nan")
    data = TensorDataset(x, torch.randint(0, 16, (4 * BATCH,)))
    net = _Blocks()
    captured, memory = Captured(), InMemoryLogger()
    Trainer(model=ComposerClassifier(net, num_classes=16),
            train_dataloader=DataLoader(data, batch_size=BATCH), max_duration="3ba",
            device_train_microbatch_size=MICROBATCH, device="gpu", precision="amp_fp8",
            progress_bar=False, optimizers=torch.optim.SGD(net.parameters(), lr=0.0),
            algorithms=[TESwap(backend="te", fp8_recipe={"amax_history_len": 4})],
            callbacks=[FP8Stats(interval=1, image_interval=None), captured],
            loggers=[memory]).fit()

    def logged(stat: str, tensor: str, layer: str) -> dict[int, float]:
        return {int(t.batch): v for t, v in memory.data[layer_key(stat, tensor, layer)]}

    assert captured.types == {"transformer_engine"}
    assert {b: len(c["x_amax"]) for b, c in captured.by_batch.items()} == {0: 2, 1: 2, 2: 2}
    x_amax = {b: max(c["x_amax"]) for b, c in captured.by_batch.items()}
    dy_amax = {b: max(c["dy_amax"]) for b, c in captured.by_batch.items()
               if all(v == v for v in c["dy_amax"])}
    assert logged("amax", "activation", "module.blocks.0") == pytest.approx(x_amax, rel=1e-6)
    assert {b: v for b, v in logged("amax", "gradient", "module.blocks.1").items()
            if b in dy_amax} == pytest.approx(dy_amax, rel=1e-6)
    assert logged("nan_count", "activation", "module.blocks.0") == {
        b: sum(c["x_nan"]) for b, c in captured.by_batch.items()} == {0: 0, 1: 0, 2: 3}
