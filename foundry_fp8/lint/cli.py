"""`foundry-fp8 lint PATH...`: read YAMLs as LLM-Foundry does, report findings at their lines.

Exit codes: 0 no errors, 1 at least one error finding, 2 a file could not be read or resolved.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from foundry_fp8.lint.load import LintInputError, load_config, position_of
from foundry_fp8.lint.output import render_json, render_sarif, render_text, use_colour
from foundry_fp8.lint.rules import Finding, LintContext, fsdp_version_from_env, lint_config

__all__ = ["LintInputError", "add_arguments", "lint_file", "run"]


def lint_file(path: Path, fsdp_version: int = 1) -> dict[str, Any]:
    """One entry of the JSON contract: {path, error, findings}."""
    from foundry_fp8.lint.accelerate import lint_accelerate_file  # Accelerate/DeepSpeed configs

    try:
        accelerate = lint_accelerate_file(path)
        if accelerate is not None:
            return {"path": str(path), "error": None, "findings": [
                _as_dict(f, position_of(f.key, accelerate[1])) for f in accelerate[0]]}
        loaded = load_config(path)
    except LintInputError as e:
        return {"path": str(path), "error": str(e), "findings": []}
    context = LintContext(scope="file", fsdp_version=fsdp_version, env_keys=loaded.env_keys)
    findings = [_as_dict(f, position_of(f.key, loaded.positions))
                for f in lint_config(loaded.config, context)]
    return {"path": str(path), "error": None, "findings": findings}


def _as_dict(finding: Finding, position: tuple[int, int] | None) -> dict[str, Any]:
    line, column = position if position else (None, None)
    return {"rule": finding.rule, "severity": finding.severity, "key": finding.key,
            "line": line, "column": column, "message": finding.message, "fix": finding.fix}


def _expand(paths: list[str]) -> list[Path | dict[str, Any]]:
    """The files to lint; a folder without YAML files becomes an error entry (a wrong path in
    CI must not pass as "0 files linted")."""
    items: list[Path | dict[str, Any]] = []
    for name in paths:
        p = Path(name)
        if not p.is_dir():
            items.append(p)
            continue
        found = sorted(p.rglob("*.yaml")) + sorted(p.rglob("*.yml"))
        items += found or [{"path": str(p), "error": f"{p}: no .yaml or .yml file in this folder",
                            "findings": []}]
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="train YAML files or folders of them")
    parser.add_argument("--format", choices=("text", "json", "sarif"), default="text",
                        help="text: a table per file (colour on a terminal unless NO_COLOR); "
                             "json: {files: [{path, error, findings}]}; sarif: SARIF 2.1.0; "
                             "default text")


def exit_code(report: dict[str, Any]) -> int:
    """2 if a file could not be linted, else 1 if any finding is an error, else 0."""
    if any(e["error"] for e in report["files"]):
        return 2
    return int(any(f["severity"] == "error" for e in report["files"] for f in e["findings"]))


def run(args: argparse.Namespace) -> int:
    fsdp_version = fsdp_version_from_env(os.environ)
    report = {"files": [lint_file(p, fsdp_version) if isinstance(p, Path) else p
                        for p in _expand(args.paths)]}
    if args.format == "json":
        print(render_json(report))
    elif args.format == "sarif":
        print(render_sarif(report))
    else:
        for entry in report["files"]:
            if entry["error"]:
                print(f"error: {entry['error']}", file=sys.stderr)
        print(render_text(report, use_colour(sys.stdout.isatty(), os.environ)))
    return exit_code(report)
