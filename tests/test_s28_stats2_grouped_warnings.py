"""A diverging run breaks a threshold rule in every layer at once: fp8_stats says so in one
warning per rule naming the layer tensors and the worst value, as it does for NaN/Inf, not one
per layer tensor (24 on the tiny MPT at lr 1000, up to 288 on an MPT-1B). A few keep their own."""

from __future__ import annotations

import torch
from torch import nn

from foundry_fp8.monitor import GROUP_EACH, GROUP_NAMED, FP8Monitor, MonitorConfig, Schedule


def _run(layers: int, spiked: int) -> tuple[list[str], FP8Monitor]:
    """Two logging steps of `layers` linears (delayed scaling, activations only); at step 1
    the input of each of the first `spiked` layers jumps 1e4 times past its amax history."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))
    for i, layer in enumerate(model):
        if i < spiked:
            layer.register_forward_pre_hook(
                lambda _, args: (args[0] * 1e4,) if monitor_step[0] == 1 else None)
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("activation",), recipe="delayed"),
                         on_warning=warned.append, schedule=Schedule(interval=1))
    monitor_step = [0]
    for step in range(2):
        monitor_step[0] = step
        monitor.start_step(step)
        with torch.no_grad():
            for layer in model:  # each layer's input is fresh: the spike never compounds
                layer(torch.randn(8, 16))
        monitor.finish_step()
    return warned, monitor


def _spiked(monitor: FP8Monitor) -> dict[str, float]:
    """The overflow_pct of each layer's activation at the last step, as the series log it."""
    return {layer: stats["overflow_pct"] for (layer, _), stats in monitor.table.items()}


def test_a_rule_broken_in_many_layers_is_one_warning_naming_each_and_the_worst():
    warned, monitor = _run(GROUP_EACH + 3, GROUP_EACH + 3)
    [message] = warned  # was one per layer tensor
    overflow = _spiked(monitor)
    assert all(value > 0.01 for value in overflow.values())
    assert message.startswith(f"FP8 overflow_spike at step 1 in {len(overflow)} layer tensors "
                              "at once, one warning for all; worst '")
    worst = max(overflow, key=overflow.__getitem__)
    # plain linears run in high precision: their numbers are fp8_stats' what-if
    assert f"worst '{worst}' activation (what-if): overflow_pct {overflow[worst]:.3g} %" in message
    # the first cast keeps its own full warning; the others are named with their value
    assert ("First cast: FP8 what-if for the activation of layer '0' at step 1 (it does not run "
            f"in FP8; these numbers are what fp8_stats' recipe (delayed scaling) would do to it): "
            f"overflow_pct {overflow['0']:.3g} %") in message
    for layer in list(overflow)[1:]:
        assert f"'{layer}' activation (what-if): overflow_pct {overflow[layer]:.3g} %" in message
    assert ". Also: " in message and "Other changes" not in message  # all take the same change


def test_the_warning_names_the_first_layer_tensors_and_counts_the_rest():
    layers = GROUP_NAMED + 3
    warned, _ = _run(layers, layers)
    [message] = warned
    assert f"in {layers} layer tensors" in message
    assert "; and 2 more (their fp8_overflow_pct/ series)." in message
    assert f"'{layers - 2}' activation (what-if): overflow_pct" not in message


def test_a_few_layers_keep_one_warning_each():
    warned, _ = _run(GROUP_EACH + 2, GROUP_EACH)
    assert len(warned) == GROUP_EACH
    for i, message in enumerate(warned):
        assert message.startswith(f"FP8 what-if for the activation of layer '{i}' at step 1 ")
