"""`foundry-fp8 report`: worst values, flagged layers, chosen layers and the PNGs, on a
metrics.jsonl written by hand with known numbers; bad and hostile input is one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import foundry_fp8
from foundry_fp8.cli import main
from foundry_fp8.health import HealthTracker, Thresholds, collect, layer_key, worst_values
from foundry_fp8.health.history import Ranked, heatmap_matrix, series, worst_layers
from foundry_fp8.health.plots import (
    block_index,
    choose_layers,
    common_prefix,
    log_limits,
    tick_indices,
)
from foundry_fp8.health.rules import NONFINITE_CAUSE, NONFINITE_CHANGE, NOT_CLIPPED
from foundry_fp8.jsonl import JsonlSink, read_jsonl
from foundry_fp8.report.cli import replay
from foundry_fp8.report.read import thresholds_from_hparams

L0, L1, L2 = "blocks.0.attn.qkv", "blocks.1.ffn.up", "blocks.2.ffn.down"
STEPS = (0, 10, 20)
# (layer, tensor, stat) -> value per step; None: not logged. Everything else is healthy.
SPECIAL = {
    (L1, "gradient", "underflow_pct"): (1.0, 4.0, 9.0),  # rises past the 5 % threshold
    (L2, "gradient", "underflow_pct"): (0.5, 0.5, None),  # L2 not logged at step 20
    (L2, "activation", "cos_sim"): (0.9995, 0.98, None),
    (L1, "activation", "scale_ratio"): (1.0, 1.5, 1.0),  # outgrew its delayed scale at step 10
    (L0, "activation", "amax"): (2.0, 4.0, 8.0),
}
HEALTHY = {"amax": 1.0, "underflow_pct": 0.0, "overflow_pct": 0.0, "rel_mse": 1e-3,
           "cos_sim": 0.9995, "scale": 448.0, "scale_ratio": 1.0, "nan_count": 0.0,
           "inf_count": 0.0}


def write_run(folder: Path, extra: dict[str, float] | None = None) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for i, step in enumerate(STEPS):
        metrics: dict[str, float] = {"loss/train/total": 3.0 - i}
        for layer in (L0, L1, L2):
            if layer == L2 and step == 20:
                continue
            for tensor in ("activation", "gradient"):
                for stat, healthy in HEALTHY.items():
                    value = SPECIAL.get((layer, tensor, stat), (healthy,) * 3)[i]
                    metrics[layer_key(stat, tensor, layer)] = value
        sink.write(step, {**metrics, **(extra or {})} if step == 20 else metrics)
    return folder


def load(path: Path):
    return collect(read_jsonl(path))


def assert_valid_png(path: Path, min_pixels: int = 100_000) -> None:
    """Written, decodable, of a real size, and not blank."""
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[0] * image.shape[1] >= min_pixels, image.shape
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_report_keeps_worst_values(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    key = "blocks.0.up"
    sink.write(0, {layer_key("underflow_pct", "weight", key): 1.0,
                   layer_key("cos_sim", "weight", key): 0.999, "loss/train/total": 3.0})
    sink.write(10, {layer_key("underflow_pct", "weight", key): 7.5,
                    layer_key("cos_sim", "weight", key): 0.98})
    sink.write(20, {layer_key("underflow_pct", "weight", key): 2.0,
                    layer_key("cos_sim", "weight", key): float("nan")})
    row = worst_values(load(tmp_path / "metrics.jsonl"))[(key, "weight")]
    assert row["underflow_pct"] == 7.5
    assert row["cos_sim"] == 0.98  # NaN never hides a real bad value
    out = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "| blocks.0.up | weight | 7.5 |" in out.stdout
    assert (tmp_path / "fp8_report.md").exists()


def test_report_on_the_older_key_layout_says_so_in_one_line(tmp_path):
    """A run logged before the per-statistic layout (`fp8/<layer>/<tensor>/<stat>`, with its
    fp8_stats options in hparams.json): not "fp8_stats logged no layer"."""
    JsonlSink(tmp_path / "metrics.jsonl").write(0, {
        "loss/train/total": 1.0, "fp8/model.transformer.blocks.0.attn.Wqkv/weight/amax": 0.5,
        "fp8/model.transformer.blocks.0.attn.Wqkv/weight/underflow_pct": 0.0})
    (tmp_path / "hparams.json").write_text(json.dumps({"callbacks": {"fp8_stats": {}}}))
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and not result.stdout and result.stderr.count("\n") == 1
    assert result.stderr == (
        f"error: {tmp_path / 'metrics.jsonl'}: FP8 statistics in an older key layout "
        "(fp8/<layer>/<tensor>/<stat>, e.g. `fp8/model.transformer.blocks.0.attn.Wqkv/weight/amax`"
        ", from foundry-fp8 builds before 2026-11-23); this report (foundry-fp8 "
        f"{foundry_fp8.__version__}) reads fp8_<stat>/<tensor>/<layer> series only: the report "
        "of the build that logged them reads them (foundry-fp8 at commit 0b6e716 or earlier, "
        "installed in another environment)\n")


@pytest.mark.parametrize(("hparams", "why"), [
    (None, "was `fp8_stats` in the YAML?"),
    ({"callbacks": {"fp8_lint": {}}}, "the run had no `fp8_stats` callback (add "),
    ({"callbacks": {"fp8_stats": {"layers": "^nothing"}}},
     "fp8_stats ran but logged no layer (callbacks.fp8_stats.layers: '^nothing' matched nothing"),
])
def test_report_without_fp8_metrics_says_why_and_exits_2(tmp_path, hparams, why):
    JsonlSink(tmp_path / "metrics.jsonl").write(0, {"loss/train/total": 1.0})
    if hparams is not None:
        (tmp_path / "hparams.json").write_text(json.dumps(hparams))
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and why in result.stderr and not result.stdout
    assert result.stderr.count("\n") == 1


def test_an_earlier_runs_emptiness_is_explained_with_its_own_hparams(tmp_path):
    """metrics.1.jsonl (a set-aside earlier run) is read with hparams.1.json, not with the newer
    run's hparams.json (docs/reliability.md), for why it is empty too."""
    earlier = tmp_path / "metrics.1.jsonl"
    JsonlSink(earlier).write(0, {"loss/train/total": 1.0})
    (tmp_path / "hparams.1.json").write_text(json.dumps({"callbacks": {}}))
    (tmp_path / "hparams.json").write_text(json.dumps({"callbacks": {"fp8_stats": {}}}))
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(earlier)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and not result.stdout
    assert result.stderr == (f"error: {earlier}: no FP8 statistics: the run had no `fp8_stats` "
                             "callback (add `callbacks: {fp8_stats: {}}` to the YAML)\n")


