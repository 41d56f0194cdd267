"""FSDP rules for a run known to have one process (MCLI `compute.gpus: 1`, `--gpus 1`):
LLM-Foundry's train drops fsdp_config there, so FSDP's activation checkpointing recomputes
nothing and FP8002 is an info, not an error that stops a run that trains."""

from __future__ import annotations

import inspect
import re

import pytest

from foundry_fp8.lint.registry import LintContext, run_rules
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


def test_llmfoundry_eval_keeps_fsdp_config_in_one_process():
    """The reference for eval configs: evaluate_model hands fsdp_config to the Trainer whatever
    the world size (llmfoundry/command_utils/eval.py, as installed)."""
    import importlib

    source = inspect.getsource(importlib.import_module("llmfoundry.command_utils.eval"))
    assert "Reverting to DDP" not in source and "get_world_size" not in source
    assert re.search(r"parallelism_config=\{'fsdp': eval_config\.fsdp_config\}", source)


REENTRANT = {**CONFIG, "fsdp_config": {"activation_checkpointing": True,
                                       "te_checkpoint_wrapper": True}}  # reentrant by default
EVAL = {"precision": "amp_fp8", "fsdp_config": REENTRANT["fsdp_config"], "icl_tasks": [],
        "models": [{"model_name": "m", "model": {"name": "mpt_causal_lm"},
                    "tokenizer": {"name": "gpt2"}}]}


@pytest.mark.parametrize(("family", "config", "gpus", "severity"), [
    ("train", REENTRANT, None, "error"), ("train", REENTRANT, 8, "error"),
    ("train", REENTRANT, 1, "info"),  # before: an error, for a run that trains
    ("eval", EVAL, 1, "error"), ("eval", EVAL, None, "error")])
def test_fp8003_is_an_info_only_where_train_drops_fsdp(family, config, gpus, severity):
    found = [f for f in run_rules(family, config, LintContext(gpus=gpus)) if f.rule == "FP8003"]
    assert [f.severity for f in found] == [severity]
    if severity == "info":
        assert found[0].message.startswith("`compute.gpus: 1`: LLM-Foundry drops fsdp_config")
        assert "nothing is recomputed" in found[0].message


def test_fp8002_with_fp8_state_in_one_process_says_nothing_is_recomputed():
    config = {**CONFIG, "callbacks": {"fp8_state": {}}}
    found = [f for f in lint_config(config, LintContext(gpus=1, gpus_said="`--gpus 1`"))
             if f.rule == "FP8002"]
    assert [f.severity for f in found] == ["info"]
    # before: "fp8_state switches on te_checkpoint_wrapper ...", moot where nothing is wrapped
    assert found[0].message.startswith("`--gpus 1`: LLM-Foundry drops fsdp_config in one "
                                       "process, so FSDP wraps nothing and nothing is recomputed")
