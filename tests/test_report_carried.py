"""`fit()` again with `reset_time` keeps fp8_guard's fallbacks, and their records keep the first
fit's steps: the report tells them from the second fit's own by the series
`fp8/guard/fallback_layers` at the second fit's first logging step (the shape of a real tiny-MPT
run, QA session 17: a layer that fell back at step 4 of fit 1 ran all of fit 2 in high
precision, yet the report marked fit 2's steps 0-4 as FP8 casts)."""

from __future__ import annotations

import json
from pathlib import Path

from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.report.cli import make_report

L0, L1 = "blocks.0.attn.Wqkv", "blocks.1.attn.out_proj"
HEALTHY = {"underflow_pct": 0.0, "overflow_pct": 0.0, "rel_mse": 1e-3, "cos_sim": 0.9995,
           "amax": 1.0, "scale_ratio": 1.0}
FIT = range(6)


def two_fits(folder: Path, second_fit_moves: tuple[str, ...] = ()) -> Path:
    """Fit 1: L1's activation underflows from step 2, fp8_guard moves it at step 3. Fit 2 (steps
    from 0 again): L1 in high precision from its start, its what-if activation at 50 % from
    step 1; `second_fit_moves` fall back at fit 2's step 3 too."""
    sink = JsonlSink(folder / "metrics.jsonl")
    for fit in (1, 2):
        for step in FIT:
            metrics = {layer_key(stat, tensor, layer): value for layer in (L0, L1)
                       for tensor in ("activation", "weight") for stat, value in HEALTHY.items()}
            bad = step >= (2 if fit == 1 else 1)
            metrics[layer_key("underflow_pct", "activation", L1)] = 50.0 if bad else 0.0
            fallen = (fit == 2) + (fit == 1 and step >= 3) + len(second_fit_moves) * (
                fit == 2 and step >= 3)
            metrics["fp8/guard/fallback_layers"] = float(fallen)
            sink.write(step, metrics)

    def fallback(layer: str, step: int) -> dict:
        return {"layer": layer, "step": step, "flops_share": 0.1, "reasons": ["flagged"],
                "numbers": {}, "flagged": []}

    records = {"fp8/guard/fallback/" + layer: fallback(layer, 3) for layer in (L1, *second_fit_moves)}
    (folder / "hparams.json").write_text(json.dumps({
        "callbacks": {"fp8_stats": {}, "fp8_guard": {}}, **records}))
    return folder


def test_a_fallback_kept_by_a_second_fit_is_what_if_from_its_first_step(tmp_path, capsys):
    folder = two_fits(tmp_path)
    run, flags, guard, _, _ = make_report(folder)
    # every logged row of L1 in fit 2 (what the report shows) ran in high precision
    assert {(layer, step) for layer, _, step in run.high_precision} == {(L1, s) for s in FIT}
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    # fit 2 flags L1 at steps 1-5 of its 6: all what-if
    assert "underflow_pct 50 % at what-if step 1 (> 5 %; 5 of 6 steps, 5 of them what-if)" in out
    assert "fp8_guard ran it in high precision from step 0 " in out
    markdown = (folder / "fp8_report.md").read_text()
    assert ("`fp8/guard/fallback_layers` 1 at step 0), blocks.1.attn.out_proj was already in "
            "fallback") in markdown


def test_which_of_several_later_records_were_kept_is_not_guessed(tmp_path, capsys):
    """Fit 2 moved L0 at its step 3 as well: two records with step 3, one layer kept from fit 1
    (the series' 1 at fit 2's step 0): which, the records cannot say; each is marked from its
    record's step, with one warning."""
    folder = two_fits(tmp_path, second_fit_moves=(L0,))
    run, *_ = make_report(folder)
    assert {(layer, step) for layer, _, step in run.high_precision} == {
        (layer, s) for layer in (L0, L1) for s in (4, 5)}
    err = capsys.readouterr().err
    assert "with 1 layer(s) in fallback (`fp8/guard/fallback_layers` at step 0)" in err