def test_data_preparation_is_exact(tmp_path):
    run = load(write_run(tmp_path) / "metrics.jsonl")
    assert run.layers == [L0, L1, L2] and run.tensors == ["activation", "gradient"]
    assert run.steps == [0, 10, 20]
    assert run.stats == ["underflow_pct", "overflow_pct", "rel_mse", "cos_sim", "nan_count",
                         "inf_count", "amax", "scale", "scale_ratio"]
    matrix = heatmap_matrix(run, "underflow_pct", "gradient")
    assert matrix[:2] == [[0.0, 0.0, 0.0], [1.0, 4.0, 9.0]]
    assert matrix[2][:2] == [0.5, 0.5] and math.isnan(matrix[2][2])  # not logged at step 20
    assert series(run, L0, "activation", "amax") == ([0, 10, 20], [2.0, 4.0, 8.0])
    assert series(run, L2, "activation", "cos_sim") == ([0, 10], [0.9995, 0.98])

    worst = worst_values(run)
    assert worst[(L1, "gradient")]["underflow_pct"] == 9.0
    assert worst[(L2, "activation")]["cos_sim"] == 0.98
    assert worst[(L1, "activation")]["scale_ratio"] == 1.5
    assert "scale" not in worst[(L1, "activation")]  # not ranked: no better or worse

    flags = replay(run, HealthTracker())
    assert [(f.layer, f.tensor, f.rule, f.value, f.step) for f in flags] == [
        (L2, "activation", "cos_low", 0.98, 10), (L1, "gradient", "underflow", 9.0, 20)]
    # scale_ratio 1.5 without overflow is no flag: nothing saturates
    assert worst_layers(run, "underflow_pct") == [
        Ranked(L1, "gradient", 14 / 3, 9.0, 20), Ranked(L2, "gradient", 0.5, 0.5, 0)]
    assert worst_layers(run, "overflow_pct") == []  # 0 everywhere is not a ranking
    assert choose_layers(run) == [
        (L0, "first block"), (L1, "most underflow: 4.67 % of gradient on average"),
        (L2, "last block")]
    assert choose_layers(run, lambda layer: "ffn." in layer) == [(L1, ""), (L2, "")]


