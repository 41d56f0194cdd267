"""`foundry-fp8 lint PATH...`: read configs as LLM-Foundry, MCLI and Accelerate do, and report
findings at their lines.

A file is linted by what it is: an Accelerate config (or a DeepSpeed JSON), an MCLI run config
(its `parameters:` as the train or eval config MCLI hands to the script), an LLM-Foundry eval
config (a `models:` list), else an LLM-Foundry train config (YAML or JSON).

Exit codes: 0 no errors, 1 at least one error finding, 2 a file could not be read or resolved.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.lint.accelerate import (
    is_accelerate,
    is_train_json,
    lint_accelerate_file,
    read_json,
)
from foundry_fp8.lint.known import TRAIN_CONFIG_KEYS
from foundry_fp8.lint.load import (
    LintInputError,
    cannot_read,
    load_config,
    load_data,
    position_of,
    read_text,
)
from foundry_fp8.lint.output import render_json, render_sarif, render_text, use_colour
from foundry_fp8.lint.registry import Finding, LintContext, run_rules
from foundry_fp8.lint.rules import fsdp_version_from_env, lint_config
from foundry_fp8.lint.rules.eval import is_eval_config

__all__ = ["LintInputError", "add_arguments", "lint_file", "run"]

#: Keys of an MCLI run config (mcli's RunConfig) besides `parameters`, as LLM-Foundry's mcli/
#: folder uses them.
MCLI_KEYS = frozenset({"name", "image", "command", "compute", "integrations", "scheduling",
                       "env_variables", "gpu_num", "gpu_type", "cluster", "entrypoint",
                       "run_name", "metadata"})


def _is_mcli(data: Any) -> bool:
    """An MCLI run config: MCLI's keys and none of a train config's (`parameters` aside)."""
    if not isinstance(data, Mapping):
        return False
    keys = {str(k) for k in data}
    return bool(keys & (MCLI_KEYS - {"name"})) and not keys & (TRAIN_CONFIG_KEYS - MCLI_KEYS)


def _error_entry(path: Path | str, error: str) -> dict[str, Any]:
    return {"path": str(path), "error": error, "findings": []}


def _entry(path: Path, findings: list[Finding], positions: Mapping[str, tuple[int, int]],
           prefix: str = "") -> dict[str, Any]:
    return {"path": str(path), "error": None, "findings": [
        _as_dict(replace(f, key=prefix + f.key), position_of(prefix + f.key, dict(positions)))
        for f in findings]}


def lint_file(path: Path, fsdp_version: int = 1,
              snapshot: Snapshot | None = None) -> dict[str, Any]:
    """One entry of the JSON contract: {path, error, findings}, plus `skipped` (why) for a file
    with nothing to lint. `snapshot`: what is installed where the linter runs, for the rules
    that depend on it (None: they stay quiet)."""
    try:
        text = read_text(path)
        data = read_json(path, text) if path.suffix.lower() == ".json" else load_data(path, text)
        if path.suffix.lower() == ".json" and not isinstance(data, Mapping):
            raise LintInputError(f"{path}:1: a config must be a JSON object")
        if is_accelerate(data) or (path.suffix.lower() == ".json" and not is_train_json(data)):
            findings, positions = lint_accelerate_file(path, text, data)
            return _entry(path, findings, positions)
        subtree = "parameters" if _is_mcli(data) else None
        if subtree and not isinstance(data.get(subtree), Mapping):
            return {"path": str(path), "error": None, "findings": [], "skipped": (
                "an MCLI run config without a `parameters:` mapping (its command does not "
                "train from a config MCLI writes): nothing to lint")}
        loaded = load_config(path, text, subtree)
    except LintInputError as e:
        return _error_entry(path, str(e))
    context = LintContext(scope="file", fsdp_version=fsdp_version, env_keys=loaded.env_keys,
                          snapshot=snapshot)
    findings = run_rules("eval", loaded.config, context) if is_eval_config(loaded.config) \
        else lint_config(loaded.config, context)
    return _entry(path, findings, loaded.positions, f"{subtree}." if subtree else "")


def _as_dict(finding: Finding, position: tuple[int, int] | None) -> dict[str, Any]:
    line, column = position if position else (None, None)
    return {"rule": finding.rule, "severity": finding.severity, "key": finding.key,
            "line": line, "column": column, "message": finding.message, "fix": finding.fix}


def _folder(folder: Path) -> list[Path | dict[str, Any]]:
    """Its .yaml then .yml files (in any case: `.YAML` too), each sorted, and an error entry for
    each folder in it that cannot be listed (`Path.rglob` skips those silently: their configs
    would go unlinted)."""
    found: dict[str, list[Path]] = {".yaml": [], ".yml": []}
    errors: list[Path | dict[str, Any]] = []
    for parent, _, names in os.walk(folder, onerror=lambda e: errors.append(
            _error_entry(e.filename, str(cannot_read(e.filename, e))))):
        for name in names:
            suffix = os.path.splitext(name)[1].lower()
            if suffix in found:
                found[suffix].append(Path(parent, name))
    return [*sorted(found[".yaml"]), *sorted(found[".yml"]), *errors]


def _expand(paths: list[str]) -> list[Path | dict[str, Any]]:
    """The files to lint; a folder without config files becomes an error entry (a wrong path in
    CI must not pass as "0 files linted")."""
    items: list[Path | dict[str, Any]] = []
    for name in paths:
        p = Path(name)
        try:
            is_folder = p.is_dir()
        except OSError:  # a name too long, a folder we may not search: read_text says which
            is_folder = False
        if not is_folder:
            items.append(p)
            continue
        items += _folder(p) or [_error_entry(p, f"{p}: no .yaml or .yml file in this folder")]
    return items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="config files (train, eval, MCLI, Accelerate, "
                        "DeepSpeed; YAML or JSON) or folders of YAML files")
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
    snapshot = gather_snapshot(probe_te_import=False, probe_gpu=False)
    report = {"files": [lint_file(p, fsdp_version, snapshot) if isinstance(p, Path) else p
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
