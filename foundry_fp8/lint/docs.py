"""Generate docs/rules.md from the rule registries: `python -m foundry_fp8.lint.docs > docs/rules.md`.

The rules' ids, severities, rationales and sources live in code only; tests check that the
committed docs/rules.md equals this output, so the two cannot drift.
"""

from __future__ import annotations

from foundry_fp8.lint.registry import FAMILIES, Rule
from foundry_fp8.lint.rules import rule_sets

HEADER = """\
# `foundry-fp8 lint` rules

Generated from the rule registry (each rule is registered where it is defined, in
`foundry_fp8/lint/rules/*.py`) by `python -m foundry_fp8.lint.docs > docs/rules.md`; do not
edit by hand. Severity is the most severe level a rule reports: some report a milder level in the
situations their rationale names. Each source names the file (and version) the fact was
verified in; the train-YAML rules against Composer 0.32.1, LLM-Foundry 0.22.0, TransformerEngine
2.8 and torch 2.7.0.

Exit codes: 0 no error findings, 1 at least one error finding, 2 a file that could not be read,
parsed or resolved.
"""


def _section(rule: Rule) -> str:
    scope = ("\n- **Applies to**: files only (not to `fp8_lint`, which sees LLM-Foundry's "
             "logged config)" if rule.scope == "file" else "")
    if rule.also:
        scope += "\n- **Also checks**: " + ", ".join(FAMILIES[f] for f in rule.also)
    return (f'<a id="{rule.id.lower()}"></a>\n\n### {rule.id}: {rule.summary}\n\n'
            f"- **Severity**: {rule.severity}\n"
            f"- **Why**: {rule.rationale}\n"
            f"- **Source**: {rule.source}\n"
            f"- **Fix**: {rule.fix}{scope}\n")


def rules_markdown() -> str:
    """The whole of docs/rules.md."""
    parts = [HEADER]
    for title, rules in rule_sets():
        parts += [f"## {title}\n", "| rule | severity | what it catches |", "|---|---|---|"]
        parts += [f"| [{r.id}](#{r.id.lower()}) | {r.severity} | {r.summary.replace('|', '/')} |"
                  for r in rules]
        parts += ["", *(_section(r) for r in rules)]
    return "\n".join(parts)


if __name__ == "__main__":
    print(rules_markdown(), end="")
