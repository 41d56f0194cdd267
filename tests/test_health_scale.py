"""Reading a long run (QA s15: 100k metrics.jsonl lines, 1,720 logging steps of 24 rows, took 67 s
to report on a loaded 2-core machine, 18 s for a 40-step run): the work done per key and per
series is counted here, not timed."""

from __future__ import annotations

from foundry_fp8.health import history, layer_key
from foundry_fp8.health.history import RunMetrics, collect, worst_layers
from foundry_fp8.health.plots import MARKED_POINTS, draw_series

LAYERS = ("blocks.0.attn.Wqkv", "blocks.1.ffn.down_proj")
STATS = {"underflow_pct": 0.5, "cos_sim": 0.999, "amax": 2.0, "scale": 448.0}


def records(steps: int):
    for step in range(steps):
        yield step, {"loss/train/total": 1.0, **{layer_key(stat, "weight", layer): value + step
                                                 for layer in LAYERS
                                                 for stat, value in STATS.items()}}


def test_each_key_is_parsed_once_not_once_per_step(monkeypatch):
    calls: list[str] = []
    parse = history.parse_key
    monkeypatch.setattr(history, "parse_key", lambda key: calls.append(key) or parse(key))
    run = collect(records(50))
    assert len(calls) == 1 + len(LAYERS) * len(STATS)  # the loss key too
    assert run.values[(LAYERS[1], "weight", "amax")][49] == 2.0 + 49


def test_worst_layers_reads_only_the_series_of_its_statistic(monkeypatch):
    run = collect(records(20))
    judged: list[tuple[str, str]] = []
    original = RunMetrics.judged
    monkeypatch.setattr(RunMetrics, "judged", lambda self, layer, tensor, by_step: judged.append(
        (layer, tensor)) or original(self, layer, tensor, by_step))
    ranked = worst_layers(run, "underflow_pct")
    assert len(judged) == len(LAYERS)  # one series each, not one per statistic
    assert [r.worst for r in ranked] == [0.5 + 19] * len(LAYERS)


def test_a_long_series_is_drawn_as_lines_without_a_marker_per_step():
    short, long = collect(records(12)), collect(records(MARKED_POINTS + 1))
    for run, marker in ((short, "o"), (long, "None")):
        figure = draw_series(run, [(LAYERS[0], "")])
        lines = [line for ax in figure.axes for line in ax.get_lines() if len(line.get_xdata()) > 1]
        assert lines and {line.get_marker() for line in lines} == {marker}


def test_a_series_kept_compactly_reads_as_the_dict_of_its_last_values():
    """QA s16: the numbers were dicts (a 1 GB metrics.jsonl peaked at 2.09 GB); kept in arrays
    now, they must read as before: the last value per step, steps in order whatever order they
    came in (fp8_stats' own images after a fit with reset_time), a step dropped with the ones after."""
    import random

    rng = random.Random(3)
    run, reference = RunMetrics(), {}
    for _ in range(400):
        step, value = rng.randrange(60), rng.uniform(-1, 1)
        run.add(step, LAYERS[0], "weight", "amax", value)
        reference[step] = value
    by_step = run.values[(LAYERS[0], "weight", "amax")]
    assert list(by_step.items()) == sorted(reference.items())
    assert by_step == reference and len(by_step) == len(reference)
    assert [s in by_step for s in (-1, 60, *reference)] == [False, False] + [True] * len(reference)
    assert history.series(run, LAYERS[0], "weight", "amax") == (
        sorted(reference), [reference[s] for s in sorted(reference)])
    run.drop_from(30)
    assert by_step == {s: v for s, v in reference.items() if s < 30}


def test_the_replayed_tables_hold_every_number_once_at_its_step():
    """`tables()` reads the series one step at a time (no copy of every number grouped by step):
    the same tables as grouping the records by step."""
    logged = list(records(7))
    run = collect(logged)
    run.add(3, LAYERS[1], "activation", "amax", 9.0)  # a row logged at one step only
    run.initial.add((LAYERS[0], "weight", 0))
    expected = {step: {(layer, "weight"): {stat: STATS[stat] + step for stat in STATS}
                       for layer in LAYERS} for step, _ in logged}
    expected[3][(LAYERS[1], "activation")] = {"amax": 9.0}
    expected[0][(LAYERS[0], "weight")]["initial_scale"] = 1.0
    assert {step: {row: dict(stats) for row, stats in table.items()}
            for step, table in run.tables()} == expected
    assert [step for step, _ in run.tables()] == list(range(7))
