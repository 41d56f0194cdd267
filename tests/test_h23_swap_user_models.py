"""`convert_to_fp8` on models as users bring them outside LLM-Foundry: a linear layer whose
weight is computed (torch's parametrizations, the hook-based weight_norm) stays in high
precision with its reason, where the plan used to stop with a bare `KeyError: <id>`; a model
already wrapped by FSDP1, FSDP2 or DDP is refused in one line naming the fix (convert, then
wrap), where FSDP2 failed deep in DTensor's dispatch, FSDP1 without use_orig_params with a bare
KeyError, DDP with Composer's module surgery's TypeError, and FSDP1 with use_orig_params
(NO_SHARD) converted silently, the new parameters training outside FSDP."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.swap import coverage_table

EMULATE = SwapConfig(backend="emulate")


class Net(nn.Module):
    """Two blocks of one 32x32 linear each (`layers.<n>.`: te_swap's blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _parametrized() -> nn.Linear:
    return nn.utils.parametrizations.weight_norm(nn.Linear(32, 32))


def _hooked() -> nn.Linear:
    with warnings.catch_warnings():  # torch's deprecation of the hook-based weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(nn.Linear(32, 32))


@pytest.mark.parametrize(("make", "reason", "params"), [
    # weight_norm's g [32, 1] and v [32, 32], and the bias
    (_parametrized, "parametrized weight (torch.nn.utils.parametrize", 32 + 32 * 32 + 32),
    (_hooked, "weight set by a hook, not a parameter of its own", 32 + 32 * 32 + 32),
])
def test_a_computed_weight_stays_with_its_reason_and_the_rest_trains_in_fp8(make, reason,
                                                                            params):
    torch.manual_seed(0)
    model = Net()
    model.layers[1][0] = make()
    keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = convert_to_fp8(model, EMULATE, optimizers=optimizer)

    kept = [d for d in plan.decisions if not d.convert]
    assert [(d.name, d.params) for d in kept] == [("layers.1.0", params)]
    assert kept[0].reason.startswith(reason), coverage_table(plan)
    assert type(model.layers[0][0]) is EmulatedFP8Linear
    assert type(model.layers[1][0]) is not EmulatedFP8Linear  # the user's own, untouched
    assert list(model.state_dict()) == keys
    # the kept layer still trains through its own function: g and v get gradients
    g = next(p for n, p in model.layers[1][0].named_parameters() if n.endswith(("0", "_g")))
    before = g.detach().clone()
    with fp8_autocast(recipe=FP8Recipe()):
        loss = model(torch.randn(16, 32)).square().mean()
    loss.backward()
    optimizer.step()
    assert not torch.equal(g, before)


def _wrap_fsdp1(model: Net, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, use_orig_params=use_orig_params,
                                    device_id=torch.device("cpu"))


def _wrap_fsdp2(model: Net) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


WRAPS = {
    "fsdp1_orig_params": (lambda m: _wrap_fsdp1(m, True), "FSDP (the model itself)"),
    "fsdp1_flat": (lambda m: _wrap_fsdp1(m, False), "FSDP (the model itself)"),
    "fsdp2": (_wrap_fsdp2, "FSDP2 fully_shard (layers.0)"),
    "ddp": (nn.parallel.DistributedDataParallel, "DDP (the model itself)"),
}


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_wrapped_model_is_refused_in_one_line_and_left_as_it_was(one_rank_group, wrap):
    make, where = WRAPS[wrap]
    with warnings.catch_warnings():  # FSDP1: NO_SHARD on one rank
        warnings.simplefilter("ignore", UserWarning)
        wrapped = make(Net())
    with pytest.raises(ValueError) as error:
        convert_to_fp8(wrapped, EMULATE)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("te_swap: ")
    assert f"layers.0.0 would convert to FP8 inside {where}" in message
    assert "call convert_to_fp8 before wrapping the model" in message
    assert not any(isinstance(m, EmulatedFP8Linear) for m in wrapped.modules())


def test_converted_then_wrapped_converts_again_as_already_in_fp8(one_rank_group):
    """A second Trainer's te_swap on the model the first one converted and Composer then wrapped:
    nothing left to convert, so nothing refused."""
    model = Net()
    convert_to_fp8(model, EMULATE)
    wrapped = _wrap_fsdp2(model)
    plan = convert_to_fp8(wrapped, EMULATE)
    assert [d.reason for d in plan.decisions] == ["already in FP8 (EmulatedFP8Linear)"] * 2


class Looped(nn.Module):
    """A weight-shared (looped) stack: block 2 is block 0's linear again, registered twice."""

    def __init__(self) -> None:
        super().__init__()
        shared, own = nn.Linear(32, 32), nn.Linear(32, 32)
        self.layers = nn.ModuleList(nn.Sequential(m) for m in (shared, own, shared))


@pytest.mark.parametrize(("options", "reason"), [
    ({"keep_last_blocks": 1}, "block 2 kept in high precision (keep_first/last_blocks)"),
    ({"exclude": r"^layers\.2\."}, "matched by exclude"),
    ({"module_filter_fn": lambda module, fqn: not fqn.startswith("layers.2.")},
     "rejected by module_filter_fn"),
])
def test_a_module_registered_twice_stays_where_any_of_its_names_is_kept(options, reason):
    """torch's `named_modules()` names a module once, so the options saw only `layers.0.0` and
    converted the linear that also runs in kept block 2, and `exclude` warned that it matched no
    module name."""
    model = Looped()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "matches no module name" warning
        plan = convert_to_fp8(model, SwapConfig(backend="emulate", **options))
    kept = {d.name: d.reason for d in plan.decisions if not d.convert}
    assert kept == {"layers.0.0": f"{reason}, as layers.2.0 (this module runs there too)"}
    assert [type(block[0]) for block in model.layers] == [nn.Linear, EmulatedFP8Linear, nn.Linear]


def test_multihead_attention_projections_are_counted_and_kept_not_claimed():
    """nn.MultiheadAttention hands `in_proj_weight` and `out_proj.weight` to
    F.multi_head_attention_forward, which multiplies them itself: the `out_proj` Linear is never
    called. te_swap converted it and counted it in FP8 (the table said 100 % of a
    TransformerEncoder's linear FLOPs), while it never cast (an empty amax history) and the
    in_proj GEMMs were in no share at all."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    plan = convert_to_fp8(model, EMULATE)
    rows = {d.name: (d.convert, d.reason, d.flops) for d in plan.decisions}
    for n in range(2):
        assert rows[f"layers.{n}.linear1"] == (True, "converted", 2 * 64 * 128)
        assert rows[f"layers.{n}.self_attn.out_proj"][:2] == (
            False, "nn.MultiheadAttention's out_proj: F.multi_head_attention_forward multiplies "
            "its weight itself and never calls it, so a converted one would not run in FP8")
        assert rows[f"layers.{n}.self_attn.in_proj"] == (
            False, "nn.MultiheadAttention's in_proj: a weight that F.multi_head_attention_forward"
            " multiplies itself, no layer to convert", 3 * 2 * 64 * 64)
        assert type(model.layers[n].self_attn.out_proj) is not EmulatedFP8Linear
    # per token and layer: q, k, v and out 64x64, linear1 and linear2 64x128: half in FP8
    assert plan.total_flops == 2 * (4 * 2 * 64 * 64 + 2 * 2 * 64 * 128)
    assert plan.fp8_flops_share == 0.5
    with fp8_autocast(recipe=FP8Recipe()):
        model(torch.randn(2, 16, 64)).sum().backward()
    assert all(len(m.fp8_meta["scaling_fwd"].amax_history) > 0
               for m in model.modules() if isinstance(m, EmulatedFP8Linear))


class Scaled(nn.Linear):
    """A user's linear layer with its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_linear_subclass_with_its_own_forward_keeps_it():
    """Converted, it computed nn.Linear's forward: the model's outputs changed silently (by
    1.13 at most in this net, outside any FP8 region)."""
    model = Net()
    model.layers[1][0] = Scaled(32, 32)
    plan = convert_to_fp8(model, EMULATE)
    kept = {d.name: d.reason for d in plan.decisions if not d.convert}
    assert kept == {"layers.1.0": "Scaled: an nn.Linear subclass with its own forward, which a "
                                  "converted layer would not compute"}
    assert type(model.layers[1][0]) is Scaled


def test_fp8_monitor_watches_only_layers_whose_hooks_run():
    """FP8Monitor selected nn.MultiheadAttention's out_proj, whose hooks never run: a layer in
    the watch list that never reported a statistic."""
    from foundry_fp8.monitor import FP8Monitor
    from foundry_fp8.options import MonitorConfig, Schedule

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
    monitor = FP8Monitor(model, MonitorConfig(), schedule=Schedule(interval="1ba"))
    assert sorted(monitor.layers) == ["layers.0.linear1", "layers.0.linear2"]
    monitor.start_step(0)
    model(torch.randn(2, 16, 64)).sum().backward()
    metrics = monitor.finish_step()
    assert all(f"fp8_amax/activation/{name}" in metrics for name in monitor.layers)


def test_an_optimizer_built_before_the_conversion_still_trains_the_emulated_layers():
    """The usual script builds its optimizer first. The emulated layers held new Parameter
    objects, so an optimizer not handed to convert_to_fp8 stepped the old ones: the converted
    layers never trained, without a word. They keep the model's own parameters now, as
    torchao's Float8Linear does."""
    torch.manual_seed(0)
    model = Net()
    before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8(model, EMULATE)
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))
    weight = model.layers[0][0].weight.detach().clone()
    with fp8_autocast(recipe=FP8Recipe()):
        loss = model(torch.randn(16, 32)).square().mean()
    loss.backward()
    optimizer.step()
    assert not torch.equal(model.layers[0][0].weight, weight)
