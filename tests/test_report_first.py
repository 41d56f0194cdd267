"""`foundry-fp8 report` names where a divergence began: the first flagged step and what was
flagged there, ahead of the table that ranks flags by how many steps they held."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from foundry_fp8.jsonl import JsonlSink

LAYERS = ("blocks.0.attn.Wqkv", "blocks.0.ffn.down_proj", "blocks.1.attn.Wqkv",
          "blocks.1.ffn.down_proj")
TENSORS = ("activation", "weight", "gradient")
HEALTHY = {"amax": 1.0, "underflow_pct": 0.0, "overflow_pct": 0.0, "rel_mse": 1e-3,
           "cos_sim": 0.9995, "scale_ratio": 1.0, "nan_count": 0.0, "inf_count": 0.0}
SPIKED = ("blocks.1.ffn.down_proj", "weight")


def diverging_run(folder: Path, spike_at: int | None, nan_from: int = 6, steps: int = 13,
                  spiked: tuple[str, str] = SPIKED) -> Path:
    """A run as the tiny MPT's went when one weight was multiplied by 1e36 (QA session 17): that
    weight overflows with a scale 1e4 too small at `spike_at`, then every layer's tensors hold
    NaN from `nan_from` to the end."""
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in range(steps):
        metrics: dict[str, float] = {"loss/train/total": 3.0}
        for layer in LAYERS:
            for tensor in TENSORS:
                stats = dict(HEALTHY)
                if (layer, tensor) == spiked and step == spike_at:
                    stats.update(overflow_pct=100.0, scale_ratio=1e4, amax=1e4)
                if step >= nan_from:
                    stats["nan_count"] = 4096.0
                metrics.update({layer_key(s, tensor, layer): v for s, v in stats.items()})
        sink.write(step, metrics)
    return folder


def flagged_section(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(" flagged"))
    return lines[start:start + 12]


def test_the_spike_that_started_a_divergence_is_named_first(tmp_path, capsys):
    """The spike is flagged at 1 of 12 judged steps, each NaN row at 7: ranked by share of steps
    flagged, the spike came last, past the terminal's 10 lines and under 12 NaN rows."""
    folder = diverging_run(tmp_path, spike_at=5)
    assert main(["report", str(folder)]) == 0
    section = flagged_section(capsys.readouterr().out)
    assert section[0] == "13 flagged"  # 12 NaN rows and the spike
    assert section[1].startswith(
        "  First flagged at step 5: 'blocks.1.ffn.down_proj' weight overflow_pct 100 % "
        "(> 0.01 % with scale_ratio 1e+04 >= 2; likely cause: an amax spike"), section[1]
    # the other 11 layer tensors went bad at step 6, after it
    assert section[1].endswith(". 11 other layer tensor(s) flagged later."), section[1]
    markdown = (folder / "fp8_report.md").read_text()
    table = markdown.index("| layer | tensor |")
    first = markdown.index("First flagged at step 5: `blocks.1.ffn.down_proj` weight "
                           "overflow_pct 100 %")
    assert first < table


@pytest.mark.parametrize("nan_from", [0, 6])
def test_several_tensors_flagged_first_at_one_step_are_counted(tmp_path, capsys, nan_from):
    folder = diverging_run(tmp_path, spike_at=None, nan_from=nan_from)
    assert main(["report", str(folder)]) == 0
    head = flagged_section(capsys.readouterr().out)[1]
    assert head.startswith(f"  First flagged at step {nan_from}: 'blocks.0.attn.Wqkv' "
                           "activation nan_count 4096 ("), head
    assert head.endswith("; and 9 more at that step."), head  # 12 at once, 3 named


def test_the_report_heatmap_draws_nan_cells_blue_not_grey_as_not_logged(tmp_path):
    """Pixels of the report's figure (matplotlib's own transform from data to pixels): a cell
    logged as NaN is `#1f4e9c` and the caption says so; a cell cast with the initial scale
    stays grey (#d0d0d0)."""
    import numpy as np

    from foundry_fp8.health import Thresholds
    from foundry_fp8.health.plots import draw_heatmap
    from foundry_fp8.report.read import load_run

    folder = diverging_run(tmp_path, spike_at=5)
    with (folder / "metrics.jsonl").open("a") as f:  # a weight's first cast, on the initial scale
        f.write('{"step": 13, "metrics": {"fp8_initial_scale/weight/blocks.0.attn.Wqkv": 1, '
                '"fp8_overflow_pct/weight/blocks.0.attn.Wqkv": 0.0}}\n')
    run, _ = load_run(folder / "metrics.jsonl", print)
    for tensor in TENSORS:  # NaN statistics in every row from step 6 on
        run.add(8, "blocks.0.attn.Wqkv", tensor, "overflow_pct", float("nan"))
    figure = draw_heatmap(run, "overflow_pct", Thresholds())
    figure.canvas.draw()
    image = np.asarray(figure.canvas.buffer_rgba())[..., :3]
    weight = figure.axes[1]
    assert weight.get_title().startswith("weight")

    def colour(row: int, step: int) -> tuple[int, ...]:
        x, y = weight.transData.transform((run.steps.index(step), row))
        return tuple(int(c) for c in image[image.shape[0] - int(round(y)), int(round(x))])

    assert colour(0, 8) == (0x1F, 0x4E, 0x9C)  # NaN
    assert colour(0, 13) == (0xD0, 0xD0, 0xD0)  # the initial scale's cast
    assert colour(0, 2) != (0x1F, 0x4E, 0x9C)  # a healthy cell, coloured by its value
    assert "blue: logged as NaN" in figure._suptitle.get_text()


