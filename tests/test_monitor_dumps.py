"""FP8Monitor's tensor dumps (safetensors, size cap, a failed write) and its fit-end summary of
worst values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule
from foundry_fp8.recipe import FP8Recipe


def _train_steps(tmp_path, steps: int, dump_max_mb: float = 64.0, dump_steps=(1,),
                 interval: int = 100):
    """Steps 0..steps-1 with a dump at step 1 of layer '0' only; returns what the layer saw at
    step 1 (captured by our own hooks), the metrics per step, the warnings and the model."""
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(8, 16), nn.Linear(16, 4))
    config = MonitorConfig(dump_layers="^0$", dump_folder=tmp_path, dump_max_mb=dump_max_mb)
    warned: list[str] = []
    monitor = FP8Monitor(model, config, on_warning=warned.append,
                         schedule=Schedule(interval=interval, dump_steps=dump_steps))
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
        assert dump[f"{key}/scale"].item() == logged[1][layer_key("scale", *key.split("/")[::-1])]
    # the delayed scales in force at step 1: from step 0's amaxes, not 1
    assert dump["0/activation/scale"].item() == pytest.approx(
        448.0 / logged[0][layer_key("amax", "activation", "0")])
    assert not any("left out" in w for w in warned)


def test_dump_stops_at_the_cap_and_names_what_it_left_out(tmp_path):
    activation_bytes = 5 * 8 * 4 + 4  # the first tensor the hooks see, and its scale
    _, _, warned, _ = _train_steps(tmp_path, 2, dump_max_mb=activation_bytes / 2**20)
    dump = load_file(tmp_path / "step0000001-rank0.safetensors")
    assert sorted(dump) == ["0/activation", "0/activation/scale"]
    [message] = [w for w in warned if "left out" in w]
    assert "0/weight, 0/gradient" in message


def test_a_dump_that_cannot_be_written_is_skipped_and_statistics_go_on(tmp_path):
    """safetensors raises its own SafetensorError (not an OSError) for a write that fails: here
    a folder stands where step 1's file goes (as a full disk or a lost mount would fail it)."""
    (tmp_path / "step0000001-rank0.safetensors").mkdir()
    _, logged, warned, _ = _train_steps(tmp_path, 4, dump_steps=(1, 2), interval=1)
    [message] = [w for w in warned if "not written" in w]
    assert "step0000001-rank0.safetensors" in message and "statistics go on" in message
    assert all(layer_key("cos_sim", "activation", "0") in logged[step] for step in range(4))
    assert load_file(tmp_path / "step0000002-rank0.safetensors")  # the next dump is written


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
        cos.append(monitor.finish_step()[layer_key("cos_sim", "activation", "0")])
    assert monitor.tracker.worst[("0", "activation")]["cos_sim"] == min(cos) < max(cos)
    assert "| 0 | activation (what-if) |" in monitor.summary()  # a plain nn.Linear


def test_dump_steps_need_a_folder():
    with pytest.raises(ValueError, match="dump_folder"):
        FP8Monitor(nn.Linear(2, 2), MonitorConfig(), schedule=Schedule(dump_steps=(3,)))


def test_dump_file_says_what_each_tensor_is(tmp_path):
    """The file alone (safetensors' own reader, no foundry_fp8) names each tensor's layer, FP8
    format (HYBRID: E5M2 for the gradient) and whether its scale cast it; with the scale and
    format, torch's own FP8 cast redoes the layer's round trip."""
    import json

    from safetensors import safe_open

    seen, logged, _, _ = _train_steps(tmp_path, 2)
    with safe_open(str(tmp_path / "step0000001-rank0.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = json.loads(meta["tensors"])
        x, scale = f.get_tensor("0/activation"), f.get_tensor("0/activation/scale")
    assert tensors == {"0/activation": {"layer": "0", "format": "e4m3", "scale": "cast"},
                       "0/weight": {"layer": "0", "format": "e4m3", "scale": "cast"},
                       "0/gradient": {"layer": "0", "format": "e5m2", "scale": "cast"}}
    assert "tensor * scale" in meta["about"]
    scaled = (x * scale).clamp(-448, 448)
    back = scaled.to(torch.float8_e4m3fn).float() / scale
    cos = torch.nn.functional.cosine_similarity(back.flatten(), x.flatten(), dim=0)
    assert cos.item() == pytest.approx(logged[1][layer_key("cos_sim", "activation", "0")],
                                       abs=1e-6)