def test_collect_keeps_the_later_value_of_a_step_logged_twice():
    run = collect([(5, {layer_key("mse", "weight", "a"): 1.0, layer_key("note", "weight", "a"): "x"}),
                   (5, {layer_key("mse", "weight", "a"): 2.0, "fp8/weight/worst_cos_sim": 3.0,
                        "lr": 0.1})])
    assert run.values == {("a", "weight", "mse"): {5: 2.0}}


@pytest.mark.parametrize(("layers", "prefix"), [
    (["model.blocks.0.a", "model.blocks.1.b"], "model."),  # keeps `blocks.` before the number
    (["m.enc.attn.q", "m.enc.attn.k"], "m.enc.attn."),
    (["a.x", "b.x"], ""),
    ([L0], ""),
])
def test_common_prefix(layers, prefix):
    assert common_prefix(layers) == prefix


def test_choose_layers_without_block_numbers_and_without_underflow():
    run = collect([(0, {layer_key("underflow_pct", "weight", name): 0.0
                        for name in ("embed", "mid", "head")})])
    assert choose_layers(run) == [("embed", "first block"), ("head", "last block")]
    assert block_index("h.12.mlp") == 12 and block_index("lm_head") is None
    assert tick_indices(30, 10) == list(range(0, 30, 3))


def test_log_limits_leave_an_outlying_first_step_off_the_scale():
    # delayed scaling: step 0 runs on the initial scale 1.0, then ~100
    assert log_limits([([0, 10, 20], [1.0, 100.0, 200.0])]) == (100 / 1.5, 300.0, 0)
    assert log_limits([([0, 10, 20], [20.0, 100.0, 200.0])]) is None
    assert log_limits([([0], [1.0])]) is None


def test_thresholds_follow_the_run_and_default_to_fp8_stats():
    from foundry_fp8.monitor import MonitorConfig

    default, config = Thresholds(), MonitorConfig()
    assert (default.max_underflow_pct, default.max_overflow_pct, default.min_cos_sim) == (
        config.max_underflow_pct, config.max_overflow_pct, config.min_cos_sim)
    hparams = {"callbacks": {"fp8_stats": {"interval": "10ba", "max_underflow_pct": 10}}}
    assert thresholds_from_hparams(hparams).max_underflow_pct == 10.0
    assert thresholds_from_hparams({"callbacks": {}}) == Thresholds()
    assert thresholds_from_hparams(
        {"callbacks": {"fp8_stats": {"min_cos_sim": 5}}}).min_cos_sim == Thresholds().min_cos_sim


