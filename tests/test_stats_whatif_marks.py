"""fp8_stats' fit-end table marks a row by where its worst values came from, in a real tiny
run where fp8_guard ran a layer in high precision for part of the run: `(what-if)` when every
shown worst value was reached only at steps the layer ran in high precision, `(what-if in part)`
when some were, no mark when FP8 casts reached them all (QA 19: every row of a layer with a
what-if step anywhere was marked `(what-if)`, its FP8 casts' worst values too). The expected
marks are worked out here from metrics.jsonl and the guard's records with plain json."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.test_guard_run import LAYER, TRANSIENT, _run, fault_registered  # noqa: F401
from tests.tiny_run import run_folder

# a second, larger outlier in the layer at one logging step (12) while it runs in high
# precision: its activation's largest amax and underflow are what-if numbers there, while its
# other worst values are FP8 casts' (the first outlier's, steps 6 and 8)
LATER = {"guard_inject_nan": {"layer": LAYER, "start": 12, "stop": 13, "factor": 1e7}}


@pytest.mark.slow
def test_the_fit_end_table_marks_rows_by_where_their_worst_values_came_from(
        tmp_path, tiny_data, fault_registered, capfd):  # noqa: F811
    _run(tmp_path, tiny_data, "marks", {**TRANSIENT, **LATER})
    printed = capfd.readouterr().out.split("worst value per layer and tensor\n", 1)[1]
    # the statistics the table shows (its header): a row's mark is about those
    columns = printed.splitlines()[0].strip("| ").split(" | ")[2:]
    assert {"underflow_pct", "cos_sim", "amax"} <= set(columns), columns
    folder = run_folder(tmp_path, "marks")
    hparams = json.loads((folder / "hparams.json").read_text())
    fallen = hparams[f"fp8/guard/fallback/{LAYER}"]["step"]
    back = hparams[f"fp8/guard/repromotion/{LAYER}"]["step"]
    # judged values per (layer, tensor, stat) and step; a layer ran in high precision at the
    # logging steps after its fallback's, up to its re-promotion's
    values: dict[tuple[str, str, str], dict[int, float]] = {}
    initial: set[tuple[str, str, int]] = set()
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record["metrics"].items():
            if not key.startswith("fp8_") or key.count("/") < 2:
                continue
            stat, tensor, layer = key.split("/", 2)
            if stat == "fp8_initial_scale" and value:
                initial.add((layer, tensor, record["step"]))
            elif stat.removeprefix("fp8_") in columns and value == value:
                values.setdefault((layer, tensor, stat.removeprefix("fp8_")), {})[
                    record["step"]] = value
    marks: dict[tuple[str, str], list[bool]] = {}
    for (layer, tensor, stat), by_step in values.items():
        judged = {s: v for s, v in by_step.items() if (layer, tensor, s) not in initial}
        if not judged:
            continue
        # worse: lower cos_sim, scale_ratio farther from 1, any other statistic larger
        worst = max(judged.values(), key=lambda v: -v if stat == "cos_sim" else abs(math.log(
            v)) if stat == "scale_ratio" else v)
        whatif_only = all(layer.endswith(LAYER) and fallen < s <= back
                          for s, v in judged.items() if v == worst)
        marks.setdefault((layer, tensor), []).append(whatif_only)
    expected = {row: " (what-if)" if all(m) else " (what-if in part)" if any(m) else ""
                for row, m in marks.items()}
    ours = {row: mark for row, mark in expected.items() if row[0].endswith(LAYER)}
    # the layer has a row whose worst values FP8 casts reached, and one with a what-if's
    assert "" in ours.values() and set(ours.values()) - {""}, ours
    assert fallen < 12 <= back
    for (layer, tensor), mark in expected.items():
        name = layer.removeprefix("model.transformer.")
        assert re.search(rf"^\| {re.escape(name)} \| {tensor}{re.escape(mark)} \|", printed,
                         re.M), (layer, tensor, mark, printed)
