"""`foundry-fp8 report` does not advise again what the run's te_swap filters already do (QA s28).
A layer te_swap kept out of FP8 by `keep_first_blocks`/`keep_last_blocks`/`include` logs what-if
numbers; the report told it "keep it out of FP8 (where te_swap would convert it):
keep_first_blocks: 1" to a run holding `keep_first_blocks: 1`, and joined such layers' own
excludes into the "exclude changes at once" line. A run resumed with fp8_guard's own "Next time"
exclude (the guard's restored fallback, te_swap now keeping the layer out) got that YAML again,
joined to itself: `(?:X)|X`. Which layers te_swap keeps out is te_swap's own decision
(`swap.plan_swap`, `filters.filter_reason` on the module names) and the run's own record of it
(the `fp8_high_precision` markers fp8_stats logs for them)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.filters import filter_reason
from foundry_fp8.health.keys import HIGH_PRECISION, layer_order_params, parse_key
from foundry_fp8.health.rules import layers_regex
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from foundry_fp8.options import SwapConfig
from foundry_fp8.report.markdown import EXCLUDE_TOGETHER, EXCLUDE_TOGETHER_HELD, kept_out
from foundry_fp8.report.read import swap_filters
from tests.test_advice25_exact_layer import _mpt_like
from tests.three_blocks import kept_by_te_swap
from tests.tiny_run import run_folder, run_tiny

#: te_swap's name filters as runs set them: block counts, an include on te_swap's full names
#: and one on the keys' (a search: it matches the full names too).
RUN_FILTERS = [
    {"keep_first_blocks": 2},
    {"keep_last_blocks": 3},
    {"keep_first_blocks": 1, "keep_last_blocks": 1},
    {"include": r"^model\.transformer\.layers\.[3-9]\."},
    {"include": r"layers\.1[01]\.up_fc$"},
]


@pytest.mark.parametrize("options", RUN_FILTERS)
def test_the_report_sees_every_layer_te_swaps_other_filters_kept_out(options):
    """`kept_out` on the layers as the keys name them agrees with te_swap's plan on the run's
    module names (`model.transformer.layers.<n>...`), on the layers te_swap converts without
    them (not the top-level `fc`, outside the blocks), the blocks counted from `fp8/layers`."""
    model = _mpt_like()
    keys = FP8Monitor(model, MonitorConfig(tensors=("weight",))).short  # te_swap name -> key
    anyway = kept_by_te_swap(model, {})
    kept = {keys[name] for name in kept_by_te_swap(model, options) - anyway}
    assert kept and kept != set(keys.values())  # the filter keeps some layers, not all
    hparams = {"algorithms": {"te_swap": options}, **layer_order_params(list(keys.values()), 6000)}
    swap = swap_filters(hparams, ["layers.0.fc"])  # the watched layers: not the model's count
    assert {keys[name] for name in keys.keys() - anyway if kept_out(keys[name], swap)} == kept


def test_layers_the_runs_keep_last_blocks_kept_out_are_not_advised_again(
    tmp_path, tiny_data, capsys
):
    """3 blocks, `keep_last_blocks: 2`, every tensor flagged (min_cos_sim 1). Blocks 1 and 2
    ran in high precision (marked so in metrics.jsonl, as te_swap's filter says); their flags
    were told `keep_last_blocks: 1` (block 2) and their own exclude (block 1), both already done
    by the run, and block 1's excludes were joined into one line."""
    options = {"keep_last_blocks": 2}
    run_tiny(
        tmp_path,
        tiny_data,
        {
            "model": {"n_layers": 3},
            "max_duration": "6ba",
            "eval_interval": "6ba",
            "save_interval": "6ba",
            "algorithms": {"te_swap": options},
            "callbacks": {"fp8_stats": {"interval": "5ba", "min_cos_sim": 1.0}},
        },
    )
    folder = run_folder(tmp_path)
    marked, logged = set(), set()
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        for key in json.loads(line)["metrics"]:
            if parsed := parse_key(key):
                (marked if parsed[0] == HIGH_PRECISION else logged).add(parsed[2])
    kept = {
        layer
        for layer in logged
        if filter_reason(f"model.transformer.{layer}", SwapConfig(**options), 3)
    }
    assert kept == {layer for layer in logged if layer.startswith(("blocks.1.", "blocks.2."))}
    assert marked == kept
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    no_change = "no change: the run's te_swap keep_first/last_blocks keeps it out of FP8"
    for text in (out, md):
        assert "where te_swap would convert it" not in text and no_change in text, text
        assert EXCLUDE_TOGETHER[:40] not in text, text  # block 0's own key: keep_first_blocks
    # fp8_report.md's flag rows of one layer each (the table's own, and the last section's for
    # the rows naming several): each kept layer's 3 tensors
    for layer in kept:
        said = [
            row
            for row in md.splitlines()
            if row.startswith(f"| {layer} |") and "FP8 rounding loses" in row
        ]
        assert len(said) == 3 and all(no_change in row for row in said), said


FAULTY = "blocks.1.attn.out_proj"


def _joined(text: str, intro: str) -> str:
    """The joined exclude line's te_swap `exclude`, read with a YAML reader."""
    [line] = [line for line in text.splitlines() if intro[:60] in line]
    [yaml_text] = re.findall(r"algorithms: \{te_swap: \{exclude: '.*'\}\}", line)
    return yaml.safe_load(yaml_text)["algorithms"]["te_swap"]["exclude"]


def test_fp8_guards_layers_join_the_exclude_and_a_resumed_run_is_not_told_them_again(
    tmp_path, tiny_data, capsys
):
    """3 blocks, fp8_stats watching block 1, every watched gradient flagged (min_cos_sim 0.9995:
    E5M2 round trips sit near 0.9986),
    fp8_guard moving `blocks.1.attn.out_proj` (an outlier channel from step 3). Block 1's other
    layers are told their own exclude, joined in one line; fp8_guard's section gives its layer's
    for next time. The joined line left that layer out: pasted after the guard's, te_swap ran it
    in FP8 again. Then the run resumed with the joined exclude (the `jsonl` logger rewrites
    hparams.json with the resumed attempt's config; fp8_guard's record of the restored fallback
    stays): te_swap keeps the layer out, which the report says instead of `(?:X)|X`."""
    from llmfoundry.registry import callbacks

    from foundry_fp8.fault import InjectOutlier

    callbacks.register("inject_outlier", func=InjectOutlier)
    trainer = run_tiny(
        tmp_path,
        tiny_data,
        {
            "model": {"n_layers": 3},
            "max_duration": "10ba",
            "eval_interval": "10ba",
            "save_interval": "10ba",
            "callbacks": {
                # block 1 only: flags on every FP8 layer are FP8 failing for the whole run
                # (s29), which gives no joined exclude; 4 of te_swap's 12 are a block's
                "fp8_stats": {"interval": "2ba", "min_cos_sim": 0.9995, "layers": r"blocks\.1\."},
                "fp8_guard": {"consecutive": 2},
                "inject_outlier": {"layer": FAULTY, "start": 3},
            },
        },
    )
    model = {
        name.removeprefix("model.transformer.")
        for name, module in trainer.state.model.named_modules()
        if isinstance(module, nn.Linear) and ".blocks." in name
    }
    del trainer  # Composer closes it at exit
    assert len(model) == 12
    folder = run_folder(tmp_path)
    logged = {
        parsed[2]
        for line in (folder / "metrics.jsonl").read_text().splitlines()
        for key in json.loads(line)["metrics"]
        if (parsed := parse_key(key))
    }
    block1 = {layer for layer in model if layer.startswith("blocks.1.")}
    assert logged == block1

    def kept_by(exclude: str) -> set[str]:  # te_swap's own matching on the model's names
        return {
            layer
            for layer in model
            if filter_reason(f"model.transformer.{layer}", SwapConfig(exclude=exclude), 3)
        }

    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    advised = f"Next time: algorithms: {{te_swap: {{exclude: '{layers_regex([FAULTY])}'}}}}"
    assert advised in out, out
    md = (folder / "fp8_report.md").read_text()
    for text in (out, md):
        assert kept_by(_joined(text, EXCLUDE_TOGETHER_HELD)) == block1, text
    hparams_file = folder / "hparams.json"
    hparams = json.loads(hparams_file.read_text())
    hparams["algorithms"]["te_swap"]["exclude"] = _joined(out, EXCLUDE_TOGETHER_HELD)  # followed
    hparams_file.write_text(json.dumps(hparams))
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    for text in (out, md):
        assert "te_swap already keeps the layers in fallback out of FP8" in text, text
        assert "Next time:" not in text and "```yaml" not in text, text
        assert EXCLUDE_TOGETHER_HELD[:60] not in text and EXCLUDE_TOGETHER[:60] not in text, text
        [row] = [
            line
            for line in text.splitlines()
            if "fp8_guard ran it in high" in line and "underflow_pct" in line
        ]
        assert "the run's te_swap exclude keeps it so from the start" in row, row
        assert "fp8_guard section's exclude" not in row, row
        # block 1's other layers, in FP8 until the resume, are told their exclude no more
        said = [
            line
            for line in text.splitlines()
            if "cos_sim" in line
            and "First flagged at step" not in line  # the summary: no advice (its rows have)
            and any(
                f"'{layer}'" in line or line.startswith(f"| {layer} |")
                for layer in block1 - {FAULTY}
            )
        ]
        assert len(said) >= 3 and all(
            "no change: the run's te_swap exclude keeps it out" in line.lower() for line in said
        ), said
