"""FSDP rules for a run known to have one process (MCLI `compute.gpus: 1`, `--gpus 1`):
LLM-Foundry's train drops fsdp_config there, so FSDP's activation checkpointing recomputes
nothing and FP8002 is an info, not an error that stops a run that trains."""

from __future__ import annotations

import inspect
import re

import pytest

from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

CONFIG = {"precision": "amp_fp8", "algorithms": {"te_swap": {}},
          "model": {"name": "mpt_causal_lm", "loss_fn": "torch_crossentropy"},
          "fsdp_config": {"activation_checkpointing": True}}


def test_llmfoundry_train_drops_fsdp_config_in_one_process():
    """The reference: LLM-Foundry's own train, as installed."""
    import importlib

    train = importlib.import_module("llmfoundry.command_utils.train")
    source = inspect.getsource(train.train)
    one = re.search(r"if dist\.get_world_size\(\s*\) == 1 and \(fsdp_config is not None.*?"
                    r"fsdp_config = None", source, re.S)
    assert one is not None and "Reverting to DDP" in one.group()


@pytest.mark.parametrize(("gpus", "severity"), [(None, "error"), (8, "error"), (1, "info")])
def test_fp8002_is_an_info_where_fsdp_is_dropped(gpus, severity):
    found = [f for f in lint_config(CONFIG, LintContext(gpus=gpus)) if f.rule == "FP8002"]
    assert [f.severity for f in found] == [severity]  # before: an error for compute.gpus: 1
    if gpus == 1:
        assert found[0].message.startswith("`compute.gpus: 1`: LLM-Foundry drops fsdp_config")
