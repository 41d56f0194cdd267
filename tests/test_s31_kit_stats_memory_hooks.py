"""benchmarks/gpu/stats_memory.py's `hooks` case puts no-op hooks where fp8_stats puts its own,
to measure the hooks' memory without statistics. Since 808fa06 fp8_stats reads the output
gradient through a hook on the output tensor, put there by a forward hook, not a module full
backward pre-hook (whose BackwardHook wraps the outputs in views, other memory): the case still
put the full backward pre-hook, so it measured hooks fp8_stats no longer uses. Reference: the
real FP8Monitor armed for a logging step on the same layer."""

from __future__ import annotations

import torch

from benchmarks.gpu.stats_memory import Hooks
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.monitor import FP8Monitor
from foundry_fp8.options import MonitorConfig


def _hooks_seen(layer: torch.nn.Module) -> dict[str, int]:
    """The hooks on `layer`, and on its output's gradient after a forward."""
    with fp8_autocast():
        out = layer(torch.randn(16, 16, requires_grad=True))
    return {"forward_pre": len(layer._forward_pre_hooks), "forward": len(layer._forward_hooks),
            "backward_pre": len(layer._backward_pre_hooks),
            "backward": len(layer._backward_hooks),
            "output_gradient": len(out._backward_hooks or {})}


def test_the_hooks_case_puts_the_hooks_fp8_stats_puts():
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16)
    monitor = FP8Monitor(torch.nn.Sequential(layer), MonitorConfig())
    assert monitor.start_step(0)
    monitors = _hooks_seen(layer)
    monitor.finish_step()
    assert monitors["output_gradient"] == 1 and monitors["backward_pre"] == 0  # the reference

    probe = Hooks()
    probe.layers = [layer]
    probe.batch_start(None, None)
    try:
        assert _hooks_seen(layer) == monitors
    finally:
        probe.after_train_batch(None, None)
