"""`foundry-fp8 report` on a run where fp8_guard moved layers to high precision: the heatmaps
(the report's figures and the raster images fp8_stats logs) hatch the cells of the steps each
layer ran in high precision, and the tables mark its rows `(what-if)`; layer names in the text
are the keys' own, and `--layers` takes te_swap's full module names too. The expected cells and
names are worked out here from the JSONL text and the records, not by the report's code."""

from __future__ import annotations

import json
import re
from pathlib import Path

from foundry_fp8.cli import main
from foundry_fp8.health import Thresholds, layer_key
from foundry_fp8.health.plots import draw_heatmap, heatmap
from foundry_fp8.health.raster import FRAME, layout, raster
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.report.cli import make_report

L0, L1, L2 = "blocks.0.attn.Wqkv", "blocks.1.attn.out_proj", "blocks.1.ffn.down_proj"
TENSORS = ("activation", "weight", "gradient")
STEPS = (0, 10, 20, 30, 40, 50)
HEALTHY = {"underflow_pct": 0.0, "overflow_pct": 0.0, "rel_mse": 1e-3, "cos_sim": 0.9995,
           "amax": 1.0, "scale_ratio": 1.0}


def write_run(folder: Path, layers: tuple[str, ...] = (L0, L1, L2)) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in STEPS:
        metrics = {layer_key(stat, tensor, layer): value + (stat == "underflow_pct") * (
                       0.01 * step + ((layer, tensor) == (L1, "activation")))
                   for layer in layers for tensor in TENSORS for stat, value in HEALTHY.items()}
        if L1 in layers:  # over 5 % at every step, worst at step 20 (in high precision)
            metrics[layer_key("underflow_pct", "activation", L1)] = 9.0 if step == 20 else 6.0
        sink.write(step, {"loss/train/total": 3.0, **metrics})
    return folder


def guarded(folder: Path) -> Path:
    """L1 falls back at step 10 and is back in FP8 after step 30; L2 falls back at step 40."""
    def fallback(layer: str, step: int) -> dict:
        return {"layer": layer, "step": step, "flops_share": 0.1, "reasons": ["flagged"],
                "numbers": {}, "flagged": []}

    (folder / "hparams.json").write_text(json.dumps({
        "callbacks": {"fp8_stats": {}, "fp8_guard": {"repromote_after": 2}},
        "fp8/guard/fallback/" + L1: fallback(L1, 10), "fp8/guard/fallback/" + L2: fallback(L2, 40),
        "fp8/guard/repromotion/" + L1: {"layer": L1, "step": 30, "fallen_at": 10,
                                        "healthy_steps": 2, "numbers": {}}}))
    return folder


def expected_cells(folder: Path) -> set[tuple[str, str, int]]:
    """(layer, tensor, step) logged while fp8_guard ran the layer in high precision: the steps
    after a fallback's, up to its re-promotion's, read from the files with plain json."""
    hparams = json.loads((folder / "hparams.json").read_text())
    back = {v["layer"]: v["step"] for k, v in hparams.items()
            if k.startswith("fp8/guard/repromotion/")}
    logged = set()
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in record["metrics"]:
            if key.startswith("fp8_"):
                _, tensor, layer = key.split("/", 2)
                logged.add((layer, tensor, record["step"]))
    cells = set()
    for key, record in hparams.items():
        if key.startswith("fp8/guard/fallback/"):
            end = back.get(record["layer"], float("inf"))
            cells |= {(layer, tensor, step) for layer, tensor, step in logged
                      if layer == record["layer"] and record["step"] < step <= end}
    return cells


