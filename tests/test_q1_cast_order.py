"""A fault spreads within its step in the order the step casts tensors: a NaN in one layer's
output gradient reaches every earlier layer's gradient in the same backward, an overflowing
weight the activations after it and the gradients before it. What names the step's flags (the
report's `First flagged` line, fp8_stats' one NaN/Inf warning) names them in that order, the
origin first; in layer order the origin came last or not at all (QA session 22: NaN injected in
the last layer's dY of the tiny MPT was named neither in the report's line nor, past 12 layers,
in the warning)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.monitor import GROUP_NAMED, FP8Monitor, MonitorConfig, Schedule

LAYERS = ("blocks.0.attn.Wqkv", "blocks.0.ffn.down_proj", "blocks.1.attn.Wqkv",
          "blocks.1.ffn.down_proj")  # forward order
TENSORS = ("activation", "weight", "gradient")
HEALTHY = {"amax": 1.0, "underflow_pct": 0.0, "overflow_pct": 0.0, "rel_mse": 1e-3,
           "cos_sim": 0.9995, "scale_ratio": 1.0, "nan_count": 0.0, "inf_count": 0.0}


def _run(folder: Path, faults: dict[tuple[str, str], dict[str, float]], at: int = 4) -> Path:
    """Healthy logging steps 0-5 of LAYERS in the real key layout, `faults` at step `at`."""
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in range(6):
        metrics = {"loss/train/total": 3.0}
        for layer in LAYERS:
            for tensor in TENSORS:
                stats = {**HEALTHY, **(faults.get((layer, tensor), {}) if step == at else {})}
                metrics.update({layer_key(s, tensor, layer): v for s, v in stats.items()})
        sink.write(step, metrics)
    return folder


def _first_line(capsys, folder: Path) -> str:
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "First flagged at step" in line)
    md = (folder / "fp8_report.md").read_text()
    assert line.strip().replace("'", "`") in md.replace("'", "`")  # the same in the markdown
    return line.strip()


def test_a_nan_in_the_last_layers_gradient_is_named_first(tmp_path, capsys):
    """dY NaN from the last layer back, as the backward spreads it: the last layer first."""
    faults = {(layer, "gradient"): {"nan_count": 4096.0} for layer in LAYERS}
    faults[(LAYERS[-1], "gradient")] = {"nan_count": 1.0}
    line = _first_line(capsys, _run(tmp_path, faults))
    assert line.startswith(f"First flagged at step 4: '{LAYERS[-1]}' gradient nan_count 1 "), line
    assert f"'{LAYERS[-2]}' gradient nan_count 4096" in line and "and 1 more at that step" in line


def test_an_overflowing_weight_is_named_before_the_gradients_it_spoiled(tmp_path, capsys):
    """blocks.1.attn.Wqkv's weight x300 (scale ratio 301, as the tiny run's up_proj): the dY of
    the layers before it overflows in the same step's backward, its next layer's input too."""
    spike = {"overflow_pct": 98.9, "scale_ratio": 301.0}
    faults = {(LAYERS[0], "gradient"): {"overflow_pct": 0.9, "scale_ratio": 4.7},
              (LAYERS[1], "gradient"): {"overflow_pct": 21.0, "scale_ratio": 10.4},
              (LAYERS[2], "weight"): spike,
              (LAYERS[3], "activation"): {"overflow_pct": 30.3, "scale_ratio": 74.5}}
    line = _first_line(capsys, _run(tmp_path, faults))
    named = [line.index(f"'{layer}' {tensor} ") for layer, tensor in
             [(LAYERS[2], "weight"), (LAYERS[3], "activation"), (LAYERS[1], "gradient")]]
    assert named == sorted(named) and "and 1 more at that step" in line, line


def test_the_nan_warning_names_the_layer_whose_gradient_it_started_in():
    """More layers than the warning names: NaN put into the last layer's dY (one element) is in
    every layer's dY of that backward; the warning names the last layer first."""
    torch.manual_seed(0)
    layers = GROUP_NAMED + 2
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("gradient",)), on_warning=warned.append,
                         schedule=Schedule(interval=1))
    for step in range(2):
        monitor.start_step(step)
        weights = torch.ones(8, 16)
        if step == 1:
            weights[0, 0] = float("nan")
        (model(torch.randn(8, 16)) * weights).sum().backward()
        monitor.finish_step()
    [message] = warned
    last = str(layers - 1)
    assert message.startswith(f"FP8 NaN/Inf at step 1 in {layers} layer tensors, before any FP8 "
                              f"cast: '{last}' gradient (nan_count 1), '{layers - 2}' gradient "
                              "(nan_count 16)"), message
    assert "'2' gradient (nan_count 16), and 2 more (" in message
