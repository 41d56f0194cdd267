"""TEMPORARY stand-in for the health package's API (contract.md), deleted once `health` lands:
only what the guard uses, persistent rules only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    max_underflow_pct: float = 5.0
    max_overflow_pct: float = 0.01
    min_cos_sim: float = 0.99
    persist_steps: int = 3
    source: str = "fp8_stats defaults"


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Flag:
    rule: str
    layer: str
    tensor: str
    step: int
    stat: str
    value: float

    @property
    def message(self) -> str:
        return f"FP8 {self.tensor} of layer '{self.layer}' at step {self.step}: {self.stat} {self.value:.4g} ({self.rule})"


@dataclass
class HealthTracker:
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    _streaks: dict = field(default_factory=dict)

    def update(self, step: int, table: Mapping) -> dict:
        t = self.thresholds
        raised: dict = {}
        for (layer, tensor), stats in table.items():
            if stats.get("initial_scale"):
                continue
            checks = (("underflow_persistent", "underflow_pct", stats.get("underflow_pct", 0) > t.max_underflow_pct),
                      ("overflow_persistent", "overflow_pct", stats.get("overflow_pct", 0) > 10 * t.max_overflow_pct),
                      ("cos_low", "cos_sim", stats.get("cos_sim", 1) < t.min_cos_sim))
            for rule, stat, bad in checks:
                n = self._streaks[(layer, tensor, rule)] = self._streaks.get((layer, tensor, rule), 0) + 1 if bad else 0
                if n >= t.persist_steps:
                    raised.setdefault((layer, tensor), []).append(Flag(rule, layer, tensor, step, stat, stats[stat]))
        return raised


def short_layer(name: str) -> str:
    for front in ("model.", "transformer."):
        name = name.removeprefix(front)
    return name
