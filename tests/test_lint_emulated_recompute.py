"""FP8013 where FSDP runs only. `llmfoundry train` in one process drops fsdp_config
(llmfoundry/command_utils/train.py:319-336 in 0.22.0: 'FSDP is not applicable for single-GPU
training. Reverting to DDP.', and the logged config the callbacks get says `fsdp_config:
null`); run here: yamls/mpt-tiny-cpu.yaml with `fsdp_config: {activation_checkpointing: true}`
trained 4 batches to the end (exit 0) with fp8_state in it, so "fp8_state refuses this run" was
wrong for one process. An MCLI run config's `compute.gpus` says how many processes train."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

YAML = Path(__file__).resolve().parent.parent / "yamls" / "mpt-tiny-cpu.yaml"
BARE = Snapshot(python="3.11")


def _train() -> dict:
    config = yaml.safe_load(YAML.read_text())
    config["fsdp_config"] = {"sharding_strategy": "FULL_SHARD", "activation_checkpointing": True}
    return config


def _fp8013(tmp_path: Path, data: dict) -> list[tuple[str, str]]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    entry = lint_file(path, 1, BARE)
    assert entry["error"] is None, entry["error"]
    return [(f["severity"], f["message"]) for f in entry["findings"] if f["rule"] == "FP8013"]


def _mcli(gpus: int) -> dict:
    return {"name": "tiny", "image": "mosaicml/llm-foundry:2.7.0_cu128-latest",
            "compute": {"gpus": gpus}, "command": "composer train/train.py "
            "/mnt/config/parameters.yaml", "parameters": _train()}


def test_one_gpu_drops_fsdp_config_so_nothing_is_recomputed(tmp_path):
    [(severity, message)] = _fp8013(tmp_path, _mcli(1))
    assert severity == "info" and "drops fsdp_config" in message


def test_more_gpus_recompute_without_fp8(tmp_path):
    [(severity, message)] = _fp8013(tmp_path, _mcli(8))
    assert severity == "error" and "fp8_state refuses such a run" in message


def test_a_file_of_unknown_world_size_is_a_warning_that_says_where_it_applies(tmp_path):
    """Before: an error (exit 1) for a file that trains as written in one process, where the
    emulated backend mostly runs: LLM-Foundry only warns there and drops fsdp_config."""
    [(severity, message)] = _fp8013(tmp_path, _train())
    assert severity == "warning" and "on 2+ GPUs" in message
    assert "in one process (one GPU, or CPU) LLM-Foundry drops fsdp_config" in message
    assert message.endswith("an error if this config trains on 2+ GPUs (`foundry-fp8 lint --gpus "
                            "N` says how many GPUs it trains on)")


def test_a_file_of_unknown_world_size_exits_0_from_the_cli(tmp_path):
    """The exit code a CI job sees: 0 for warnings only (exit 1 before)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_train()))
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "--format", "json",
                           str(path)], capture_output=True, text=True, timeout=120, check=False)
    [entry] = json.loads(done.stdout)["files"]
    assert [f["severity"] for f in entry["findings"] if f["rule"] == "FP8013"] == ["warning"]
    errors = [f for f in entry["findings"] if f["severity"] == "error"]
    assert done.returncode == int(bool(errors)), (done.returncode, errors)
