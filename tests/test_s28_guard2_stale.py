"""fp8_guard and a stale scale. An outlier channel injected into `blocks.0.attn.Wqkv`'s input
from batch START makes that layer fall back (its range does not fit FP8) and, while it ran in
FP8, corrupted its output: the healthy `blocks.0.attn.out_proj` saw an amax spike. Its delayed
scale (the tiny YAML's amax history of HISTORY steps, `max`) keeps that spike until the
history rolls it out, so its input underflows with `scale / current_scale` far below 1/16
(`underflow_stale`): a transient TE's own history fixes, no evidence that the layer's range
does not fit FP8. Before, the guard moved out_proj for it at step 10 (`max_fallback_share:
0.5`) and, re-promotion off, it stayed in high precision for the rest of the run. Now a stale
scale moves a layer only when it lasts longer than the history."""

from __future__ import annotations

import pytest

from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fault import InjectOutlier, stats_table
from foundry_fp8.guard import GuardConfig, GuardCore
from foundry_fp8.health.rules import stale_scale_ratio
from tests import test_guard_run
from tests.test_guard_run import FlagLog, _run

FAULTY, DOWNSTREAM = "blocks.0.attn.Wqkv", "blocks.0.attn.out_proj"
START, END, INTERVAL, HISTORY = 4, 28, 2, 16
GUARD = {"fp8_stats": {"interval": INTERVAL, "image_interval": None},
         "fp8_guard": {"consecutive": 2, "max_fallback_share": 0.5}}


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory, tiny_data):
    from llmfoundry.registry import callbacks

    callbacks.register("s28_guard2_outlier", func=InjectOutlier)
    tmp = tmp_path_factory.mktemp("stale")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_guard_run, "END", END)  # past the spike's HISTORY steps
        return _run(tmp, tiny_data, "stale",
                    {**GUARD, "s28_guard2_outlier": {"layer": FAULTY, "start": START}})


@pytest.mark.slow
def test_a_stale_scale_moves_no_layer_a_range_problem_does(stale_run):
    guard, metrics, trainer = stale_run
    assert trainer.state.timestamp.batch.value == END
    swap = next(a for a in trainer.state.algorithms if isinstance(a, TESwap))
    recipe = swap.options.fp8_recipe  # the tiny YAML's
    assert (recipe.amax_history_len, recipe.amax_compute_algo) == (HISTORY, "max")
    # the faulty layer falls back at its second flagged logging step, for a plain underflow
    # (its limit alone: no stale scale)
    assert list(guard.core.fallbacks) == [FAULTY]
    fallback = guard.core.fallbacks[FAULTY]
    assert fallback.step == START + INTERVAL
    assert fallback.flagged[0] == "activation underflow_pct 43.9 % (> 5 %)"
    flags = next(c for c in trainer.state.callbacks if isinstance(c, FlagLog)).flags
    rules = {(f.step, f.rule) for f in flags if f.layer.endswith(DOWNSTREAM)
             and f.tensor == "activation"}
    # out_proj: the spike itself while the faulty layer ran in FP8 (to its fallback's step),
    # then a stale scale until its history rolls the spike out: the scale of step s is taken
    # from the max over the amaxes of steps s - HISTORY .. s - 1 (TE 2.x
    # pytorch/quantization.py:1067-1088, each update rolls the history by one, zeroing the
    # oldest), so the last step it holds the spike at is the fallback's + HISTORY
    last = fallback.step + HISTORY
    stale = sorted(s for s, rule in rules if rule == "underflow_stale")
    assert rules == {(START, "overflow_spike"), *((s, "underflow_stale") for s in stale)}
    assert stale == list(range(fallback.step + INTERVAL, last, INTERVAL))
    rows = {step: r for step, values in metrics.items()
            for (name, tensor), r in stats_table(values).items()
            if name.endswith(DOWNSTREAM) and tensor == "activation"}
    assert all(rows[s]["underflow_pct"] > 20 and stale_scale_ratio(rows[s]) < 1e-4
               for s in stale)
    # at the last step its scale still holds the spike at step 6 (a smaller one than step 5's:
    # under the underflow limit), then its own FP8 casts are healthy, at the scale its amax sets
    assert (last, rows[last]["underflow_pct"] < 5) == (22, True)
    assert stale_scale_ratio(rows[last]) < 1 / 16
    assert all(rows[s]["underflow_pct"] == 0 and rows[s]["scale_ratio"] > 0.9
               for s in range(last + INTERVAL, END, INTERVAL))
    # it ran in FP8 all along (before: in high precision from step 11 to the end)
    assert all(values.get("fp8/guard/in_fallback/" + DOWNSTREAM, 0) == 0
               for values in metrics.values())
    assert metrics[END - INTERVAL]["fp8/guard/fallback_layers"] == 1.0


ROW = {"overflow_pct": 0.0, "cos_sim": 0.988, "scale_ratio": 4.4e-5, "scale": 0.0043,
       "current_scale": 97.6}
STALE = {**ROW, "underflow_pct": 24.2}
HEALTHY = {**ROW, "underflow_pct": 0.0, "cos_sim": 0.9996, "scale_ratio": 1.0, "scale": 97.6}


def _steps(core: GuardCore, rows: dict[int, dict], history: int | None) -> dict[int, list[str]]:
    seen = {}
    for step, row in rows.items():
        core.history_len = history
        seen[step] = core.candidates(step, {("a", "activation"): dict(row)})
    return seen


def test_a_stale_scale_lasting_past_the_history_moves_its_layer_and_survives_a_resume():
    """Stale from step 2 on, history 8: transient up to step 10, a range problem at 12 (fresh
    spikes keep it stale). Unknown history: judged as before, at the second stale step. A
    resume at step 8 keeps the run's first stale step (its rows hold the last 2 only)."""
    config = GuardConfig(consecutive=2, max_fallback_share=1.0)
    rows = {0: HEALTHY, **{step: STALE for step in range(2, 14, 2)}}
    core = GuardCore(config, {"a": 0.1})
    assert _steps(core, rows, 8) == {0: [], 2: [], 4: [], 6: [], 8: [], 10: [], 12: ["a"]}
    assert _steps(GuardCore(config, {"a": 0.1}), rows, None)[4] == ["a"]
    # a healthy step ends the run of stale steps: the window starts again at the next one
    again = {**rows, 6: HEALTHY}
    assert _steps(GuardCore(config, {"a": 0.1}), again, 8)[12] == []
    core = GuardCore(config, {"a": 0.1})
    _steps(core, {s: r for s, r in rows.items() if s <= 8}, 8)
    resumed = GuardCore(config, {"a": 0.1})
    resumed.load_state_dict(core.state_dict())
    assert _steps(resumed, {10: STALE, 12: STALE}, 8) == {10: [], 12: ["a"]}
