"""`foundry-fp8 lint PATH...`: read YAMLs as LLM-Foundry does, report findings at their lines.

Exit codes: 0 no errors, 1 at least one error finding, 2 a file could not be read or resolved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.lint.rules import Finding, lint_config


class LintInputError(Exception):
    """A file we cannot lint; the message is one line naming the file (and line when known)."""


def key_lines(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line of that key in the YAML text."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[path] = key_node.start_mark.line + 1
                walk(value, path)

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return lines


def load_config(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The resolved config (omegaconf, `variables` and `${...}` resolved) and key lines."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        text = path.read_text()
    except OSError as e:
        raise LintInputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        lines = key_lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise LintInputError(f"{path}{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    try:
        config = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        line = lines.get(str(key), "?")
        raise LintInputError(f"{path}:{line}: cannot resolve key {key}: "
                             f"{str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise LintInputError(f"{path}:1: a train config must be a mapping")
    return config, lines


def _line_of(key: str, lines: dict[str, int]) -> int | None:
    while key:
        if key in lines:
            return lines[key]
        key = key.rpartition(".")[0]
    return None


def lint_file(path: Path) -> dict[str, Any]:
    """One entry of the JSON contract: {path, error, findings}."""
    try:
        config, lines = load_config(path)
    except LintInputError as e:
        return {"path": str(path), "error": str(e), "findings": []}
    findings = [_as_dict(f, _line_of(f.key, lines)) for f in lint_config(config)]
    return {"path": str(path), "error": None, "findings": findings}


def _as_dict(finding: Finding, line: int | None) -> dict[str, Any]:
    return {"rule": finding.rule, "severity": finding.severity, "key": finding.key,
            "line": line, "message": finding.message, "fix": finding.fix}


def _expand(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in paths:
        p = Path(name)
        files.extend(sorted(p.rglob("*.yaml")) + sorted(p.rglob("*.yml")) if p.is_dir() else [p])
    return files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="train YAML files or folders of them")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    report = {"files": [lint_file(p) for p in _expand(args.paths)]}
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        for entry in report["files"]:
            if entry["error"]:
                print(f"error: {entry['error']}", file=sys.stderr)
            for f in entry["findings"]:
                print(f"{entry['path']}:{f['line']}: {f['severity']} {f['rule']} {f['key']}: "
                      f"{f['message']} (fix: {f['fix']})")
        total = sum(len(e["findings"]) for e in report["files"])
        print(f"{len(report['files'])} file(s) linted, {total} finding(s)")
    if any(e["error"] for e in report["files"]):
        return 2
    return int(any(f["severity"] == "error" for e in report["files"] for f in e["findings"]))
