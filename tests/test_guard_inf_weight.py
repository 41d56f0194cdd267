"""fp8_guard in a real tiny LLM-Foundry run where one weight element of another layer is inf in
high precision (FP8's saturating cast lets training go on with it): the guard still moves the
faulty layer at the step its rule says, names once each layer it cannot judge (a second layer
going inf later too), and never moves the inf layers. Before, the first inf stopped the guard
judging any layer for the rest of the run and the faulty layer stayed in FP8; the guard's one
NaN/Inf line never named a layer going inf after the first."""

from __future__ import annotations

import math

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.composer.guard import FALLBACK_LAYERS
from foundry_fp8.fault import find_layer, stats_table
from foundry_fp8.health import summary_key
from tests.test_guard_run import (
    CONSECUTIVE,
    END,
    FAULT,
    GUARD,
    INTERVAL,
    LAYER,
    START,
    _bad_steps,
    _losses,
    _run,
    fault_registered,  # noqa: F401 (a fixture)
)

INF_LAYER, INF_AT = "blocks.0.ffn.up_proj", 2  # before the fault's START
LATER_LAYER, LATER_AT = "blocks.1.ffn.up_proj", 12  # after the fault's fallback


class InfWeight(Callback):
    """One element of `layer`'s weight set to inf at batch `at` (an overflowed update)."""

    def __init__(self, layer: str, at: int):
        self.layer, self.at = layer, at

    def batch_start(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) == self.at:
            with torch.no_grad():
                find_layer(state.model, self.layer).weight[0, 0] = math.inf


@pytest.mark.slow
def test_an_inf_weight_in_one_layer_leaves_the_guard_judging_the_others(tmp_path, tiny_data,
                                                                        fault_registered,  # noqa: F811
                                                                        capfd):
    from llmfoundry.registry import callbacks

    callbacks.register("guard_inf_weight", func=InfWeight)
    callbacks.register("guard_inf_weight_later", func=InfWeight)
    capfd.readouterr()
    guard, metrics, _ = _run(tmp_path, tiny_data, "inf_weight",
                             {**FAULT, **GUARD,
                              "guard_inf_weight": {"layer": INF_LAYER, "at": INF_AT},
                              "guard_inf_weight_later": {"layer": LATER_LAYER, "at": LATER_AT}})
    err = capfd.readouterr().err
    # fp8_stats' numbers: the inf stays in INF_LAYER's high-precision weight from INF_AT to the
    # end, in LATER_LAYER's from LATER_AT, in no other tensor; the loss stays finite
    held = {step: sorted((name, tensor) for (name, tensor), r in stats_table(m).items()
                         if r.get("nan_count", 0) + r.get("inf_count", 0))
            for step, m in metrics.items() if summary_key(None, "flagged_layers") in m}
    assert {s: rows for s, rows in held.items() if rows} == {
        s: sorted([(INF_LAYER, "weight")] + [(LATER_LAYER, "weight")] * (s >= LATER_AT))
        for s in range(INF_AT, END, INTERVAL)}
    assert all(math.isfinite(loss) for loss in _losses(metrics).values())
    # the reference: the first logging step at which one of LAYER's tensors has crossed a limit
    # at CONSECUTIVE logging steps in a row, from the run's own fp8_stats rows
    bad = _bad_steps(metrics, LAYER, guard)
    assert min(steps[0] for steps in bad.values()) == START
    expected = min(s for steps in bad.values() for s in steps
                   if all(s - INTERVAL * k in steps for k in range(CONSECUTIVE)))
    assert list(guard.core.fallbacks) == [LAYER] and guard.core.fallbacks[LAYER].step == expected
    assert {s: m[FALLBACK_LAYERS] for s, m in metrics.items() if FALLBACK_LAYERS in m} == {
        s: float(s >= expected) for s in range(0, END, INTERVAL)}
    # one line per layer, at the first logging step fp8_stats' rows show its inf
    first = {}
    for step, rows in sorted(held.items()):
        for name, _ in rows:
            first.setdefault(name, step)
    assert first == {INF_LAYER: INF_AT, LATER_LAYER: LATER_AT}
    said = [line for line in err.splitlines() if "newly hold NaN/Inf" in line]
    assert len(said) == len(first), said
    for line, (name, step) in zip(said, sorted(first.items(), key=lambda kv: kv[1]), strict=True):
        assert (f"fp8_guard: at step {step}, 1 layer(s) newly hold NaN/Inf in their high-precision "
                f"weight" in line)
        assert f"here {name}; each layer is named once" in line
        assert "the layers without NaN/Inf are judged as usual" in line
