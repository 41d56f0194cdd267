"""A layer the run's own te_swap exclude keeps out of FP8 (the advice `exclude: '<layer>$'`
followed): fp8_stats logs its numbers, what-if ones, with the `high_precision` marker, so
`foundry-fp8 report` on the run's metrics.jsonl says what-if for it and neither advises its
exclude again nor repeats it in the joined exclude line (it said
`'(?:blocks\\.1\\.attn\\.Wqkv$)|blocks\\.1\\.attn\\.Wqkv$'`). Expectations are worked out from
the JSONL text and te_swap's own matching (`filters.filter_reason`). fp8_stats watches block 1
only: flags on every FP8 layer are FP8 failing for the whole run (s29), which gives no joined
exclude; 3 flagged of te_swap's 11 FP8 layers are a block's."""

from __future__ import annotations

import json
import re

import yaml
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.filters import filter_reason
from foundry_fp8.health.keys import HIGH_PRECISION, parse_key
from foundry_fp8.health.rules import Flag, layers_regex
from foundry_fp8.options import SwapConfig
from foundry_fp8.report.markdown import EXCLUDE_TOGETHER, Finding, excluded_together, not_converted
from tests.tiny_run import run_folder, run_tiny

EXCLUDED = "blocks.1.attn.Wqkv"
EXCLUDE = r"blocks\.1\.attn\.Wqkv$"


def test_an_excluded_layer_is_what_if_in_the_report_and_not_advised_again(
        tmp_path, tiny_data, capsys):
    """3 blocks (block 1 is no edge block: its advice is its own exclude), every watched tensor
    flagged (min_cos_sim 1), fp8_stats watching block 1 only, te_swap excluding one layer of
    block 1; 20 batches, 2 logging steps."""
    trainer = run_tiny(tmp_path, tiny_data, {
        "model": {"n_layers": 3}, "max_duration": "20ba", "eval_interval": "20ba",
        "save_interval": "20ba", "algorithms": {"te_swap": {"exclude": EXCLUDE}},
        "callbacks": {"fp8_stats": {"min_cos_sim": 1.0, "layers": r"blocks\.1\."}}})
    model = {name.removeprefix("model.transformer.")
             for name, module in trainer.state.model.named_modules()
             if isinstance(module, nn.Linear) and ".blocks." in name}
    del trainer  # Composer closes it at exit
    assert len(model) == 12
    folder = run_folder(tmp_path)
    marked, logged = set(), set()
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        for key in json.loads(line)["metrics"]:
            if parsed := parse_key(key):
                (marked if parsed[0] == HIGH_PRECISION else logged).add(parsed[2])
    excluded = {layer for layer in logged
                if filter_reason(f"model.transformer.{layer}", SwapConfig(exclude=EXCLUDE), 3)}
    assert excluded == {EXCLUDED} and marked == excluded  # the FP8 layers' rows unmarked
    assert logged == {layer for layer in model if layer.startswith("blocks.1.")}
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    for text in (out, md):
        # its flag rows (terminal, fp8_report.md's table): 3 tensors
        said = [line for line in text.splitlines() if EXCLUDED in line and "cos_sim" in line
                and ("Likely cause" in line or line.startswith("| "))]
        assert len(said) == 3 and all("what-if" in line for line in said), said
        assert all("Change" not in line and "exclude keeps it out of FP8" in line
                   and "exclude:" not in line for line in said), said
        together = [line for line in text.splitlines() if EXCLUDE_TOGETHER[:40] in line]
        assert len(together) == 1 and together[0].count("Wqkv$") == 1, together  # the run's
    # the other block-1 layers are advised, joined once to the run's own exclude: given to
    # te_swap, it keeps exactly block 1's layers of the model's 12 out of FP8
    [joined] = re.findall(r"algorithms: \{te_swap: \{exclude: '.*'\}\}", together[0])
    exclude = yaml.safe_load(joined)["algorithms"]["te_swap"]["exclude"]
    assert {layer for layer in model if filter_reason(
        f"model.transformer.{layer}", SwapConfig(exclude=exclude), 3)} == logged


def test_the_joined_exclude_leaves_out_layers_the_run_already_excludes():
    """The deciding function: the run's exclude matches the flagged layer as te_swap searches
    module names, so only the other layer is joined."""
    def found(layer: str) -> Finding:
        key = f"algorithms.te_swap.exclude: '{layers_regex([layer])}'"
        return Finding(Flag("cos_low", layer, "weight", 10, "cos_sim", 0.9, "< 1", "c", key),
                       10, 1, 2, whatif=1 if layer == EXCLUDED else 0, worst_whatif=True)

    flagged = [found(EXCLUDED), found("blocks.1.ffn.up_proj")]
    assert excluded_together(flagged, {}, EXCLUDE) == (
        r"algorithms: {te_swap: {exclude: '(?:blocks\.1\.attn\.Wqkv$)|"
        r"^(?:model\.)?(?:transformer\.)?blocks\.1\.ffn\.up_proj(?:\..+)?$'}}")
    assert excluded_together(flagged[:1], {}, EXCLUDE) is None
    note = not_converted(flagged[0], {}, EXCLUDE)
    assert note is not None and not note[1] and "no change" in note[0]
    assert not_converted(flagged[1], {}, EXCLUDE) is None  # its numbers are its FP8 casts'
