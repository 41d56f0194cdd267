"""A model `name` that is a list or mapping (a YAML slip: `name: [mpt_causal_lm]`) is not
hashable: FP8302 and FP8044's flash note tested it against a set and crashed (found by
test_rules_never_crash_on_random_configs: {'precision': None, 'model': {'name': []}})."""

from __future__ import annotations

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.registry import run_rules
from foundry_fp8.lint.rules import LintContext, lint_config


@pytest.mark.parametrize("name", [[], ["mpt_causal_lm"], {"a": 1}])
def test_no_rule_crashes_on_an_unhashable_model_name(name):
    model = {"name": name, "master_weights_dtype": "bf16", "fc_type": "te"}
    context = LintContext(scope="file", snapshot=Snapshot(python="3"))
    for config in ({"precision": "amp_fp8", "model": model},
                   {"precision": "amp_fp8", "models": [{"model_name": "m", "model": model}]}):
        findings = lint_config(config, context) + run_rules("eval", config, context)
        assert [f.message for f in findings if f.crashed] == []
