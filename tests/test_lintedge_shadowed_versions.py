"""FP8031 and FP8030 where a folder shadows the installed torch, Composer or LLM-Foundry
(`Snapshot.shadowed`, FP8215): the installed version says nothing of what runs, so, as the
environment rules already did (FP8209, FP8212-FP8214), these rules take its version as unknown
and name the folder. Before, FP8031 called a run an error (or passed it) by the installed
torch's and Composer's versions, and FP8030 by the installed LLM-Foundry's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

TRAIN = {"device_train_microbatch_size": "auto", "fsdp_config": {"sharding_strategy": "FULL_SHARD"},
         "max_seq_len": 128, "global_train_batch_size": 8, "precision": "amp_bf16",
         "max_duration": "10ba",
         "model": {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2}}
BASE = Snapshot(python="3.11.7", torch="2.8.0", composer="0.32.1", llmfoundry="0.22.0")
FOLDERS = {"torch": "/home/me/src/pytorch/torch", "composer": "/home/me/composer/composer",
           "llmfoundry": "/home/me/llm-foundry/llmfoundry"}


def _rows(tmp_path: Path, config: dict, snapshot: Snapshot, rule: str) -> list[tuple[str, str]]:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    found = [f for f in lint_file(path, 1, snapshot, gpus=8)["findings"] if f["rule"] == rule]
    return [(f["severity"], f["message"]) for f in found]


@pytest.mark.parametrize(("torch", "shadowed"), [("2.8.0", "torch"), ("2.6.0", "composer"),
                                                 ("2.8.0", "composer")])
def test_fp8031_takes_a_shadowed_version_as_unknown(tmp_path, torch, shadowed):
    snapshot = replace(BASE, torch=torch)
    plain = _rows(tmp_path, TRAIN, snapshot, "FP8031")
    assert [s for s, _ in plain] == (["error"] if torch == "2.8.0" else [])
    found = _rows(tmp_path, TRAIN, replace(snapshot, shadowed=((shadowed, FOLDERS[shadowed]),)),
                  "FP8031")
    assert [s for s, _ in found] == ["warning"]
    assert FOLDERS[shadowed] in found[0][1] and "shadows the installed" in found[0][1]


def test_fp8030_takes_a_shadowed_llmfoundry_as_unknown(tmp_path):
    config = {**TRAIN, "device_train_microbatch_size": 4,
              "model": {**TRAIN["model"], "ffn_config": {"ffn_type": "te_ln_mlp"}}}
    assert [s for s, _ in _rows(tmp_path, config, BASE, "FP8030")] == ["error"]
    shadowed = replace(BASE, shadowed=(("llmfoundry", FOLDERS["llmfoundry"]),))
    found = _rows(tmp_path, config, shadowed, "FP8030")
    assert [s for s, _ in found] == ["warning"] and FOLDERS["llmfoundry"] in found[0][1]
    assert "0.22.0's" not in found[0][1]
