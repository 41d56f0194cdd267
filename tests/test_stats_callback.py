"""fp8_stats in a real LLM-Foundry run, and FP8Monitor on a hand-built model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from foundry_fp8.numerics import tensor_stats
from tests.tiny_run import run_folder, run_tiny


def test_monitor_matches_tensor_stats_and_flags_the_outlier_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():  # one huge weight: current scaling crushes the rest to zero
        model[1].weight[0, 0] = 1e6
    warnings_seen: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warnings_seen.append)
    x = torch.randn(8, 32)
    monitor.start_step()
    model(x).sum().backward()
    metrics = monitor.finish_step()
    assert metrics["fp8/0/activation/amax"] == pytest.approx(tensor_stats(x)["amax"])
    assert metrics["fp8/1/weight/underflow_pct"] == pytest.approx(
        tensor_stats(model[1].weight)["underflow_pct"])
    assert metrics["fp8/1/gradient/amax"] == pytest.approx(1.0)  # d(sum)/d(output) = 1
    assert any("'1'" in w and "weight" in w for w in warnings_seen)
    assert not any("'0'" in w and "weight" in w for w in warnings_seen)
    # after the logging step no hook remains: non-logging steps cost nothing
    assert not model[0]._forward_hooks and not model[1]._backward_hooks


def test_bad_options_fail_with_the_key():
    from foundry_fp8.composer.stats import FP8Stats

    with pytest.raises(ValueError, match="fp8_stats.interval"):
        FP8Stats(interval="1ep")
    with pytest.raises(ValueError, match="fp8_stats.tensors"):
        FP8Stats(tensors=["activations"])


@pytest.mark.slow
def test_fp8_stats_logs_every_selected_layer_in_a_real_run(tmp_path, tiny_data):
    overrides = {"max_duration": "6ba", "save_interval": "6ba",
                 "callbacks": {"fp8_stats": {"interval": "3ba", "layers": r"blocks\.0\."}}}
    run_tiny(tmp_path, tiny_data, overrides)
    logged: dict[int, dict] = {}
    for step, metrics in read_jsonl(run_folder(tmp_path) / "metrics.jsonl"):
        fp8 = {k: v for k, v in metrics.items() if k.startswith("fp8/")}
        if fp8:
            logged.setdefault(step, {}).update(fp8)
    assert sorted(logged) == [0, 3]
    layers = {k.split("/")[1] for k in logged[3]}
    assert layers == {"model.transformer.blocks.0.attn.Wqkv", "model.transformer.blocks.0.attn.out_proj",
                      "model.transformer.blocks.0.ffn.up_proj", "model.transformer.blocks.0.ffn.down_proj"}
    for layer in layers:
        for tensor in ("activation", "weight", "gradient"):
            assert 0 < logged[3][f"fp8/{layer}/{tensor}/amax"] < float("inf")
            assert 0.9 < logged[3][f"fp8/{layer}/{tensor}/cos_sim"] <= 1.0
