"""Every rule family in one place, for docs/rules.md and SARIF's rule list.

The train-YAML rules live in `foundry_fp8.lint.rules`, the Accelerate/DeepSpeed ones in
`foundry_fp8.lint.accelerate` and the environment ones (`foundry-fp8 doctor`, `fp8_lint`) in
`foundry_fp8.environment`; all use the same `Rule` and none imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from foundry_fp8.lint.rules import RULES, Rule


def rule_sets() -> list[tuple[str, Sequence[Rule]]]:
    """(title, rules) per family, in id order."""
    from foundry_fp8.environment import ENVIRONMENT_RULES
    from foundry_fp8.lint.accelerate import ACCELERATE_RULES

    return [("LLM-Foundry train YAMLs", RULES),
            ("Accelerate and DeepSpeed configs", ACCELERATE_RULES),
            ("The environment (`foundry-fp8 doctor`, `fp8_lint`)", ENVIRONMENT_RULES)]


def all_rules() -> list[Rule]:
    return [rule for _, rules in rule_sets() for rule in rules]
