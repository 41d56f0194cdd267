"""FP8Monitor's tensor dumps (safetensors, size cap) and its fit-end summary of worst values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule, fold_worst, render_summary
from foundry_fp8.recipe import FP8Recipe


def _train_steps(tmp_path, steps: int, dump_max_mb: float = 64.0):
    """Steps 0..steps-1 with a dump at step 1 of layer '0' only; returns what the layer saw at
    step 1 (captured by our own hooks), the metrics per step, the warnings and the model."""
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(8, 16), nn.Linear(16, 4))
    config = MonitorConfig(dump_layers="^0$", dump_folder=tmp_path, dump_max_mb=dump_max_mb)
    warned: list[str] = []
    monitor = FP8Monitor(model, config, on_warning=warned.append,
                         schedule=Schedule(interval=100, dump_steps=(1,)))
    seen: dict[str, torch.Tensor] = {}
    logged = {}
    for step in range(steps):
        x = torch.randn(5, 8) * (step + 1)
        monitor.start_step(step)
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=4)):
            hidden = model[0](x)
        if step == 1:
            seen.update({"0/activation": x.clone(), "0/weight": model[0].weight.detach().clone()})
            hidden.register_hook(lambda g: seen.__setitem__("0/gradient", g.clone()))
        model[1](hidden).pow(2).sum().backward()
        logged[step] = monitor.finish_step()
    return seen, logged, warned, model


def test_dump_round_trips_the_tensors_and_scales_the_layer_saw(tmp_path):
    seen, logged, warned, model = _train_steps(tmp_path, 3)
    assert sorted(logged) == [0, 1, 2] and logged[2] == {}  # step 1 logs because it dumps
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["step0000001-rank0.safetensors"]
    dump = load_file(tmp_path / files[0])
    assert sorted(dump) == sorted([*seen, *(f"{k}/scale" for k in seen)])  # layer '1' excluded
    for key, tensor in seen.items():
        assert torch.equal(dump[key], tensor), key
        assert dump[f"{key}/scale"].item() == logged[1][f"fp8/{key}/scale"]
    # the delayed scales in force at step 1: from step 0's amaxes, not 1
    assert dump["0/activation/scale"].item() == pytest.approx(
        448.0 / logged[0]["fp8/0/activation/amax"])
    assert not any("left out" in w for w in warned)


def test_dump_stops_at_the_cap_and_names_what_it_left_out(tmp_path):
    activation_bytes = 5 * 8 * 4 + 4  # the first tensor the hooks see, and its scale
    _, _, warned, _ = _train_steps(tmp_path, 2, dump_max_mb=activation_bytes / 2**20)
    dump = load_file(tmp_path / "step0000001-rank0.safetensors")
    assert sorted(dump) == ["0/activation", "0/activation/scale"]
    [message] = [w for w in warned if "left out" in w]
    assert "0/weight, 0/gradient" in message


def test_fit_end_summary_keeps_the_worst_value_of_each_statistic():
    table: dict = {}
    fold_worst(table, ("blocks.0.fc", "activation"),
               {"underflow_pct": 1.0, "overflow_pct": 0.0, "cos_sim": 0.999, "mse": 1e-4,
                "scale_ratio": 0.5})
    fold_worst(table, ("blocks.0.fc", "activation"),
               {"underflow_pct": 7.5, "overflow_pct": 0.0, "cos_sim": 0.9995, "mse": 3e-5,
                "scale_ratio": 1.25})
    fold_worst(table, ("blocks.1.fc", "weight"),
               {"underflow_pct": 0.1, "overflow_pct": float("nan"), "cos_sim": 0.98, "mse": 2e-3,
                "scale_ratio": 1.0})
    assert table[("blocks.0.fc", "activation")] == {
        "underflow_pct": 7.5, "overflow_pct": 0.0, "cos_sim": 0.999, "mse": 1e-4,
        "min_scale_ratio": 0.5, "max_scale_ratio": 1.25}
    assert "overflow_pct" not in table[("blocks.1.fc", "weight")]  # NaN is not a value
    text = render_summary(table)
    lines = text.splitlines()
    assert lines[0].startswith("| layer | tensor | underflow_pct")
    assert lines[2].startswith("| blocks.0.fc | activation | 7.5 |")  # worst underflow first
    assert render_summary({}) == ""


def test_monitor_summary_covers_every_logged_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
    cos = []
    for outlier in (1.0, 1e4, 10.0):
        x = torch.randn(4, 8)
        x[0, 0] = outlier  # the larger the outlier, the more of the rest current scaling loses
        monitor.start_step()
        model(x).sum().backward()
        cos.append(monitor.finish_step()["fp8/0/activation/cos_sim"])
    assert monitor.worst[("0", "activation")]["cos_sim"] == min(cos) < max(cos)
    assert "| 0 | activation |" in monitor.summary()


def test_dump_steps_need_a_folder():
    with pytest.raises(ValueError, match="dump_folder"):
        FP8Monitor(nn.Linear(2, 2), MonitorConfig(), schedule=Schedule(dump_steps=(3,)))
