"""A run whose te_swap exclude names a layer as te_swap sees it, the Composer model's full name
(`^model\\.transformer\\.blocks\\.1\\.attn\\.Wqkv$`): `foundry-fp8 report` on its metrics.jsonl
says the run's exclude keeps that layer out of FP8, and neither advises its exclude again nor
joins it to the exclude line (QA advice, s25: it searched the run's exclude in the keys' shorter
names, `blocks.1.attn.Wqkv`, found nothing, and told the user to keep it out again). The joined
exclude it prints, given to te_swap's own search on the trained model's module names, keeps
exactly block 1's linear layers out of FP8. fp8_stats watches block 1 only: flags on every FP8
layer are FP8 failing for the whole run (s29), which gives no joined exclude; 3 of te_swap's 11
FP8 layers are a block's."""

from __future__ import annotations

import re

import yaml
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.filters import search
from foundry_fp8.options import SwapConfig
from foundry_fp8.report.markdown import EXCLUDE_TOGETHER
from tests.tiny_run import run_folder, run_tiny

EXCLUDE = r"^model\.transformer\.blocks\.1\.attn\.Wqkv$"
OPTION = f"{SwapConfig.PATH}.exclude"


def test_an_exclude_on_te_swaps_names_is_recognised_and_the_joined_one_is_exact(
        tmp_path, tiny_data, capsys):
    """3 blocks (block 1 is no edge block: its advice is its own exclude), every watched tensor
    flagged (min_cos_sim 1), fp8_stats watching block 1 only; 20 batches, 2 logging steps."""
    trainer = run_tiny(tmp_path, tiny_data, {
        "model": {"n_layers": 3}, "max_duration": "20ba", "eval_interval": "20ba",
        "save_interval": "20ba", "algorithms": {"te_swap": {"exclude": EXCLUDE}},
        "callbacks": {"fp8_stats": {"min_cos_sim": 1.0, "layers": r"blocks\.1\."}}})
    linears = {name for name, module in trainer.state.model.named_modules()
               if isinstance(module, nn.Linear)}
    del trainer  # dropped now: kept to the end, Composer closed it at exit into closed capture
    assert {name for name in linears if search(OPTION, EXCLUDE, name)} == {
        "model.transformer.blocks.1.attn.Wqkv"}  # te_swap's names are the full ones
    capsys.readouterr()
    assert main(["report", str(run_folder(tmp_path))]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines()
            if "'blocks.1.attn.Wqkv'" in line and "Likely cause" in line]
    assert said and all("exclude keeps it out of FP8" in line and "exclude:" not in line
                        for line in said), said
    [together] = [line for line in out.splitlines() if EXCLUDE_TOGETHER[:40] in line]
    [joined] = re.findall(r"algorithms: \{te_swap: \{exclude: '.*'\}\}", together)
    exclude = yaml.safe_load(joined)["algorithms"]["te_swap"]["exclude"]
    assert exclude.count("Wqkv") == 1, exclude  # the run's own, not said again
    assert {name for name in linears if search(OPTION, exclude, name)} == {
        name for name in linears if name.startswith("model.transformer.blocks.1.")}
