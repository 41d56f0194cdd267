"""`foundry-fp8 report`: worst values, flagged layers, chosen layers and the PNGs, on a
metrics.jsonl written by hand with known numbers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8 import report
from foundry_fp8.cli import main
from foundry_fp8.jsonl import JsonlSink

L0, L1, L2 = "model.blocks.0.attn.qkv", "model.blocks.1.ffn.up", "model.blocks.2.ffn.down"
STEPS = (0, 10, 20)
# (layer, tensor, stat) -> value per step; None: not logged. Everything else is healthy.
SPECIAL = {
    (L1, "gradient", "underflow_pct"): (1.0, 4.0, 9.0),  # rises past the 5 % threshold
    (L2, "gradient", "underflow_pct"): (0.5, 0.5, None),  # L2 not logged at step 20
    (L2, "activation", "cos_sim"): (0.9995, 0.98, None),
    (L1, "activation", "scale_ratio"): (1.0, 1.5, 1.0),  # outgrew its delayed scale at step 10
    (L0, "activation", "amax"): (2.0, 4.0, 8.0),
}
HEALTHY = {"amax": 1.0, "underflow_pct": 0.0, "overflow_pct": 0.0, "mse": 1e-6, "cos_sim": 0.9995,
           "scale": 448.0, "scale_ratio": 1.0, "nan_count": 0.0, "inf_count": 0.0}


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
                    metrics[f"fp8/{layer}/{tensor}/{stat}"] = value
        sink.write(step, {**metrics, **(extra or {})} if step == 20 else metrics)
    return folder


def assert_valid_png(path: Path, min_pixels: int = 100_000) -> None:
    """Written, decodable, of a real size, and not blank."""
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[0] * image.shape[1] >= min_pixels, image.shape
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_report_keeps_worst_values(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(0, {"fp8/blocks.0.up/weight/underflow_pct": 1.0,
                   "fp8/blocks.0.up/weight/cos_sim": 0.999, "loss/train/total": 3.0})
    sink.write(10, {"fp8/blocks.0.up/weight/underflow_pct": 7.5,
                    "fp8/blocks.0.up/weight/cos_sim": 0.98})
    sink.write(20, {"fp8/blocks.0.up/weight/underflow_pct": 2.0,
                    "fp8/blocks.0.up/weight/cos_sim": float("nan")})

    row = report.worst_stats(tmp_path / "metrics.jsonl")[("blocks.0.up", "weight")]
    assert row["underflow_pct"] == 7.5
    assert row["cos_sim"] == 0.98  # NaN never hides a real bad value
    out = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "| blocks.0.up | weight | 7.5 |" in out.stdout
    assert (tmp_path / "fp8_report.md").exists()


def test_report_without_fp8_metrics_exits_2(tmp_path):
    JsonlSink(tmp_path / "metrics.jsonl").write(0, {"loss/train/total": 1.0})
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "fp8_stats" in result.stderr and not result.stdout


def test_data_preparation_is_exact(tmp_path):
    run = report.load(write_run(tmp_path) / "metrics.jsonl")
    assert run.layers == [L0, L1, L2] and run.tensors == ["activation", "gradient"]
    assert run.steps == [0, 10, 20]
    assert run.stats == ["underflow_pct", "overflow_pct", "mse", "cos_sim", "nan_count",
                         "inf_count", "amax", "scale", "scale_ratio"]
    matrix = report.heatmap_matrix(run, "underflow_pct", "gradient")
    assert matrix[:2] == [[0.0, 0.0, 0.0], [1.0, 4.0, 9.0]]
    assert matrix[2][:2] == [0.5, 0.5] and math.isnan(matrix[2][2])  # not logged at step 20
    assert report.series(run, L0, "activation", "amax") == ([0, 10, 20], [2.0, 4.0, 8.0])
    assert report.series(run, L2, "activation", "cos_sim") == ([0, 10], [0.9995, 0.98])

    worst = report.worst_values(run)
    assert worst[(L1, "gradient")]["underflow_pct"] == 9.0
    assert worst[(L2, "activation")]["cos_sim"] == 0.98
    assert worst[(L1, "activation")]["scale_ratio"] == 1.5
    assert "scale" not in worst[(L1, "activation")]  # not ranked: no better or worse

    found = [(f.layer, f.tensor, f.stat, f.value, f.step, f.steps_over, f.steps_logged)
             for f in report.findings(run, report.Thresholds())]
    # scale_ratio 1.5 is not flagged: fp8_stats does not warn on it (overflow_pct judges it)
    assert found == [(L2, "activation", "cos_sim", 0.98, 10, 1, 2),  # bad on most steps first
                     (L1, "gradient", "underflow_pct", 9.0, 20, 1, 3)]
    assert report.worst_layers(run, "underflow_pct") == [
        report.Ranked(L1, "gradient", 14 / 3, 9.0, 20), report.Ranked(L2, "gradient", 0.5, 0.5, 0)]
    assert report.worst_layers(run, "overflow_pct") == []  # 0 everywhere is not a ranking
    assert report.choose_layers(run) == [
        (L0, "first block"), (L1, "most underflow: 4.67 % of gradient on average"),
        (L2, "last block")]
    assert report.choose_layers(run, r"ffn\.") == [(L1, ""), (L2, "")]


def test_collect_keeps_the_later_value_of_a_step_logged_twice():
    run = report.collect([(5, {"fp8/a/weight/mse": 1.0, "fp8/a/weight/note": "text"}),
                          (5, {"fp8/a/weight/mse": 2.0, "fp8/a": 3.0, "lr": 0.1})])
    assert run.values == {("a", "weight", "mse"): {5: 2.0}}


@pytest.mark.parametrize(("layers", "prefix"), [
    ([L0, L1, L2], "model."),  # keeps `blocks.` before the block number
    (["m.enc.attn.q", "m.enc.attn.k"], "m.enc.attn."),
    (["a.x", "b.x"], ""),
    ([L0], ""),
])
def test_common_prefix(layers, prefix):
    assert report.common_prefix(layers) == prefix


def test_choose_layers_without_block_numbers_and_without_underflow():
    run = report.collect([(0, {f"fp8/{name}/weight/underflow_pct": 0.0
                               for name in ("embed", "mid", "head")})])
    assert report.choose_layers(run) == [("embed", "first block"), ("head", "last block")]
    assert report.block_index("h.12.mlp") == 12 and report.block_index("lm_head") is None
    assert report.tick_indices(30, 10) == list(range(0, 30, 3))


def test_log_limits_leave_an_outlying_first_step_off_the_scale():
    # delayed scaling: step 0 runs on the initial scale 1.0, then ~100
    assert report.log_limits([([0, 10, 20], [1.0, 100.0, 200.0])]) == (100 / 1.5, 300.0, 0)
    assert report.log_limits([([0, 10, 20], [20.0, 100.0, 200.0])]) is None
    assert report.log_limits([([0], [1.0])]) is None


def test_thresholds_follow_the_run_and_default_to_fp8_stats():
    from foundry_fp8.monitor import MonitorConfig

    default, config = report.Thresholds(), MonitorConfig()
    assert (default.max_underflow_pct, default.max_overflow_pct, default.min_cos_sim) == (
        config.max_underflow_pct, config.max_overflow_pct, config.min_cos_sim)
    hparams = {"callbacks": {"fp8_stats": {"interval": "10ba", "max_underflow_pct": 10}}}
    assert report.thresholds_from_hparams(hparams).max_underflow_pct == 10.0
    assert report.thresholds_from_hparams({"callbacks": {}}) == report.Thresholds()


def test_cli_writes_plots_and_markdown(tmp_path, capsys):
    folder = write_run(tmp_path / "run", extra={f"fp8/{L1}/gradient/new_stat": 2.0})
    out = tmp_path / "report"
    assert main(["report", str(folder), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    pngs = ["fp8_heatmap_underflow_pct.png", "fp8_heatmap_overflow_pct.png",
            "fp8_heatmap_mse.png", "fp8_heatmap_cos_sim.png",
            "fp8_heatmap_new_stat.png",  # a statistic this version does not know
            "fp8_timeseries.png"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(pngs)  # no NaN/Inf count plots
    for name in pngs:
        assert_valid_png(out / name)
        assert name in stdout
    assert "2 flagged" in stdout and f"{L1} gradient: underflow_pct 9 % at step 20" in stdout

    md = (out / "fp8_report.md").read_text()
    assert f"| {L1} | gradient | underflow_pct | 9 % | 20 | > 5 % | 1 of 3 |" in md
    assert f"| {L2} | activation | cos_sim | 0.98 | 10 | < 0.99 | 1 of 2 |" in md
    assert "| scale_ratio |" not in md.split("## Worst layers")[0]  # shown, not flagged
    assert "scale_ratio is not flagged" in md and "scale_ratio > " not in md
    assert "**scale_ratio**: `blocks.1.ffn.up` activation mean 1.167, worst 1.5 (step 10)" in md
    assert ("**underflow_pct**: `blocks.1.ffn.up` gradient mean 4.67 %, worst 9 % (step 20); "
            "`blocks.2.ffn.down` gradient mean 0.5 %, worst 0.5 % (step 0)\n") in md
    assert all(f"![{name}]({name})" in md for name in pngs)
    assert f"| {L1} | gradient | 9 |" in md  # the full table, worst underflow first


def test_cli_layers_option_and_nonfinite_counts(tmp_path, capsys):
    folder = write_run(tmp_path, extra={f"fp8/{L2}/gradient/nan_count": 3.0})
    assert main(["report", str(folder), "--layers", r"blocks\.0\."]) == 0
    assert_valid_png(tmp_path / "fp8_heatmap_nan_count.png")  # drawn once a NaN was seen
    md = (tmp_path / "fp8_report.md").read_text()
    assert "Time series show `model.blocks.0.attn.qkv`." in md
    assert f"| {L2} | gradient | nan_count | 3 | 20 | > 0 | 1 of 3 |" in md
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
     "metrics.jsonl:4: key 'step': expected an integer, got null"),
    (RUN, '{"step": "x", "metrics": {}}\n', [],
     "metrics.jsonl:4: key 'step': expected an integer, got \"x\""),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, setup, content, args, message):
    """On stderr, as `foundry-fp8 lint` prints them; never a traceback."""
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


def test_initial_scale_steps_are_plotted_but_not_flagged_or_ranked(tmp_path):
    """fp8_stats marks delayed scaling's first cast (scale 1.0) with `initial_scale`: expected
    underflow there is no finding, as fp8_stats does not warn about it either."""
    layer = "model.blocks.0.fc"
    records = [(0, {f"fp8/{layer}/gradient/underflow_pct": 30.0,
                    f"fp8/{layer}/gradient/initial_scale": 1.0}),
               (10, {f"fp8/{layer}/gradient/underflow_pct": 0.5}),
               (20, {f"fp8/{layer}/gradient/underflow_pct": 7.0})]
    run = report.collect(records)
    assert "initial_scale" not in run.stats
    assert run.values[(layer, "gradient", "underflow_pct")] == {0: 30.0, 10: 0.5, 20: 7.0}
    found = report.findings(run, report.Thresholds())
    assert [(f.step, f.value, f.steps_over, f.steps_logged) for f in found] == [(20, 7.0, 1, 2)]
    assert report.worst_values(run)[(layer, "gradient")]["underflow_pct"] == 7.0
    assert [(r.mean, r.worst) for r in report.worst_layers(run, "underflow_pct")] == [(3.75, 7.0)]


def test_a_run_killed_mid_write_still_gets_its_report(tmp_path, capsys):
    """A cut last line is normal life: skipped with one warning naming file and line."""
    path = write_run(tmp_path) / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2])  # step 20 cut in half
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.err == (f"warning: {path}:3: skipped 1 line that does not decode (line 3; a run "
                       "killed mid-write leaves one); the report covers the rest\n")
    assert report.load(path).steps == [0, 10]

    JsonlSink(path).write(30, {f"fp8/{L1}/gradient/underflow_pct": 6.0})  # the resumed run
    assert main(["report", str(tmp_path)]) == 0
    assert f"{L1} gradient: underflow_pct 6 % at step 30" in capsys.readouterr().out
    assert report.load(path).steps == [0, 10, 30]
