"""FP8Monitor: per-layer FP8 health for any PyTorch training loop.

Watches the GEMM input (activation), weight and output gradient of selected `nn.Linear` layers
and reports `tensor_stats` under current scaling for each. Hooks exist only during logging steps,
so other steps pay nothing; all statistics of a step reach the host in one transfer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from foundry_fp8.numerics import STAT_KEYS, tensor_stats_tensor

TENSOR_FORMATS = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}


@dataclass(frozen=True)
class MonitorConfig:
    """Which layers and tensors to watch, and when a layer deserves a warning."""

    include: str = ".*"
    exclude: str | None = None
    tensors: tuple[str, ...] = ("activation", "weight", "gradient")
    max_underflow_pct: float = 5.0
    max_overflow_pct: float = 0.0
    min_cos_sim: float = 0.99

    def __post_init__(self) -> None:
        unknown = set(self.tensors) - set(TENSOR_FORMATS)
        if unknown:
            raise ValueError(f"fp8_stats.tensors: unknown {sorted(unknown)}; "
                             f"use {sorted(TENSOR_FORMATS)}")
        for key in ("include", "exclude"):
            pattern = getattr(self, key)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"fp8_stats.{key}: bad regex {pattern!r}: {e}") from None


def select_layers(model: nn.Module, config: MonitorConfig) -> dict[str, nn.Linear]:
    """The linear layers whose qualified names match `include` and not `exclude`."""
    return {
        name: module for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and re.search(config.include, name)
        and not (config.exclude and re.search(config.exclude, name))
    }


def advice(layer: str, tensor: str, stats: dict[str, float], config: MonitorConfig) -> str | None:
    """A warning for a layer whose FP8 numbers cross a threshold, with the usual remedies."""
    problems = []
    if stats["underflow_pct"] > config.max_underflow_pct:
        problems.append(f"{stats['underflow_pct']:.2f}% of values underflow to 0")
    if stats["overflow_pct"] > config.max_overflow_pct:
        problems.append(f"{stats['overflow_pct']:.2f}% of values overflow")
    if stats["cos_sim"] < config.min_cos_sim:
        problems.append(f"cosine similarity with FP8 round trip {stats['cos_sim']:.4f}")
    if not problems:
        return None
    return (f"FP8 {tensor} of layer '{layer}': {'; '.join(problems)} (amax {stats['amax']:.3g}). "
            "Remedies: keep this layer (or the first/last blocks) in BF16, use current scaling, "
            "or a longer amax history.")


class FP8Monitor:
    """Collects FP8 statistics on the steps you choose: `start_step()` ... `finish_step()`."""

    def __init__(self, model: nn.Module, config: MonitorConfig | None = None,
                 on_warning: Callable[[str], None] | None = None):
        self.model = model
        self.config = config or MonitorConfig()
        self.layers = select_layers(model, self.config)
        self.on_warning = on_warning or (lambda msg: warnings.warn(msg, stacklevel=2))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pending: dict[tuple[str, str], torch.Tensor] = {}
        self._warned: set[tuple[str, str]] = set()

    def _record(self, layer: str, tensor: str, value: torch.Tensor) -> None:
        # First sighting wins: activation recompute runs forward hooks a second time.
        key = (layer, tensor)
        if tensor in self.config.tensors and key not in self._pending:
            self._pending[key] = tensor_stats_tensor(value, TENSOR_FORMATS[tensor])

    def start_step(self) -> None:
        """Register hooks for this step only."""
        for name, module in self.layers.items():
            def forward_hook(mod, inputs, _output, name=name):
                self._record(name, "activation", inputs[0])
                self._record(name, "weight", mod.weight)

            def backward_hook(_mod, _grad_input, grad_output, name=name):
                self._record(name, "gradient", grad_output[0])

            self._handles.append(module.register_forward_hook(forward_hook))
            if "gradient" in self.config.tensors:
                self._handles.append(module.register_full_backward_hook(backward_hook))

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def finish_step(self) -> dict[str, float]:
        """Remove hooks and return `{"fp8/<layer>/<tensor>/<stat>": value}`, warning once per
        layer and tensor that crosses a threshold."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        pending, self._pending = self._pending, {}
        if not pending:
            return {}
        rows = torch.stack(list(pending.values())).cpu().tolist()  # the one host transfer
        metrics: dict[str, float] = {}
        for (layer, tensor), row in zip(pending, rows, strict=True):
            stats = dict(zip(STAT_KEYS, row, strict=True))
            metrics.update({f"fp8/{layer}/{tensor}/{k}": v for k, v in stats.items()})
            message = advice(layer, tensor, stats, self.config)
            if message and (layer, tensor) not in self._warned:
                self._warned.add((layer, tensor))
                self.on_warning(message)
        return metrics
