"""A run where FP8 fails everywhere (learning rate 1000, s29 docs try): every FP8 layer is
flagged, fp8_guard holds two and its budget refuses the other six. fp8_report.md joined them
into one te_swap exclude of all 8 layers, a config fp8_lint refuses (FP8034: te_swap converts
no layer). Now it says FP8 fails for the run as a whole and gives no exclude that te_swap's own
search, on the trained model's module names, finds every FP8 layer in; the loss line counts
"1 step", not "1 steps"."""

from __future__ import annotations

import re

import pytest
import yaml
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.filters import search
from foundry_fp8.options import SwapConfig
from tests.tiny_run import run_folder, run_tiny

OPTION = f"{SwapConfig.PATH}.exclude"


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.1, 1.0])
def test_flags_on_every_fp8_layer_give_no_exclude_of_them_all(tmp_path, tiny_data, capsys,
                                                             budget):
    """fp8_guard's default budget (10 %) holds 2 layers and refuses the other 6; a budget of
    100 % holds all 8 (its fit-end print gives no exclude of them either: `guard.whole_run`)."""
    trainer = run_tiny(tmp_path, tiny_data, {
        "optimizer": {"lr": 1000.0}, "max_duration": "10ba", "eval_interval": "10ba",
        "save_interval": "10ba", "algorithms": {"gradient_clipping": {"clipping_threshold": 1e30}},
        "callbacks": {"fp8_stats": {"interval": "2ba", "image_interval": None},
                      "fp8_guard": {"max_fallback_share": budget}}})
    linears = {name for name, module in trainer.state.model.named_modules()
               if isinstance(module, nn.Linear)}
    del trainer  # Composer closes it at exit
    fp8 = {name for name in linears if ".blocks." in name}  # te_swap's 8 (lm_head is tied)
    assert len(fp8) == 8
    capsys.readouterr()
    assert main(["report", str(run_folder(tmp_path))]) == 0
    md = (run_folder(tmp_path) / "fp8_report.md").read_text()
    assert "FP8 is not working for this run as a whole: 8 of its 8 FP8 layers" in md
    excludes = re.findall(r"algorithms: \{te_swap: \{exclude: '(?:[^']|'')*'\}\}",
                          md.replace("\\|", "|"))
    # fp8_guard's static YAML for the 2 layers it held stays; for all 8, none
    assert len(excludes) == (budget < 1), excludes
    assert ("section's exclude" in md) == (budget < 1)  # a table row's pointer to it
    for joined in excludes:
        exclude = yaml.safe_load(joined)["algorithms"]["te_swap"]["exclude"]
        assert {name for name in fp8 if not search(OPTION, exclude, name)}, joined
    said = re.search(r"Loss diverges from step (\d+): .*?, (\d+ steps?) after the first FP8 "
                     r"flag \(step (\d+)\)", md)
    assert said is not None, md
    gap = int(said[1]) - int(said[3])
    assert said[2] == ("1 step" if gap == 1 else f"{gap} steps"), said[0]
