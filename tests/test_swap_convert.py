"""`convert_to_fp8`, the one entry point (torchao's `convert_to_float8_training` shape), on a
plain PyTorch model: no Composer, no LLM-Foundry, the emulated backend on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import foundry_fp8
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.options import OptionError
from foundry_fp8.swap import SwapConfig, apply_swap, convert_to_fp8, coverage_table, plan_swap

REFUSED = "rejected by module_filter_fn"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Transformer-like names: `blocks.<n>.` holds the candidates, `head` lies outside."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _reasons(plan) -> dict[str, str]:
    return {d.name: d.reason for d in plan.decisions}


def test_a_plain_model_trains_a_step_under_the_emulated_autocast():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    asked: list[str] = []

    def keep_down(module: nn.Module, fqn: str) -> bool:
        asked.append(fqn)
        return not fqn.endswith("down")

    plan = foundry_fp8.convert_to_fp8(model, foundry_fp8.SwapConfig(backend="emulate"),
                                      module_filter_fn=keep_down, optimizers=optimizer)
    # it narrows: asked only about the layers the config's own rules leave (not `head`)
    assert sorted(asked) == [f"blocks.{b}.{p}" for b in (0, 1) for p in ("down", "up")]
    reasons = _reasons(plan)
    assert reasons["blocks.0.down"] == reasons["blocks.1.down"] == REFUSED
    assert reasons["blocks.0.up"] == "converted"
    assert reasons["head"].startswith("outside the transformer blocks")
    assert f"| no | linear | 2 | {2 * (64 * 32 + 32)} |" in coverage_table(plan)
    assert REFUSED in coverage_table(plan)
    assert [type(b.up) for b in model.blocks] == [EmulatedFP8Linear] * 2
    assert [type(b.down) for b in model.blocks] == [nn.Linear] * 2

    layer = model.blocks[0].up
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(layer.weight) in in_optimizer and id(layer.bias) in in_optimizer
    weight = layer.weight.detach().clone()
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    with fp8_autocast():
        loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    assert not torch.equal(layer.weight.detach(), weight)
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    assert fwd.amax_history[:, :2].amax(0).gt(0).all()  # input and weight amaxes recorded
    assert not torch.equal(fwd.scale[:2], torch.ones(2))  # updated when the autocast exited
    assert bwd.amax_history[:, 0].gt(0).any()  # the gradient was cast too


def test_a_filter_refusing_everything_is_te_swaps_refusal():
    """The same error, word for word, as te_swap raises for the same model in Composer."""
    from composer import Trainer
    from composer.models import ComposerClassifier

    from foundry_fp8.composer.te_swap import TESwap

    def nothing(module: nn.Module, fqn: str) -> bool:
        return False

    model = Net()
    with pytest.raises(ValueError, match="no module would run in FP8") as plain:
        convert_to_fp8(model, SwapConfig(backend="emulate"), module_filter_fn=nothing,
                       precision="fp32")
    assert REFUSED in str(plain.value)
    assert not any(isinstance(m, EmulatedFP8Linear) for m in model.modules())  # untouched
    with pytest.raises(ValueError) as composer:
        Trainer(model=ComposerClassifier(Net(), num_classes=16), device="cpu",
                algorithms=[TESwap(backend="emulate", module_filter_fn=nothing)])
    assert str(composer.value) == str(plain.value)


def test_a_filter_given_twice_is_refused():
    def accept(module: nn.Module, fqn: str) -> bool:
        return True

    config = SwapConfig(backend="emulate", module_filter_fn=accept)
    with pytest.raises(OptionError, match=r"^algorithms\.te_swap\.module_filter_fn: given both"):
        convert_to_fp8(Net(), config, module_filter_fn=lambda module, fqn: True)
    assert len(convert_to_fp8(Net(), config, module_filter_fn=accept).converted) == 4  # same one


def test_converting_again_keeps_the_fp8_layers_and_their_state():
    model = Net()
    first = convert_to_fp8(model, SwapConfig(backend="emulate"))
    layer = model.blocks[0].up
    with fp8_autocast():
        model(torch.randn(4, 32))
    state = layer.fp8_meta["scaling_fwd"].amax_history.clone()
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"))  # its FP8 layers run: no error
    assert not plan.converted
    assert _reasons(plan)["blocks.0.up"] == "already in FP8 (EmulatedFP8Linear)"
    assert model.blocks[0].up is layer
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, state)
    # still in FP8, and counted so: 4 block GEMMs of 2*32*64 FLOPs, the head's 2*32*16 kept
    assert plan.fp8_flops_share == first.fp8_flops_share == pytest.approx(4 / 4.25)
    assert "| yes | linear | 4 | 8384 | 94.1% | already in FP8 (EmulatedFP8Linear) |" \
        in coverage_table(plan)


@pytest.mark.parametrize(("precision", "share"), [("amp_fp8", 16 / 17), ("bf16", 4 / 17)])
def test_the_models_own_te_modules_count_in_fp8_under_amp_fp8_only(fake_te, precision, share):
    """A model built with TE layers (LLM-Foundry's `fc_type: te`, `ffn_type: te_ln_mlp`): they
    are in the plan with their FLOPs; TE runs them in FP8 under Composer's amp_fp8 alone."""
    fake_te()
    import transformer_engine.pytorch as te

    model = Net()
    model.blocks[0].up = te.Linear(32, 64, device="cpu")
    model.blocks[1] = te.LayerNormMLP(32, 64, device="cpu")  # fc1 + fc2: 2 GEMMs
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), precision=precision)
    assert [d.name for d in plan.converted] == ["blocks.0.down"]
    by_name = {d.name: d for d in plan.decisions}
    mlp = by_name["blocks.1"]
    assert (mlp.kind, mlp.in_fp8, mlp.flops) == ("ln_mlp", precision == "amp_fp8", 2 * 4096)
    assert (by_name["blocks.0.up"].in_features, by_name["blocks.0.up"].out_features) == (32, 64)
    # 4 GEMMs of 2*32*64 FLOPs and the head's 2*32*16 in all; in FP8: the emulated down_proj,
    # and under amp_fp8 TE's three
    assert plan.fp8_flops_share == pytest.approx(share)
    expected = ("already in FP8 (te.Linear)" if precision == "amp_fp8" else
                "te.Linear built by the model: FP8 only under amp_fp8, not bf16")
    assert by_name["blocks.0.up"].reason == expected


