"""`fp8_state_dict` / `load_fp8_state_dict`: a plain loop's FP8 scaling state, saved beside
`model.state_dict()` and checked as `fp8_state` checks it before it is written back.

Expectations are computed here from the formats, not read from the package: E4M3's largest
value is 448 and E5M2's 57344 (OCP FP8 spec; TE `common/recipe/__init__.py` Format), HYBRID
casts forward tensors in E4M3 and gradients in E5M2, and TE's delayed scale is
`fp8_max * 2**-margin / amax` (`common/recipe/delayed_scaling.cu`)."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest
import torch

from foundry_fp8 import (
    FP8Recipe,
    SwapConfig,
    convert_to_fp8,
    fp8_autocast,
    fp8_state_dict,
    load_fp8_state_dict,
)
from foundry_fp8.fp8_meta import read_fp8_meta

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
RECIPE = FP8Recipe(amax_history_len=4)
BATCHES = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(5)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
            for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _build() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8(model, SwapConfig(backend="emulate"), optimizers=optimizer, precision="fp32")
    return model, optimizer


def _train(model: Net, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
           recipe: FP8Recipe = RECIPE) -> list[float]:
    losses = []
    for x in batches:
        with fp8_autocast(recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture
def saved() -> dict:
    model, optimizer = _build()
    _train(model, optimizer, BATCHES[:2])
    return fp8_state_dict(model, recipe=RECIPE)


def _meta(model: torch.nn.Module) -> dict:
    return {n: read_fp8_meta(m) for n, m in model.named_modules() if read_fp8_meta(m)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def test_a_resume_through_a_weights_only_file_is_bit_exact():
    model, optimizer = _build()
    want = _train(model, optimizer, BATCHES)[2:]
    want_meta = _meta(model)
    model, optimizer = _build()
    _train(model, optimizer, BATCHES[:2])
    file = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "fp8": fp8_state_dict(model, recipe=RECIPE)}, file)
    file.seek(0)
    checkpoint = torch.load(file, weights_only=True)
    model, optimizer = _build()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    load_fp8_state_dict(model, checkpoint["fp8"], recipe=RECIPE)
    assert _train(model, optimizer, BATCHES[2:]) == want
    assert _same(_meta(model), want_meta)
    # the state after two steps: a delayed scale from a recorded amax, not TE's initial 1
    first = checkpoint["fp8"]["modules"]["layers.0.0"]
    amax = first["fwd_amax_history"][1:, 0].max()
    assert first["fwd_scale"][0].item() == pytest.approx(E4M3_MAX / amax.item(), rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_poisoned_scale_is_refused_naming_module_and_field_and_nothing_is_written(saved, bad):
    saved["modules"]["layers.1.0"]["bwd_scale"][0] = bad
    model, _ = _build()
    before = _meta(model)
    with pytest.raises(ValueError, match=rf"^load_fp8_state_dict: refused: layers\.1\.0\."
                                         rf"bwd_scale: {bad:g} is not a scale") as error:
        load_fp8_state_dict(model, saved, recipe=RECIPE)
    assert "\n" not in str(error.value)
    assert _same(_meta(model), before)  # another module's state was not written either


@pytest.mark.parametrize(("factor", "refused"), [(1.01, True), (0.99, False)])
def test_a_history_amax_the_scale_cannot_come_from_is_refused(saved, factor, refused):
    tensors = saved["modules"]["layers.2.0"]
    # an amax above 448 / scale: cast with this scale it would have overflowed E4M3
    tensors["fwd_amax_history"][2, 1] = E4M3_MAX / tensors["fwd_scale"][1].item() * factor
    model, _ = _build()
    if refused:
        with pytest.raises(ValueError, match=r"layers\.2\.0\.fwd_amax_history: amax .* is more "
                                             r"than scale .* allows"):
            load_fp8_state_dict(model, saved, recipe=RECIPE)
    else:
        load_fp8_state_dict(model, saved, recipe=RECIPE)
        assert torch.equal(read_fp8_meta(model.layers[2][0])["fwd_amax_history"][1:],
                           tensors["fwd_amax_history"][1:])


def test_wrong_shapes_are_refused(saved):
    saved["modules"]["layers.0.2"]["fwd_amax_history"] = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"layers\.0\.2\.fwd_amax_history: shape \(4, 2\), "
                                         r"expected \[rows, 3\]"):
        load_fp8_state_dict(_build()[0], saved, recipe=RECIPE)


def test_state_of_two_gemms_does_not_fit_a_one_gemm_layer(saved):
    saved["modules"]["layers.0.2"] = {"fwd_scale": torch.ones(6), "fwd_amax_history":
                                      torch.zeros(4, 6), "bwd_scale": torch.ones(4),
                                      "bwd_amax_history": torch.zeros(4, 4)}
    model, _ = _build()
    with fp8_autocast(recipe=RECIPE):  # the layers' histories sized, as after a first step
        model(BATCHES[0])
    with pytest.raises(ValueError, match=r"does not fit the model .*: layers\.0\.2\.fwd_scale "
                                         r"has shape \(6,\) in the checkpoint, \(3,\)"):
        load_fp8_state_dict(model, saved, recipe=RECIPE)


def test_missing_and_extra_modules_are_refused_and_repaired_without_strict(saved, caplog):
    saved["modules"]["layers.9.0"] = saved["modules"].pop("layers.2.2")
    with pytest.raises(ValueError, match=r"1 without saved state \(layers\.2\.2\); 1 saved, "
                                         r"not in the model \(layers\.9\.0\)"):
        load_fp8_state_dict(_build()[0], saved, recipe=RECIPE)
    model, _ = _build()
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.plain_state"):
        load_fp8_state_dict(model, saved, recipe=RECIPE, strict=False)
    assert "continuing with the modules in both restored" in caplog.text
    assert torch.equal(read_fp8_meta(model.layers[0][0])["fwd_scale"],
                       saved["modules"]["layers.0.0"]["fwd_scale"])
    assert torch.equal(read_fp8_meta(model.layers[2][2])["fwd_scale"], torch.ones(3))


def test_a_recipe_change_is_refused_and_fitted_as_te_does_without_strict(saved):
    longer = FP8Recipe(amax_history_len=8)
    with pytest.raises(ValueError, match=r"recipe changed: amax_history_len 4 -> 8"):
        load_fp8_state_dict(_build()[0], saved, recipe=longer)
    model, _ = _build()
    load_fp8_state_dict(model, saved, recipe=longer, strict=False)
    history = saved["modules"]["layers.1.2"]["bwd_amax_history"]
    want = torch.cat([history, torch.zeros(4, 2)])  # TE's adjust_amax_history_length: pad
    assert torch.equal(read_fp8_meta(model.layers[1][2])["bwd_amax_history"], want)


def test_a_format_change_recomputes_the_gradient_scales_without_strict(saved):
    model, _ = _build()
    load_fp8_state_dict(model, saved, recipe=FP8Recipe(amax_history_len=4, fp8_format="E4M3"),
                        strict=False)
    amax = saved["modules"]["layers.0.0"]["bwd_amax_history"][1:, 0].max().item()
    assert amax > 0
    # E5M2's scale 57344 / amax becomes E4M3's 448 / amax
    assert read_fp8_meta(model.layers[0][0])["bwd_scale"][0].item() == pytest.approx(
        E4M3_MAX / amax, rel=1e-5)
    assert saved["modules"]["layers.0.0"]["bwd_scale"][0].item() == pytest.approx(
        E5M2_MAX / amax, rel=1e-5)


def test_a_recipe_not_given_at_load_is_the_saved_one(saved):
    saved["modules"]["layers.0.0"]["fwd_amax_history"] = torch.zeros(5, 3)
    with pytest.raises(ValueError, match=r"layers\.0\.0\.fwd_amax_history: 5 rows do not fit "
                                         r"the recipe's 4"):
        load_fp8_state_dict(_build()[0], saved)


def test_what_is_not_fp8_state_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^load_fp8_state_dict: not FP8 state as fp8_state_dict "
                                         r"saves it \(modules\.a\.fwd_scale: expected a tensor, "
                                         r"got list\)$"):
        load_fp8_state_dict(_build()[0], {"modules": {"a": {"fwd_scale": [1.0]}}})


def test_te_modules_round_trip_through_fp8_meta_and_need_state_to_write_into(fake_te):
    """`backend: te` (the stand-in TE: no FP8 forward on CPU, so the state of TE's first FP8
    forward is planted as TE lays it out: scale [3 per GEMM], amax_history [len, 3])."""
    fake_te("2.20.2")

    def build() -> Net:
        torch.manual_seed(0)
        model = Net()
        convert_to_fp8(model, SwapConfig(backend="te"))
        return model

    def plant(module: torch.nn.Module, scale: float) -> None:
        module.fp8_meta.update({
            key: SimpleNamespace(scale=torch.full((n,), scale), amax_history=torch.zeros(4, n))
            for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2))})

    model = build()
    assert not any("extra_state" in key for key in model.state_dict())
    before = fp8_state_dict(model, recipe=RECIPE)
    # no state before the first FP8 forward (nor ever under current scaling): known, empty
    assert before["modules"] == {f"layers.{i}.{j}": {} for i in range(3) for j in (0, 2)}
    load_fp8_state_dict(build(), before, recipe=RECIPE)  # nothing to restore, nothing missing
    for i, layer in enumerate(model.layers):
        plant(layer[0], 2.0 ** i)
        plant(layer[2], 2.0 ** -i)
    saved = fp8_state_dict(model, recipe=RECIPE)
    assert sorted(saved["modules"]) == [f"layers.{i}.{j}" for i in range(3) for j in (0, 2)]
    target = build()
    with pytest.raises(ValueError, match=r"layers\.0\.0: a TE module holds no FP8 state before "
                                         r"its first FP8 forward: call load_fp8_state_dict "
                                         r"inside TE's autocast"):
        load_fp8_state_dict(target, saved, recipe=RECIPE)
    for layer in target.layers:
        plant(layer[0], 1.0)
        plant(layer[2], 1.0)
    load_fp8_state_dict(target, saved, recipe=RECIPE)
    assert torch.equal(target.layers[2][0].fp8_meta["scaling_fwd"].scale, torch.full((3,), 4.0))
    assert torch.equal(target.layers[1][2].fp8_meta["scaling_bwd"].scale, torch.full((2,), 0.5))


def test_without_strict_a_poisoned_column_starts_fresh_as_te_starts_a_module(saved, caplog):
    tensors = saved["modules"]["layers.1.0"]
    tensors["fwd_scale"][1] = float("nan")
    model, _ = _build()
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.plain_state"):
        load_fp8_state_dict(model, saved, recipe=RECIPE, strict=False)
    assert "layers.1.0.fwd_scale: nan is not a scale" in caplog.text
    restored = read_fp8_meta(model.layers[1][0])
    want_scale = tensors["fwd_scale"].clone()
    want_scale[1] = 1.0  # TE's initial scale, and no amax recorded in that column
    assert torch.equal(restored["fwd_scale"], want_scale)
    assert not restored["fwd_amax_history"][:, 1].any()
    assert torch.equal(restored["fwd_amax_history"][1:, 0], tensors["fwd_amax_history"][1:, 0])
