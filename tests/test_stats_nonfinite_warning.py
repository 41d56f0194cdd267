"""A diverging run holds NaN in every layer at once: fp8_stats says so in one warning per
logging step, naming the layer tensors and their counts, not one warning per layer tensor (an
MPT-1B's 288 would bury everything else in the log). A few keep their own warnings."""

from __future__ import annotations

import torch
from torch import nn

from foundry_fp8.health.rules import NONFINITE_CAUSE, NONFINITE_CHANGE
from foundry_fp8.monitor import GROUP_EACH, GROUP_NAMED, FP8Monitor, MonitorConfig, Schedule


def _run(layers: int) -> tuple[list[str], dict[str, int]]:
    """Two logging steps of `layers` linears; step 1's input holds one NaN. Returns the
    warnings and, from hooks of our own, the NaN count of each layer's input at step 1."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("activation",)),
                         on_warning=warned.append, schedule=Schedule(interval=1))
    seen: dict[str, int] = {}
    for name, layer in model.named_children():
        layer.register_forward_pre_hook(
            lambda _, args, name=name: seen.__setitem__(name, int(args[0].isnan().sum())))
    for step in range(2):
        x = torch.randn(8, 16)
        if step == 1:
            x[0, 0] = float("nan")
        monitor.start_step(step)
        model(x).sum().backward()
        monitor.finish_step()
    return warned, seen


def test_nan_in_every_layer_is_one_warning_naming_each_layer_and_its_count():
    warned, seen = _run(GROUP_EACH + 1)
    # the NaN spreads along its row: 1 in the first layer's input, the whole row after it
    assert seen == {"0": 1, **{str(i): 16 for i in range(1, GROUP_EACH + 1)}}
    [message] = warned  # once: step 1's flags are not new at a later step either
    assert message.startswith(f"FP8 NaN/Inf at step 1 in {len(seen)} layer tensors, before any "
                              "FP8 cast: ")
    for layer, count in seen.items():
        assert f"'{layer}' activation (nan_count {count})" in message
    assert message.endswith(f"Likely cause: {NONFINITE_CAUSE}. Change: {NONFINITE_CHANGE}")


def test_the_warning_names_the_first_layer_tensors_and_counts_the_rest():
    warned, seen = _run(GROUP_NAMED + 2)
    [message] = warned
    assert f"in {len(seen)} layer tensors" in message
    assert f"'{GROUP_NAMED - 1}' activation (nan_count 16), and 2 more (" in message
    assert f"'{GROUP_NAMED}' activation" not in message


def test_nan_in_a_few_layers_keeps_one_warning_each():
    warned, seen = _run(GROUP_EACH)
    assert len(warned) == len(seen) == GROUP_EACH
    for (layer, count), message in zip(seen.items(), warned, strict=True):
        assert message.startswith(f"FP8 activation of layer '{layer}' at step 1: nan_count "
                                  f"{count} ({count} NaN and 0 Inf elements, before any FP8 "
                                  "cast).")
