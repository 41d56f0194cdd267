"""FP8031 on an MCLI run config that pins torch or LLM-Foundry but not Composer: the run's
Composer is not the linting machine's, so the rule has nothing to judge (LLM-Foundry v0.8.0 to
v0.17.0's own mcli/mcli-llama2-finetune.yaml got an error for the linting machine's Composer
0.32.1 beside its image's torch 2.5.1, a pair its LLM-Foundry v0.16.0 pin never installs)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import auto_microbatch_fsdp_fails

#: The linting machine: Composer 0.32.1 under a torch past its range (the H200 run's).
MACHINE = Snapshot(python="3.12.3", torch="2.11.0+cu130", composer="0.32.1", llmfoundry="0.22.0")


def _run_config(**outer: Any) -> dict[str, Any]:
    """LLM-Foundry v0.17.0's mcli/mcli-llama2-finetune.yaml in short: auto micro-batching under
    FSDP on 8 GPUs, with `outer` (image, integrations, command) as its MCLI keys."""
    return {"name": "llama2-finetune", "compute": {"gpus": 8},
            "command": "cd llm-foundry/scripts\ncomposer train/train.py "
                       "/mnt/config/parameters.yaml\n", **outer,
            "parameters": {"max_seq_len": 4096, "global_train_batch_size": 64,
                           "device_train_microbatch_size": "auto", "max_duration": "1ep",
                           "precision": "amp_bf16",
                           "model": {"name": "hf_causal_lm",
                                     "pretrained_model_name_or_path": "meta-llama/Llama-2-7b-hf",
                                     "pretrained": True},
                           "tokenizer": {"name": "meta-llama/Llama-2-7b-hf"},
                           "train_loader": {"name": "finetuning",
                                            "dataset": {"hf_name": "mosaicml/dolly_hhrlhf",
                                                        "split": "train", "max_seq_len": 4096,
                                                        "decoder_only_format": True,
                                                        "shuffle": True}},
                           "optimizer": {"name": "decoupled_lionw", "lr": 5.0e-7},
                           "scheduler": {"name": "cosine_with_warmup", "t_warmup": "100ba"},
                           "fsdp_config": {"sharding_strategy": "FULL_SHARD",
                                           "mixed_precision": "PURE",
                                           "activation_checkpointing": True}}}


IMAGE = {"image": "mosaicml/llm-foundry:2.5.1_cu124-latest"}
FOUNDRY = {"integrations": [{"integration_type": "git_repo", "git_repo": "mosaicml/llm-foundry",
                             "git_branch": "v0.16.0", "pip_install": ".[gpu]"}]}


def _fp8031(tmp_path: Path, data: dict[str, Any]) -> list[tuple[str, str]]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return [(f["severity"], f["message"]) for f in lint_file(path, 1, MACHINE)["findings"]
            if f["rule"] == "FP8031"]


def test_a_run_config_without_pins_judges_the_linting_machine(tmp_path):
    """The rule still reports: no pin, so the machine's Composer 0.32.1 and torch 2.11 decide."""
    (severity, _), = _fp8031(tmp_path, _run_config())
    assert severity == "error"


@pytest.mark.parametrize("outer", [IMAGE, FOUNDRY, {**IMAGE, **FOUNDRY},
                                   {"command": "pip install torch==2.5.1\ncomposer train/train.py"
                                               " /mnt/config/parameters.yaml"}],
                         ids=["image", "llm-foundry", "image+llm-foundry", "pip-torch"])
def test_a_pinned_torch_or_foundry_without_a_pinned_composer_is_not_judged(tmp_path, outer):
    assert _fp8031(tmp_path, _run_config(**outer)) == []


def test_a_pinned_composer_is_judged_with_the_pinned_torch(tmp_path):
    """Both pinned: the pair the run installs is known, and judged (the note names the pins)."""
    packages = {"integration_type": "pip_packages", "packages": ["mosaicml==0.32.1"]}
    (severity, message), = _fp8031(tmp_path, _run_config(**IMAGE, integrations=[packages]))
    assert severity == "error" and "torch 2.5.1 as this run config pins it (`image`)" in message


@pytest.mark.parametrize("torch", ["2.5.1", "2.6.0", "2.7.0", "2.7.1", "2.11.0"])
def test_pip_resolves_composer_inside_fp8031s_torch_range(torch):
    """Why an unpinned Composer cannot fail: the installed Composer's own torch requirement (its
    package metadata, read by packaging) takes exactly the torch FP8031 passes it with."""
    composer = importlib.metadata.version("mosaicml")
    spec, = [Requirement(r).specifier for r in importlib.metadata.requires("mosaicml") or []
             if Requirement(r).name == "torch"]
    assert (torch in spec) is (auto_microbatch_fsdp_fails(composer, torch) is False)