def test_apply_swap_converts_with_the_plans_backend_only():
    """The backend the plan checked its decisions for (an override could have been `te` with a
    plan made for `emulate`)."""
    model = Net()
    plan = plan_swap(model, SwapConfig(backend="emulate"))
    with pytest.raises(TypeError):
        apply_swap(model, plan, "te")  # type: ignore[misc]
    assert apply_swap(model, plan) == 4
    assert type(model.blocks[1].down) is EmulatedFP8Linear


def test_the_docs_python_api_example_runs(capsys):
    """docs/te_swap.md's `convert-to-fp8` block, run as it stands."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "te_swap.md").read_text()
    [example] = re.findall(r"^```python convert-to-fp8\n(.*?)^```", doc, flags=re.M | re.S)
    exec(compile(example, "docs/te_swap.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "| yes | linear | 5 |" in out and f"| no | linear | 1 | {64 * 256 + 256} |" in out
    assert REFUSED in out
    losses = [float(line.split()[1]) for line in out.splitlines() if re.match(r"^\d \S+$", line)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_model_built_on_meta_converts_and_trains_once_materialized():
    """LLM-Foundry's `init_device: meta`: te_swap converts before the weights exist; the
    emulated FP8 state stays off `meta` (a real device's tensors), and after `to_empty` and an
    init the layers cast with the scales TE's delayed update gives the recorded amaxes."""
    with torch.device("meta"):
        net = Net()
    convert_to_fp8(net, SwapConfig(backend="emulate", keep_first_blocks=0, keep_last_blocks=0))
    layer = net.blocks[0].up
    assert isinstance(layer, EmulatedFP8Linear) and layer.weight.is_meta
    net.to_empty(device="cpu")
    torch.manual_seed(1)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.1)
            nn.init.zeros_(module.bias)
    x = torch.randn(8, 32)
    with fp8_autocast():
        net(x).sum().backward()
    meta = layer.fp8_meta["scaling_fwd"]
    assert meta.scale.device.type == "cpu"
    # TE's delayed update: scale = fp8_max / amax of the one recorded step (E4M3: 448)
    assert meta.scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    assert meta.scale[1].item() == pytest.approx(448 / layer.weight.abs().max().item(), rel=1e-6)


def test_a_raising_module_filter_fn_is_named_with_the_module_it_failed_on():
    """A user's filter that raises on one module: before, its bare KeyError ('up') reached the
    user naming neither the option nor the module."""
    def by_table(module: nn.Module, fqn: str) -> bool:
        return {"down": True}[fqn.rsplit(".", 1)[-1]]  # no entry for `up`

    with pytest.raises(OptionError) as raised:
        convert_to_fp8(Net(), SwapConfig(backend="emulate"), module_filter_fn=by_table)
    assert str(raised.value).startswith("algorithms.te_swap.module_filter_fn: raised KeyError: "
                                        "'up' on module 'blocks.0.up' (fix: ")
    assert isinstance(raised.value.__cause__, KeyError)