def test_heatmaps_and_tables_mark_what_fp8_guard_ran_in_high_precision(tmp_path, capsys):
    """QA s15 (the tiny MPT with an outlier injected into blocks.1.attn.out_proj): fp8_guard ran
    it in high precision from step 16, yet the heatmaps drew steps 20-35 as FP8 casts of 11-16 %
    underflow, and the worst-value tables gave its what-if numbers (cos_sim 0.37) unmarked."""
    folder = guarded(write_run(tmp_path))
    cells = expected_cells(folder)
    assert {(layer, step) for layer, _, step in cells} == {(L1, 20), (L1, 30), (L2, 50)}
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    # QA 19: a row is marked by where its worst values came from, not for a what-if step
    # somewhere (blocks.1.attn.out_proj's worst values, from FP8 casts, were marked what-if).
    # Here only underflow_pct varies (the other statistics are the same at every step, so FP8
    # steps reach their worst): a row's mark is "in part" where its largest underflow_pct,
    # read with plain json, was reached only at what-if steps.
    underflow: dict[tuple[str, str], dict[int, float]] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record["metrics"].items():
            if key.startswith("fp8_underflow_pct/"):
                _, tensor, layer = key.split("/", 2)
                underflow.setdefault((layer, tensor), {})[record["step"]] = value
    marked_rows = {row for row, by_step in underflow.items()
                   if all((*row, step) in cells for step, value in by_step.items()
                          if value == max(by_step.values()))}
    assert marked_rows == {(L1, "activation"), *((L2, tensor) for tensor in TENSORS)}
    assert (L1, "weight") in {(layer, tensor) for layer, tensor, _ in cells}  # what-if at 20, 30
    table = md.split("## Worst value per layer and tensor", 1)[1]
    assert "(what-if in part): some of them are." in table
    for text in (out, table):
        for layer in (L0, L1, L2):
            for tensor in TENSORS:
                mark = " (what-if in part)" if (layer, tensor) in marked_rows else ""
                assert re.search(rf"^\| {re.escape(layer)} \| {tensor}{re.escape(mark)} \|",
                                 text, re.M), (layer, tensor, mark)
    # the flagged row: how many of its flagged steps were what-if numbers, and its worst's step
    series = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        value = record["metrics"].get(layer_key("underflow_pct", "activation", L1))
        if value is not None:
            series[record["step"]] = value
    over = [step for step, value in series.items() if value > 5]
    whatif = [step for step in over if (L1, "activation", step) in cells]
    worst_step = max(series, key=series.get)
    assert (len(over), len(whatif), worst_step) == (6, 2, 20)
    assert (f"| {L1} (high precision from step 11 to 30: fp8_guard) | activation | underflow_pct "
            f"| 9 % (what-if step {worst_step}) | 0 | {len(over)} of {len(series)}, "
            f"{len(whatif)} of them what-if |") in md
    assert (f"'{L1}' activation: underflow_pct 9 % at what-if step {worst_step} (> 5 %; "
            f"{len(over)} of {len(series)} steps, {len(whatif)} of them what-if)") in out
    worst = md.split("## Worst layers", 1)[1].split("\n## ", 1)[0]
    assert f"`{L1}` activation (what-if) mean" in worst and f"`{L0}` activation mean" in worst

    run = make_report(folder, out=tmp_path / "again")[0]
    hm = heatmap(run, "underflow_pct", Thresholds())
    steps, names = hm.steps, hm.names
    drawn = {(names[i], p.tensor, steps[j]) for p in hm.panels
             for i, row in enumerate(p.high_precision.tolist()) for j, v in enumerate(row) if v}
    assert drawn == cells
    # the figure: one hatched rectangle per run of high-precision cells along a layer's row
    figure = draw_heatmap(run, "underflow_pct", Thresholds())
    for ax in figure.axes[:len(TENSORS)]:
        hatched = sorted((round(p.get_y() + 0.5), round(p.get_x() + 0.5), round(p.get_width()))
                         for p in ax.patches if p.get_hatch())
        assert hatched == [(names.index(L1), steps.index(20), 2),
                           (names.index(L2), steps.index(50), 1)]
    assert "hatched: fp8_guard ran the layer in high precision" in figure._suptitle.get_text()
    # fp8_stats' raster: the hatching's pixels in exactly those cells (their inside, numbers
    # and all; the frame around each panel is left out)
    image, at = raster(hm), layout(hm)
    for k, p in enumerate(hm.panels):
        for i, layer in enumerate(names):
            for j, step in enumerate(steps):
                x, y = at.cell(k, i, j)
                inside = image[y + 1:y + at.cell_h - 1, x + 1:x + at.cell_w - 1]
                stripes = (inside == FRAME).all(axis=-1).sum()
                if (layer, p.tensor, step) in cells:
                    assert stripes >= inside.shape[0] * inside.shape[1] // 12, (layer, step)
                else:
                    assert stripes == 0, (layer, p.tensor, step)


def logged_layers(folder: Path) -> set[str]:
    """The layer part of every per-layer key in metrics.jsonl (`fp8_<stat>/<tensor>/<layer>`)."""
    return {key.split("/", 2)[2] for line in (folder / "metrics.jsonl").read_text().splitlines()
            for key in json.loads(line)["metrics"] if key.startswith("fp8_")}


def test_the_text_names_each_layer_as_its_keys_do(tmp_path, capsys):
    """A run watching one block (fp8_stats `layers: 'blocks\\.1\\.'`): the flagged table and the
    fp8_guard section named `blocks.1.attn.out_proj`, the worst-layers list `attn.out_proj`
    (the common prefix dropped), two names for one layer in one file."""
    folder = guarded(write_run(tmp_path, (L1, L2)))
    keys = logged_layers(folder)
    assert keys == {L1, L2}
    assert main(["report", str(folder)]) == 0
    capsys.readouterr()
    md = (folder / "fp8_report.md").read_text()
    spans = set(re.findall(r"`([^`\n]+)`", md.split("## Worst layers", 1)[1].split("\n## ")[0]))
    assert spans and spans <= keys, spans - keys
    text = md.split("## Plots", 1)[0] + md.split("## Worst value per layer and tensor", 1)[1]
    rows = re.findall(r"^\| ([^ |]+)", text, re.M)
    assert {L1, L2} <= set(rows) and set(rows) <= keys | {"layer", "---"}, set(rows) - keys
    assert re.search(r"Time series show `([^`]+)`", md).group(1) in keys


def test_layers_takes_the_full_module_names_of_te_swap_and_fp8_stats(tmp_path, capsys):
    """`--layers` with the regex a user wrote for te_swap or fp8_stats (there searched in full
    module names, `model.transformer.blocks.1...`, as their logs print them) matched none of
    the keys' shorter names: exit 2."""
    folder = write_run(tmp_path)
    full = {"model.transformer." + layer: layer for layer in logged_layers(folder)}
    pattern = r"^model\.transformer\.blocks\.1\.ffn\."
    want = sorted(layer for name, layer in full.items() if re.search(pattern, name))
    assert want == [L2]
    assert main(["report", str(folder), "--layers", pattern]) == 0
    capsys.readouterr()
    md = (folder / "fp8_report.md").read_text()
    assert re.findall(r"Time series show (.*)\.\n", md) == [f"`{L2}`"]
