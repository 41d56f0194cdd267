"""A forward that reads a kept FP8 weight cast (`is_first_microbatch=False`, te.Linear's weight
cache, which EmulatedFP8Linear models) does not cast the weight: the monitor must not judge the
weight at the layer's scale of now, which that GEMM never used. Reference: the scale of the cast
the GEMM read (the layer's kept cast) against the layer's current scale."""

from __future__ import annotations

import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from foundry_fp8.recipe import FP8Recipe

RECIPE = FP8Recipe(amax_history_len=4)


def _step(monitor: FP8Monitor, layer: EmulatedFP8Linear, x: torch.Tensor,
          first: bool | None) -> dict[str, float]:
    monitor.start_step()
    with fp8_autocast(recipe=RECIPE):
        layer(x, is_first_microbatch=first).sum().backward()
    return monitor.finish_step()


def test_a_reused_weight_cast_is_not_judged_at_the_current_scale():
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16, bias=False)
    x = torch.randn(16, 16, requires_grad=True)
    monitor = FP8Monitor(layer, MonitorConfig(tensors=["activation", "weight"]),
                         on_warning=lambda _: None)
    _step(monitor, layer, x, True)  # casts the weight at scale 1 and keeps the cast
    now = float(layer.fp8_meta["scaling_fwd"].scale[1])
    metrics = _step(monitor, layer, x, False)  # the GEMM reads the kept cast
    kept = float(layer._fp8_weight_cache.scale)
    assert (kept, round(now)) == (1.0, 1796)  # what the old monitor judged the weight at
    assert layer_key("scale", "activation", "") in metrics  # the input is cast and judged
    assert not any(key.startswith("fp8_") and "/weight/" in key for key in metrics)
    now = float(layer.fp8_meta["scaling_fwd"].scale[1])
    metrics = _step(monitor, layer, x, None)  # casts afresh at the scale of now
    assert metrics[layer_key("scale", "weight", "")] == now
