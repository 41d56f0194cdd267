"""Lint rules, one file per topic, each rule registered where it is defined
(`foundry_fp8.lint.registry.rule`):

- `train`: the train config's own keys and sections (precision, retired and unknown keys,
  section shapes, `${oc.env:...}`, loaders, the loss function);
- `model`: the model section (MPTConfig's keys, TE layer choices, GEMM shapes);
- `fsdp`: FSDP and activation recompute;
- `tokens`: tokens reaching TE's FP8 GEMMs outside the train micro-batch (generate callback,
  padding dropped before MPT's FFN);
- `ours`: our entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_guard`, `fp8_lint`, `jsonl`)
  and where the registries look for them;
- `eval`: LLM-Foundry eval configs;
- `hf`: an `hf_causal_lm` model whose Hugging Face config.json is on this machine;
- `mcli`: MCLI run configs around them (their `parameters`, linted as a train or eval config);
- `accelerate`: Accelerate configs and the DeepSpeed JSON they point to;
- `environment`: what is installed and what the GPU is (`foundry-fp8 doctor`, `fp8_lint`).

Pure Python over resolved dicts; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from foundry_fp8.lint.config import fsdp_version_from_env, wandb_mode_from_env
from foundry_fp8.lint.registry import (
    FAMILIES,
    SEVERITIES,
    Finding,
    LintContext,
    Rule,
    rules_of,
    run_rules,
)
from foundry_fp8.lint.rules import (  # noqa: F401  (registration happens at import)
    accelerate,
    environment,
    eval,
    fsdp,
    hf,
    mcli,
    model,
    ours,
    parallel,
    tokens,
    train,
)

__all__ = ["RULES", "SEVERITIES", "Finding", "LintContext", "Rule", "all_rules",
           "fsdp_version_from_env", "lint_config", "rule_sets", "wandb_mode_from_env"]

#: The train-config rules, in id order.
RULES = rules_of("train")


def lint_config(config: Mapping[str, Any], context: LintContext | None = None) -> list[Finding]:
    """All findings for a resolved train config."""
    context = context or LintContext()
    if not isinstance(config, Mapping):
        return []
    return run_rules("train", config, context,
                     only=lambda r: r.scope == "any" or context.scope == "file")


def rule_sets() -> list[tuple[str, list[Rule]]]:
    """(title, rules) per family that has rules, in FAMILIES order: docs/rules.md, SARIF."""
    return [(title, rules) for family, title in FAMILIES.items() if (rules := rules_of(family))]


def all_rules() -> list[Rule]:
    return [r for _, rules in rule_sets() for r in rules]