def test_cli_writes_plots_and_markdown(tmp_path, capsys):
    folder = write_run(tmp_path / "run", extra={layer_key("new_stat", "gradient", L1): 2.0})
    out = tmp_path / "report"
    assert main(["report", str(folder), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    pngs = ["fp8_heatmap_underflow_pct.png", "fp8_heatmap_overflow_pct.png",
            "fp8_heatmap_rel_mse.png", "fp8_heatmap_cos_sim.png",
            "fp8_heatmap_new_stat.png",  # a statistic this version does not know
            "fp8_timeseries.png"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(pngs)  # no NaN/Inf count plots
    for name in pngs:
        assert_valid_png(out / name)
        assert name in stdout
    assert "2 flagged" in stdout
    assert (f"'{L1}' gradient: underflow_pct 9 % at step 20 (> 5 %; 1 of 3 steps). Likely "
            "cause: the tensor's range is wider than FP8 holds at this layer. Change: "
            "algorithms.te_swap.keep_first_blocks: 1") not in stdout  # L1 is a middle block
    assert (f"'{L1}' gradient: underflow_pct 9 % at step 20 (> 5 %; 1 of 3 steps). Likely "
            "cause: the tensor's range is wider than FP8 holds at this layer. Change: "
            r"algorithms.te_swap.exclude: '^(?:model\.)?(?:transformer\.)?blocks\.1\.ffn\.up(?:\..+)?$'") in stdout

    md = (out / "fp8_report.md").read_text()
    assert (f"| {L1} | gradient | underflow_pct | 9 % (step 20) | 20 | 1 of 3 | the tensor's range is "
            r"wider than FP8 holds at this layer | `algorithms.te_swap.exclude: "
            r"'^(?:model\.)?(?:transformer\.)?blocks\.1\.ffn\.up(?:\..+)?$'` |") in md
    assert (f"| {L2} | activation | cos_sim | 0.98 (step 10) | 10 | 1 of 2 | FP8 rounding loses too much "
            "of this tensor | `algorithms.te_swap.keep_last_blocks: 1` |") in md
    assert md.index(f"| {L2} | activation | cos_sim") < md.index(f"| {L1} | gradient |")
    assert "**Above 1** (overflow side)" in md and "**Below 1** (underflow side)" in md
    assert "**scale_ratio**: `blocks.1.ffn.up` activation mean 1.167, worst 1.5 (step 10)" in md
    assert ("**underflow_pct**: `blocks.1.ffn.up` gradient mean 4.667 %, worst 9 % (step 20); "
            "`blocks.2.ffn.down` gradient mean 0.5 %, worst 0.5 % (step 0)\n") in md
    assert all(f"![{name}]({name})" in md for name in pngs)
    assert f"| {L1} | gradient | 9 |" in md  # the full table, worst underflow first


E4M3 = {"scaling": "delayed", "fp8_format": "E4M3", "amax_history_len": 16,
        "amax_compute_algo": "max", "margin": 0, "reduce_amax": True}  # as te_swap logs it


@pytest.mark.parametrize(("hparams", "gradient"), [
    # te_swap's layers and fp8_stats' what-if both cast in E4M3: so does every gradient
    ({"fp8/recipe": E4M3, "callbacks": {"fp8_stats": {"recipe": {"fp8_format": "E4M3"}}}},
     "gradient (E4M3)"),
    # the what-if is fp8_stats' default (current scaling, HYBRID): its rows' gradients are E5M2
    ({"fp8/recipe": E4M3, "callbacks": {"fp8_stats": {"interval": 10}}},
     "gradient (E4M3 or E5M2)"),
    ({"fp8/recipe": E4M3}, None),  # fp8_stats' recipe not known (not LLM-Foundry's config)
    ({"callbacks": {"fp8_stats": {}}}, None),  # no te_swap: the FP8 layers' recipe not known
    ({"fp8/recipe": {"fp8_format": "E5M2"}, "callbacks": {"fp8_stats": {}}}, None),  # no recipe
])
def test_the_pictures_name_the_formats_of_the_runs_recipes(tmp_path, monkeypatch, hparams,
                                                            gradient):
    """The heatmaps' panel titles say the formats the run's recipes (hparams.json) cast each
    tensor in, or none where a recipe is not known: the PNG the report writes is, pixel for
    pixel, the heatmap drawn with those titles."""
    from matplotlib.image import imread

    from foundry_fp8.health import plots

    folder = write_run(tmp_path / "run")
    (folder / "hparams.json").write_text(json.dumps(hparams))
    assert main(["report", str(folder), "--out", str(tmp_path / "report")]) == 0
    written = imread(tmp_path / "report" / "fp8_heatmap_cos_sim.png")
    run, thresholds = load(folder / "metrics.jsonl"), thresholds_from_hparams(hparams)
    titles = ({"activation": "activation (E4M3)", "gradient": gradient} if gradient
              else {"activation": "activation", "gradient": "gradient"})

    def titled(path: Path, titles: dict[str, str]) -> np.ndarray:
        """The report's figure of the cos_sim heatmap, its panels titled `titles`."""
        drawn = plots.heatmap(run, "cos_sim", thresholds)
        panels = [dataclasses.replace(p, title=titles[p.tensor]) for p in drawn.panels]
        with monkeypatch.context() as patched:
            patched.setattr(plots, "heatmap",
                            lambda *_, **__: dataclasses.replace(drawn, panels=panels))
            plots.save_png(plots.draw_heatmap(run, "cos_sim", thresholds), path)
        return imread(path)

    assert np.array_equal(written, titled(tmp_path / "expected.png", titles))
    if gradient:  # the title is in the pixels
        old = {"activation": "activation (E4M3)", "gradient": "gradient (E5M2)"}
        assert not np.array_equal(written, titled(tmp_path / "old.png", old))


def test_cli_layers_option_and_nonfinite_counts(tmp_path, capsys):
    folder = write_run(tmp_path, extra={layer_key("nan_count", "gradient", L2): 3.0})
    assert main(["report", str(folder), "--layers", r"blocks\.0\."]) == 0
    assert_valid_png(tmp_path / "fp8_heatmap_nan_count.png")  # drawn once a NaN was seen
    md = (tmp_path / "fp8_report.md").read_text()
    assert "Time series show `blocks.0.attn.qkv`." in md
    assert (f"| {L2} | gradient | nan_count | 3 (step 20) | 20 | 1 of 3 | the run diverges") in md
    # NaN in a gradient: clipping cannot remove it (test_q4_nonfinite), the learning rate
    assert f"{NOT_CLIPPED} | `{NONFINITE_CHANGE}` |" in md and "clipping_threshold (lower" not in md
    capsys.readouterr()


RUN = "run"  # a healthy run's metrics.jsonl, then the content appended


@pytest.mark.parametrize(("setup", "content", "args", "message"), [
    (None, None, [], "metrics.jsonl: not found"),
    (None, "", [], "metrics.jsonl: empty"),
    (None, '{"step": 0}\n', [], "metrics.jsonl:1: not a metrics record (no key 'metrics')"),
    (None, '{"step": 0, "metr', [], "metrics.jsonl: no metrics record; 1 line does not decode"),
    (RUN, "", ["--layers", "("], "--layers '(': bad regex"),
    (RUN, "", ["--layers", "nothing"], "--layers 'nothing' matches none of the 3 layers"),
    (RUN, "", ["--out", "afile"], "afile: not a folder (--out names the folder"),
    (RUN, "", ["--out", "afile/sub"], "afile/sub: cannot create the output folder (Not a directory)"),
    (RUN, '{"step": null, "metrics": {}}\n', [],
     "metrics.jsonl:4: key 'step': expected a step (an integer from 0 to 2**53), got null"),
    (RUN, '{"step": "x", "metrics": {}}\n', [],
     "metrics.jsonl:4: key 'step': expected a step (an integer from 0 to 2**53), got \"x\""),
    (RUN, json.dumps({"step": 10**16, "metrics": {layer_key("amax", "weight", L0): 1.0}}) + "\n",
     [], "metrics.jsonl:4: key 'step': expected a step (an integer from 0 to 2**53), got "
     "10000000000000000"),
    (RUN, json.dumps({"step": -5, "metrics": {layer_key("amax", "weight", L0): 1.0}}) + "\n",
     [], "metrics.jsonl:4: key 'step': expected a step (an integer from 0 to 2**53), got -5"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, setup, content, args, message):
    """On stderr, as `foundry-fp8 lint` prints them; never a traceback, never a hang."""
    if setup == RUN:
        write_run(tmp_path)
    if content is not None:
        with (tmp_path / "metrics.jsonl").open("a") as f:
            f.write(content)
    (tmp_path / "afile").write_text("")
    args = [str(tmp_path / a) if a.startswith("afile") else a for a in args]
    assert main(["report", str(tmp_path), *args]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and message in out.err
    assert out.err.count("\n") == 1 and not out.out


HOSTILE = ("a|b", "two\nlines", "<img src=x onerror=alert(1)>", "x/y/z", "tick`s", "$x^2$",
           "back\\slash")


def test_hostile_names_and_huge_values_render_safely(tmp_path, capsys):
    """Values near float64's max, `|`, newlines, HTML, `/`, backticks and mathtext in layer
    names: the report renders them as text, keeps every layer, draws every plot."""
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for i, step in enumerate((0, 10, 2**53)):
        metrics = {}
        for name in HOSTILE:
            for stat, value in HEALTHY.items():
                metrics[layer_key(stat, "weight", name)] = value
            metrics[layer_key("amax", "weight", name)] = 1.7e308 if i else 1e-300
            metrics[layer_key("rel_mse", "weight", name)] = 1e308
            metrics[layer_key("scale_ratio", "weight", name)] = 1e308 if i == 1 else 1e-308
            metrics[layer_key("underflow_pct", "weight", name)] = 100.0
        sink.write(step, metrics)
    assert main(["report", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert f"{len(HOSTILE)} flagged" in stdout or "flagged" in stdout
    md = (tmp_path / "fp8_report.md").read_text()
    outside_code = re.sub(r"`[^`\n]*`", "", md)  # a code span shows its text literally
    assert "<img" not in outside_code and "&lt;img src=x onerror=alert(1)>" in md
    for row in md.split("## Worst value per layer and tensor")[1].splitlines():
        if row.startswith("| ") and "---" not in row and "layer |" not in row:
            assert len(re.split(r"(?<!\\)\|", row)) == 2 + 2 + 6, row  # no cell split
    assert "a\\|b" in md and "two\\\\nlines" in md and "x/y/z" in md and "tick\\`s" in md
    assert load(tmp_path / "metrics.jsonl").layers == list(HOSTILE)  # `/` kept
    for png in tmp_path.glob("*.png"):
        assert_valid_png(png, min_pixels=10_000)


def test_initial_scale_steps_are_marked_not_flagged_or_ranked(tmp_path):
    """fp8_stats marks delayed scaling's first cast (scale 1.0) with `fp8_initial_scale`:
    expected underflow there is no finding, no worst value, and a grey heatmap cell."""
    layer = "blocks.0.fc"
    records = [(0, {layer_key("underflow_pct", "gradient", layer): 30.0,
                    layer_key("initial_scale", "gradient", layer): 1.0}),
               (10, {layer_key("underflow_pct", "gradient", layer): 0.5}),
               (20, {layer_key("underflow_pct", "gradient", layer): 7.0})]
    run = collect(records)
    assert "initial_scale" not in run.stats
    assert run.values[(layer, "gradient", "underflow_pct")] == {0: 30.0, 10: 0.5, 20: 7.0}
    assert math.isnan(heatmap_matrix(run, "underflow_pct", "gradient")[0][0])  # not coloured
    flags = replay(run, HealthTracker())
    assert [(f.step, f.value) for f in flags] == [(20, 7.0)]
    assert worst_values(run)[(layer, "gradient")]["underflow_pct"] == 7.0
    assert [(r.mean, r.worst) for r in worst_layers(run, "underflow_pct")] == [(3.75, 7.0)]


def test_a_run_killed_mid_write_still_gets_its_report(tmp_path, capsys):
    """A cut last line is normal life: skipped with one warning naming file and line. Cut at
    the end of the file it is also what a run still writing it shows (a report run during
    training, a copy synced mid-write): the warning said "a run killed mid-write" (QA s18); once
    a resumed run appended after it, it is a killed one's."""
    path = write_run(tmp_path) / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2])  # step 20 cut in half
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.err == (f"warning: {path}:3: skipped 1 line that does not decode (line 3; the "
                       "file's last line, not finished: the run is still writing it, was "
                       "killed mid-write, or its disk filled); the report covers the rest\n")
    assert load_skipping(path).steps == [0, 10]

    JsonlSink(path).write(30, {layer_key("underflow_pct", "gradient", L1): 6.0})  # resumed run
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert f"'{L1}' gradient: underflow_pct 6 % at step 30" in out.out
    assert out.err == (f"warning: {path}:3: skipped 1 line that does not decode (line 3; a run "
                       "killed mid-write leaves one); the report covers the rest\n")
    assert load_skipping(path).steps == [0, 10, 30]


def load_skipping(path: Path):
    return collect(read_jsonl(path, []))


def in_step_order(metrics_file: Path) -> None:
    """The records sorted by step, as a run writes them (a step going back is a resume)."""
    lines = metrics_file.read_bytes().splitlines(keepends=True)
    metrics_file.write_bytes(b"".join(sorted(lines, key=lambda line: json.loads(line)["step"])))


def test_the_guard_section_reads_its_series_and_fallback_records(tmp_path, capsys):
    """fp8_guard's series in metrics.jsonl and its fallbacks in hparams.json (a record as the
    callback logs it, NaN included, and one that is not a record): the fallback table, the FP8
    share, the static YAML keeping te_swap's own exclude, the flagged layer marked; the bad
    record is one warning."""
    from foundry_fp8.guard import FALLBACK_LAYERS, FALLBACK_PREFIX, FP8_FLOPS_SHARE, Fallback

    folder = write_run(tmp_path)
    sink = JsonlSink(folder / "metrics.jsonl")
    for step, layers, share in ((0, 0, 0.8), (10, 1, 0.55), (20, 1, 0.55)):
        sink.write(step, {FALLBACK_LAYERS: float(layers), FP8_FLOPS_SHARE: share})
    in_step_order(folder / "metrics.jsonl")
    fallback = Fallback(L1, 10, 0.25, ("message",), {"gradient/cos_sim": float("nan")},
                        ("gradient underflow_pct 4 % (> 3 %)",))
    hparams = {"algorithms": {"te_swap": {"exclude": "head|x"}},
               "callbacks": {"fp8_stats": {}, "fp8_guard": {}},
               FALLBACK_PREFIX + L1: fallback.record(), FALLBACK_PREFIX + "bogus": "text"}
    (folder / "hparams.json").write_text(json.dumps(hparams))
    assert main(["report", str(folder)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {folder / 'hparams.json'}: key 'fp8/guard/fallback/bogus': not an fp8_guard "
        "fallback record; left out"]
    md = (folder / "fp8_report.md").read_text()
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    assert "80.0 % at the first logging step, 55.0 % at the last" in section
    assert f"| {L1} | 11 | the end | 25.0 % | gradient underflow_pct 4 % (> 3 %) |" in section
    assert ("```yaml\nalgorithms: {te_swap: {exclude: '(?:head|x)|"
            "^(?:model\\.)?(?:transformer\\.)?blocks\\.1\\.ffn\\.up(?:\\..+)?$'}}\n```"
            in section)
    assert f"| {L1} (high precision from step 11: fp8_guard) | gradient | underflow_pct |" in md
    assert f"| {L2} | activation | cos_sim |" in md  # not in fallback: unmarked
    assert f"fp8_guard moved 1 layer(s) to high precision: {L1} from step 11." in captured.out
    assert math.isnan(Fallback.from_dict(json.loads(json.dumps(fallback.record()))).numbers[
        "gradient/cos_sim"])  # NaN read back as a float


@pytest.mark.parametrize(("counts", "hparams", "said"), [
    ((0, 1, 2), {"callbacks": {"fp8_stats": {}, "fp8_guard": {}}},
     "fp8_guard ran 2 layer(s) in high precision per its series `fp8/guard/fallback_layers`, the "
     "first from step 11;"),
    ((0, 1, 0), None,  # re-promoted by the end; no hparams.json at all
     "fp8_guard ran up to 1 layer(s) in high precision per its series "
     "`fp8/guard/fallback_layers`, the first from step 11 (0 at the last logging step);"),
    ((0, 0, 3), '{"callbacks": {"fp8_stats": {}, "fp8_guard": {}}, "fp8/guard/fallb',  # cut
     "fp8_guard ran 3 layer(s) in high precision per its series `fp8/guard/fallback_layers`, the "
     "first from step 21;"),
], ids=["records-not-written", "no-hparams-json", "hparams-json-cut"])
def test_fallbacks_the_series_counts_without_records_are_said_missing(tmp_path, capsys, counts,
                                                                     hparams, said):
    """QA: with fp8_guard's records missing from hparams.json (a logger failed) but its series
    counting layers in fallback and the FP8 share falling, the report said "moved no layer to
    high precision". It says what the series shows (the decision at step 10 runs in high
    precision from step 11) and that the records are missing."""
    from foundry_fp8.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE

    folder = write_run(tmp_path)
    sink = JsonlSink(folder / "metrics.jsonl")
    for step, layers, share in zip(STEPS, counts, (0.8, 0.55, 0.3), strict=True):
        sink.write(step, {FALLBACK_LAYERS: float(layers), FP8_FLOPS_SHARE: share})
    in_step_order(folder / "metrics.jsonl")
    if hparams is not None:
        (folder / "hparams.json").write_text(
            hparams if isinstance(hparams, str) else json.dumps(hparams))
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    missing = (" their records (`fp8/guard/fallback/<layer>`: which layers, and why) are "
               "missing from hparams.json.")
    assert f"\n{said}{missing} FP8 share of the linear-GEMM FLOPs (`fp8/guard/fp8_flops_share`):"\
           " 80.0 % at the first logging step, 30.0 % at the last.\n" in section
    assert f"\n{said}{missing}\n" in out
    assert "moved no layer" not in md and "fp8_guard moved" not in out


def test_a_flag_line_s_detail_is_of_the_step_of_its_value(tmp_path, capsys):
    """QA: `nan_count 1.638e+04 at step 5 (1 NaN and 0 Inf elements...)`: the worst value and
    step with the first flagged step's counts. L0's activation holds 1 NaN and 2 Inf at step 10,
    16384 NaN at step 20: the line is all step 20's; the markdown gives the worst value's step
    beside the first flagged one."""
    path = write_run(tmp_path) / "metrics.jsonl"
    nan, inf = (layer_key(s, "activation", L0) for s in ("nan_count", "inf_count"))
    JsonlSink(path).write(10, {nan: 1.0, inf: 2.0})  # a step logged again keeps the later value
    JsonlSink(path).write(20, {nan: 16384.0, inf: 0.0})
    assert main(["report", str(tmp_path)]) == 0
    assert (f"\n  '{L0}' activation: nan_count 1.638e+04 at step 20 (16384 NaN and 0 Inf "
            f"elements, before any FP8 cast; 2 of 3 steps). Likely cause: {NONFINITE_CAUSE}. "
            f"Change: {NONFINITE_CHANGE}\n") in capsys.readouterr().out
    md = (tmp_path / "fp8_report.md").read_text()
    assert f"| {L0} | activation | nan_count | 1.638e+04 (step 20) | 10 | 2 of 3 | the run " in md


@pytest.mark.parametrize("with_current", [False, True])
def test_series_row_labels_stay_inside_the_figure_and_apart(tmp_path, with_current):
    """QA: `fp8_timeseries.png` of a real run showed its row labels overrunning each other, the
    scale_ratio one cut at the figure's edge (one line of 85 characters for a 2.1-inch row).
    Measured with matplotlib's own text extents after drawing."""
    from foundry_fp8.health.plots import choose_layers, draw_series

    extra = {layer_key("current_scale", t, layer): 448.0 for layer in (L0, L1, L2)
             for t in ("activation", "gradient")} if with_current else None
    run = load(write_run(tmp_path, extra) / "metrics.jsonl")
    fig = draw_series(run, choose_layers(run))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.yaxis.label.get_window_extent(renderer) for ax in fig.axes
             if ax.yaxis.label.get_text()]
    assert len(boxes) == len([s for s in run.stats if s in ("amax", "scale", "current_scale",
                                                            "scale_ratio")])
    for box in boxes:
        assert 0 <= box.x0 and 0 <= box.y0 and box.y1 <= fig.bbox.height, box
    for upper, lower in zip(boxes, boxes[1:], strict=False):
        assert not upper.overlaps(lower), (upper, lower)


def test_a_fallen_layers_change_to_run_it_in_fp8_would_run_it_in_fp8(tmp_path, capsys):
    """QA: for `make run`'s fault (the last block's out_proj, fallen back by fp8_guard) the report
    said "... or, to run it in FP8: algorithms.te_swap.keep_last_blocks: 1", which keeps that
    layer out of FP8. Checked with te_swap's own planner (`plan_swap`): a change offered "to run
    it in FP8" converts the layer; the flag whose change keeps it out offers none."""
    import torch.nn as nn

    from foundry_fp8.guard import FALLBACK_PREFIX, Fallback
    from foundry_fp8.options import build
    from foundry_fp8.swap import plan_swap

    layers = [f"blocks.{i}.proj" for i in range(3)]
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (0, 10, 20):
        metrics = {}
        for layer in layers:
            bad = layer == layers[-1] and step > 0
            stats = {**HEALTHY, "underflow_pct": 20.0 if bad else 0.0,
                     "overflow_pct": 1.5 if bad and step == 10 else 0.0,
                     "scale_ratio": 3.0 if bad and step == 10 else 1.0}
            metrics.update({layer_key(s, "activation", layer): v for s, v in stats.items()})
        sink.write(step, metrics)
    fallback = Fallback(layers[-1], 10, 0.33, ("message",), {}, ("activation underflow",))
    (tmp_path / "hparams.json").write_text(json.dumps({
        "callbacks": {"fp8_stats": {}, "fp8_guard": {}},
        FALLBACK_PREFIX + layers[-1]: fallback.record()}))
    assert main(["report", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith(f"  '{layers[-1]}'")]
    assert len(lines) == 2

    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(64, 64)}) for _ in layers)

    def converts(change: str) -> bool:
        key, _, value = change.removeprefix("algorithms.te_swap.").partition(": ")
        value = value.partition(" (")[0]  # the spike's change names the keys to remove
        options = {"backend": "emulate", "min_gemm_size": 0}
        if key.startswith("fp8_recipe."):
            options["fp8_recipe"] = {key.removeprefix("fp8_recipe."): value}
        else:
            options[key] = int(value)
        plan = plan_swap(model, build("te_swap", options))
        return {d.name: d.convert for d in plan.decisions}[layers[-1]]

    offered = [line.split(", or, to run it in FP8: ")[1] for line in lines
               if ", or, to run it in FP8: " in line]
    assert [change.partition(" (")[0] for change in offered] == [
        "algorithms.te_swap.fp8_recipe.scaling: current"]
    assert all(converts(change) for change in offered)
    assert not converts("algorithms.te_swap.keep_last_blocks: 1")  # the one no longer offered
    md = (tmp_path / "fp8_report.md").read_text()
    assert "to run it in FP8: `algorithms.te_swap.keep_last_blocks" not in md
    assert "to run it in FP8: `algorithms.te_swap.fp8_recipe.scaling: current (and remove " in md