def test_a_file_of_summary_series_only_names_the_step_they_first_count_a_flagged_layer(
        tmp_path, capsys):
    """The per-layer keys left out, fp8_stats' summaries still say when trouble began; the
    report said "fp8_stats ran but logged no layer ('.*' matched nothing)" of such a file."""
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(8):
        sink.write(step, {"loss/train/total": 3.0, "fp8/weight/worst_overflow_pct": 0.0,
                          "fp8/weight/flagged_layers": float(step >= 5),
                          "fp8/gradient/nonfinite": float(step >= 6),
                          "fp8/flagged_layers": float(step >= 5)})
    (tmp_path / "hparams.json").write_text('{"callbacks": {"fp8_stats": {}}}')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "only fp8_stats' summary series" in err, err
    assert "first count a flagged layer at step 5 (fp8/weight/flagged_layers 1)" in err, err


def test_the_time_series_draw_the_first_flagged_layer_by_default(tmp_path, capsys):
    """A middle layer spiked: neither the first block's first layer, the last block's last nor
    the most underflowing; its amax is the one to see jump."""
    folder = diverging_run(tmp_path, spike_at=5, spiked=("blocks.0.ffn.down_proj", "weight"))
    assert main(["report", str(folder)]) == 0
    markdown = (folder / "fp8_report.md").read_text()
    assert ("Time series show `blocks.0.attn.Wqkv` (first block), `blocks.0.ffn.down_proj` "
            "(first flagged, at step 5), `blocks.1.ffn.down_proj` (last block).") in markdown


@pytest.mark.parametrize(("code", "out", "hint"), [
    (errno.EACCES, False, True), (errno.EROFS, False, True), (errno.EACCES, True, False),
    (errno.ENOSPC, False, False)])
def test_a_run_folder_the_report_may_not_write_says_out_writes_elsewhere(
        tmp_path, capsys, monkeypatch, code, out, hint):
    """Root ignores chmod, so the write itself is refused here, as a read-only mount or another
    user's run folder refuses it."""
    import foundry_fp8.report.cli as report_cli

    def refused(path: Path, data: bytes) -> None:
        raise OSError(code, os.strerror(code), str(path))

    folder = diverging_run(tmp_path / "run", spike_at=5)
    monkeypatch.setattr(report_cli, "write_output", refused)
    args = ["report", str(folder)] + (["--out", str(tmp_path / "out")] if out else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write ({os.strerror(code)})" in err, err
    assert ("; --out DIR writes the report elsewhere" in err) == hint, err


@pytest.mark.parametrize("dump_folder", [None, "dumps/{run_name}"], ids=["default", "own"])
def test_the_headline_names_fp8_stats_dump_of_the_first_flagged_tensor(tmp_path, capsys,
                                                                       dump_folder):
    """fp8_stats dumped the spiked weight at the step it was first flagged (`dump_steps`, its
    module's full name in the file): the headline names the file to open, on the terminal and
    in fp8_report.md; a dump of another step or another layer is not named."""
    from safetensors.torch import save_file

    folder = diverging_run(tmp_path, spike_at=5)
    if dump_folder is not None:
        (folder / "hparams.json").write_text(json.dumps(
            {"run_name": "tiny", "callbacks": {"fp8_stats": {"dump_folder": dump_folder}}}))
    dumps = folder / ("fp8_dumps" if dump_folder is None else "dumps/tiny")
    dumps.mkdir(parents=True)
    tensor = torch.ones(4)
    save_file({"model.transformer.blocks.0.attn.Wqkv/weight": tensor},
              str(dumps / "step0000005-rank0.safetensors"))  # not the flagged layer
    save_file({"model.transformer.blocks.1.ffn.down_proj/weight": tensor},
              str(dumps / "step0000004-rank0.safetensors"))  # not the flagged step
    assert main(["report", str(folder), "--out", str(tmp_path / "before")]) == 0
    assert "dump" not in flagged_section(capsys.readouterr().out)[1]
    save_file({"model.transformer.blocks.1.ffn.down_proj/weight": tensor,
               "model.transformer.blocks.1.ffn.down_proj/weight/scale": torch.tensor(1.0)},
              str(dumps / "step0000005-rank1.safetensors"), metadata={"step": "5"})
    assert main(["report", str(folder)]) == 0
    headline = flagged_section(capsys.readouterr().out)[1]
    assert headline.startswith("  First flagged at step 5: 'blocks.1.ffn.down_proj' weight")
    path = dumps / "step0000005-rank1.safetensors"
    assert headline.endswith(f" fp8_stats' dump of 'blocks.1.ffn.down_proj' weight there: {path}.")
    markdown = (folder / "fp8_report.md").read_text()
    assert f"fp8_stats' dump of `blocks.1.ffn.down_proj` weight there: `{path}`." in markdown
