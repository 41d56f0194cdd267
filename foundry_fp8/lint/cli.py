"""`foundry-fp8 lint PATH...`: read configs as LLM-Foundry, MCLI and Accelerate do, and report
findings at their lines.

A file is linted by what it is: an Accelerate config (or a DeepSpeed JSON), an MCLI run config
(its `parameters:` as the train or eval config MCLI hands to the script), an LLM-Foundry eval
config (a `models:` list), else an LLM-Foundry train config (YAML or JSON); a file a folder walk
finds that is none of these (an inference benchmark's, mkdocs', CI's) is skipped, saying why.

Exit codes: 0 no errors, 1 at least one error finding, 2 a file could not be read or resolved.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.health.table import one_line
from foundry_fp8.lint.accelerate import (
    is_accelerate,
    is_train_json,
    lint_accelerate_file,
    read_json,
)
from foundry_fp8.lint.load import (
    OMEGACONF,
    SAFE_LOAD,
    Document,
    LintInputError,
    NotParsed,
    Overrides,
    Reader,
    cannot_read,
    compose,
    drop_duplicate_keys,
    key_positions,
    load_config,
    position_of,
    read_names,
    read_overrides,
    read_stdin,
    read_text,
    read_yaml,
    written_at,
)
from foundry_fp8.lint.output import render_json, render_sarif, render_text, use_colour
from foundry_fp8.lint.registry import Finding, LintContext, first_line, run_rules
from foundry_fp8.lint.rules import fsdp_version_from_env, lint_config, wandb_mode_from_env
from foundry_fp8.lint.rules.eval import is_eval_config
from foundry_fp8.lint.rules.mcli import (
    PIN_RULES,
    command_overrides,
    is_mcli,
    mcli_env,
    mcli_gpus,
    pinned_note,
    pinned_snapshot,
    pinned_te_findings,
    pins,
    unjudged_rules,
)
from foundry_fp8.lint.rules.train import TRAIN_ONLY_KEYS, foreign_top_level
from foundry_fp8.packages import is_ours

__all__ = ["LintInputError", "add_arguments", "lint_file", "run"]

def _error_entry(path: Path | str, error: str) -> dict[str, Any]:
    return {"path": str(path), "error": error, "findings": []}


def _entry(path: Path, findings: list[Finding], positions: Mapping[str, tuple[int, int]],
           prefix: str = "", overrides: Overrides | None = None,
           taken: Mapping[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A finding at a key a command-line override sets names that override, and stands at the
    key's line only where the file writes that key (never at a parent's: the value is not the
    file's). One beneath a key written as one interpolation (`model: ${variables.model}`,
    `taken`) stands where the value is written, and says so: its key stays the one it feeds."""
    entries = []
    for f in findings:
        key = prefix + f.key
        item = overrides.item_for(f.key, key in positions) if overrides else None
        written = None if item else written_at(key, positions, taken or {})
        where = positions.get(key) if item else position_of(written[0] if written else key,
                                                             positions)
        note = f" (set by {item})" if item else written[1] if written else ""
        entries.append(_as_dict(replace(f, key=key, message=f.message + note), where))
    return {"path": str(path), "error": None, "findings": entries}


#: The name standard input (`-` on the command line) has in messages and entries: read as JSON
#: when it is a JSON object, else as YAML; the Accelerate rules look for its DeepSpeed file in the
#: current folder.
STDIN = Path("<stdin>")


def lint_file(path: Path, fsdp_version: int = 1, snapshot: Snapshot | None = None,
              wandb_mode: str | None = None, text: str | None = None,
              gpus: int | None = None, overrides: Sequence[str] = (),
              walked: bool = False) -> dict[str, Any]:
    """One entry of the JSON contract: {path, error, findings}, plus `skipped` (why) for a file
    with nothing to lint. `snapshot`: what is installed where the linter runs, for the rules
    that depend on it (None: they stay quiet); `wandb_mode`: W&B's mode from the environment
    (`wandb_mode_from_env`; None: not set); `text`: the file's text when the caller has read it
    (standard input), else it is read from `path`; `gpus`: how many GPUs the config trains on
    (`--gpus`), unless an MCLI run config's `compute.gpus` says; `overrides`: `--override`'s
    KEY=VALUEs, merged into the train or eval config (an MCLI run config's `parameters`, after
    its `command:`'s own) as the train script merges its command line's; an Accelerate or
    DeepSpeed config takes none; `walked`: a folder walk found the file (not named on the command
    line), which is skipped when it is no LLM-Foundry config (`foreign_top_level`)."""
    try:
        text = read_text(path) if text is None else text
        is_json = path.suffix.lower() == ".json" or (path is STDIN and _json_object(text))
        document, refused = (None, None) if is_json else _read(path, text)
        data = read_json(path, text) if document is None else document.data
        if is_json and not isinstance(data, Mapping):
            raise LintInputError(f"{path}:1: a config must be a JSON object")
        if is_accelerate(data) or (is_json and not is_train_json(data)):
            findings, positions = lint_accelerate_file(path, text, data, is_json)
            return _entry(path, findings, positions)
        mcli = is_mcli(data)
        # MCLI keeps the last of a key given twice (yaml.safe_load), which omegaconf refuses
        dropped = drop_duplicate_keys(document.root) if mcli and document else []
        if dropped:
            text = yaml.serialize(document.root)
        if mcli and refused is not None:
            text = _parameters_text(path, document, refused)
        outer = run_rules("mcli", data, LintContext(scope="file", duplicates=tuple(dropped))) \
            if mcli else []
        if mcli and not (isinstance(data.get("parameters"), Mapping) and data["parameters"]):
            entry = _entry(path, outer, key_positions(
                document.root if document else compose(path, text, SAFE_LOAD))[0])
            if not outer:
                entry["skipped"] = ("an MCLI run config without `parameters:` whose command does "
                                    "not train from the config MCLI writes (or with an empty "
                                    "one): nothing to lint")
            return entry
        foreign = [] if not walked or is_json or mcli or not isinstance(data, Mapping) \
            or is_eval_config(data) else foreign_top_level(data, read_names(text))
        if foreign:
            entry = _entry(path, [], {})
            entry["skipped"] = (
                f"not an LLM-Foundry train or eval config: {len(foreign)} of its {len(data)} "
                f"top-level keys ({_listed(foreign)}) are none that TrainConfig or EvalConfig "
                "takes, and it has none only a train config has "
                f"({_listed(list(TRAIN_ONLY_KEYS))}): nothing to lint (as a train config, "
                "LLM-Foundry would refuse those keys: 'Unused parameters'; name the file on the "
                "command line to lint it as one)")
            return entry
        subtree = "parameters" if mcli else None
        merged = _overrides(path, data if mcli else {}, list(overrides), document)
        loaded = load_config(path, text, subtree, document, merged)
    except LintInputError as e:
        return _error_entry(path, str(e))
    pinned = {p.field: p for p in pins(data)} if mcli else {}
    mcli_count = mcli_gpus(data) if mcli else None
    run_env = mcli_env(data) if mcli else {}  # the run's own environment, not the linter's
    if "FSDP_VERSION" in run_env:
        fsdp_version = fsdp_version_from_env(run_env)
    if run_env.keys() & {"WANDB_MODE", "WANDB_DISABLED"}:
        wandb_mode = wandb_mode_from_env(run_env)
    context = LintContext(scope="file", fsdp_version=fsdp_version, env_keys=loaded.env_keys,
                          snapshot=pinned_snapshot(snapshot, pinned), wandb_mode=wandb_mode,
                          gpus=gpus if mcli_count is None else mcli_count,
                          gpus_said="" if mcli_count is not None or gpus is None
                          else f"`--gpus {gpus}`", interpolated=loaded.interpolated)
    findings = run_rules("eval", loaded.config, context) if is_eval_config(loaded.config) \
        else lint_config(loaded.config, context)
    unjudged = unjudged_rules(pinned)
    findings = [replace(f, message=f.message + pinned_note(PIN_RULES[f.rule], pinned))
                if f.rule in PIN_RULES else f for f in findings if f.rule not in unjudged]
    entry = _entry(path, findings, loaded.positions, f"{subtree}." if subtree else "", merged,
                   loaded.taken)
    outer += [replace(f, message=f.message + pinned_note(PIN_RULES[f.rule], pinned))
              for f in pinned_te_findings(loaded.config, pinned, context)]
    entry["findings"][:0] = _entry(path, outer, loaded.positions, taken=loaded.taken)["findings"]
    return entry


def reader_of(data: Any) -> Reader:
    """The reader of the tool that reads a file of this kind: yaml.safe_load for an Accelerate
    config and an MCLI run config, omegaconf's for LLM-Foundry's train and eval configs."""
    return SAFE_LOAD if is_accelerate(data) or is_mcli(data) else OMEGACONF


def _read(path: Path, text: str) -> tuple[Document, NotParsed | None]:
    """The YAML file as the tool that reads its kind reads it (`reader_of`), its kind told from
    omegaconf's reading, else, where omegaconf's reader refuses the syntax, from
    yaml.safe_load's; and that refusal, where only yaml.safe_load reads it (an Accelerate or
    MCLI config with a `"\\ud800"` escape, `%YAML 1.3`, a byte-order mark inside the file).
    A file that is none of those is refused as omegaconf refuses it."""
    try:
        document = read_yaml(path, text, OMEGACONF)
    except NotParsed as refused:
        try:
            document = read_yaml(path, text, SAFE_LOAD)
        except LintInputError:
            raise refused from None
        if reader_of(document.data) is not SAFE_LOAD:
            raise refused from None
        return document, refused
    if reader_of(document.data) is SAFE_LOAD:
        return read_yaml(path, text, SAFE_LOAD), None
    return document, None


def _parameters_text(path: Path, document: Document, refused: NotParsed) -> str:
    """What the train script's omegaconf reads of an MCLI run config only yaml.safe_load reads:
    its `parameters`, which MCLI writes to a file of their own (here serialized by PyYAML); the
    file's refusal by omegaconf's reader where it refuses them too (what it refuses is in
    them)."""
    root = document.root
    assert isinstance(root, yaml.MappingNode)  # an MCLI run config is a mapping
    pairs = [(k, v) for k, v in root.value
             if isinstance(k, yaml.ScalarNode) and k.value == "parameters"]
    text = yaml.serialize(yaml.MappingNode(root.tag, pairs[-1:] or root.value))
    try:
        compose(path, text, OMEGACONF)
    except yaml.YAMLError:
        raise refused from None
    return text


def _listed(keys: list[str], most: int = 6) -> str:
    """`a`, `b`, ... : the first `most` keys, and how many more."""
    shown = ", ".join(f"`{k}`" for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _overrides(path: Path, mcli: Mapping[str, Any], items: list[str],
               document: Document | None) -> Overrides | None:
    """The overrides the run merges into its config: an MCLI run config's command's, then
    `--override`'s; at the command's line when omegaconf refuses them."""
    command = command_overrides(mcli)
    if not command and not items:
        return None
    try:
        return read_overrides(items, command)
    except LintInputError as e:
        line = key_positions(document.root if document else None)[0].get("command", (None,))[0]
        raise LintInputError(f"{path}{f':{line}' if line else ''}: {e}") from None


def _json_object(text: str) -> bool:
    """Standard input's text is a JSON object (a DeepSpeed or train config JSON), which is read
    as JSON, as a `.json` file is; anything else is read as YAML."""
    if not text.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # YAML's flow mapping, or what read_yaml refuses
        return False


def _as_dict(finding: Finding, position: tuple[int, int] | None) -> dict[str, Any]:
    line, column = position if position else (None, None)
    return {"rule": finding.rule, "severity": finding.severity, "key": finding.key,
            "line": line, "column": column, "message": finding.message, "fix": finding.fix}


#: Folders a walk does not enter (a folder named on the command line is still linted): hidden
#: ones (`.git`, `.venv`, `.github`), caches, and virtualenvs by their `pyvenv.cfg`; they hold
#: third-party YAML, not the configs being linted.
SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules", "site-packages"})


def _walked(name: str, parent: str) -> bool:
    """Whether a walk enters the subfolder `name` of `parent`."""
    return not (name.startswith(".") or name in SKIPPED_FOLDERS
                or os.path.isfile(os.path.join(parent, name, "pyvenv.cfg")))


def _folder(folder: Path) -> list[Path | dict[str, Any]]:
    """Its .yaml then .yml files (in any case: `.YAML` too), each sorted, and an error entry for
    each folder in it that cannot be listed (`Path.rglob` skips those silently: their configs
    would go unlinted). Hidden files and the folders `_walked` refuses are left out; symlinked
    folders are followed, each real folder entered once (a link loop ends there)."""
    found: dict[str, list[Path]] = {".yaml": [], ".yml": []}
    errors: list[Path | dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for parent, folders, names in os.walk(folder, followlinks=True, onerror=lambda e: errors.append(
            _error_entry(e.filename, str(cannot_read(e.filename, e))))):
        try:
            info = os.stat(parent)
        except OSError:
            folders[:] = []
            continue
        if (info.st_dev, info.st_ino) in seen:  # a link back to a folder walked already
            folders[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        folders[:] = [name for name in folders if _walked(name, parent)]
        for name in names:
            suffix = os.path.splitext(name)[1].lower()
            if suffix in found and not name.startswith("."):
                found[suffix].append(Path(parent, name))
    return [*sorted(found[".yaml"]), *sorted(found[".yml"]), *errors]


@dataclass(frozen=True)
class _Walked:
    """A file a folder walk found, not one named on the command line (nor matched by a
    pattern): a walk of a checkout meets YAML files that are no LLM-Foundry config."""

    path: Path


def _expand(paths: list[str]) -> list[Path | _Walked | dict[str, Any]]:
    """The files to lint; a folder without config files becomes an error entry (a wrong path in
    CI must not pass as "0 files linted"), and so does an empty path, which Path reads as the
    current folder (an unset variable in CI would lint whatever folder the job is in)."""
    items: list[Path | _Walked | dict[str, Any]] = []
    for name in paths:
        if name == "-":  # standard input, read once (a second `-` would read nothing)
            items.append(_error_entry(STDIN, f"{STDIN}: `-` named more than once: standard "
                                      "input is read once") if STDIN in items else STDIN)
            continue
        if not name:
            items.append(_error_entry(name, "an empty path: name a config file or a folder (an "
                                      "unset variable?)"))
            continue
        items += _named(name) if not glob.has_magic(name) or os.path.lexists(name) else \
            _matched(name)
    return items


def _named(name: str) -> list[Path | _Walked | dict[str, Any]]:
    """A path named on the command line: a folder's files, or the file itself."""
    p = Path(name)
    try:
        is_folder = p.is_dir()
    except OSError:  # a name too long, a folder we may not search: read_text says which
        is_folder = False
    if not is_folder:
        return [p]
    return [_Walked(f) if isinstance(f, Path) else f for f in _folder(p)] or [
        _error_entry(p, f"{p}: no .yaml or .yml file in this folder")]


def _matched(pattern: str) -> list[Path | _Walked | dict[str, Any]]:
    """A glob pattern no shell expanded (quoted in CI, or a shell without `**`): what it
    matches, `**` any number of folders deep (symlinked folders not entered), hidden names
    left out; a pattern matching nothing is an error entry, as a missing file is."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    # pathlib's `**` (Python 3.10-3.12) does not enter symlinked folders: a link loop cannot
    # make it walk forever, as glob.glob's does (until ELOOP, some 40 levels down)
    base = Path(*parts[:first]) if first else Path()
    matches = sorted(str(m) for m in base.glob(str(Path(*parts[first:])))
                     if not m.name.startswith("."))
    if not matches:
        return [_error_entry(pattern, f"{pattern}: no file matches this pattern")]
    return [item for match in matches for item in _named(match)]


def _gpu_count(text: str) -> int:
    """`--gpus`' value: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of GPUs, at least 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", help="config files (train, eval, MCLI, Accelerate, "
                        "DeepSpeed; YAML or JSON), folders of YAML files, glob patterns (quoted: "
                        "'yamls/**/*.yaml' matches any depth), or - for a YAML config on "
                        "standard input (named <stdin>)")
    parser.add_argument("--gpus", type=_gpu_count, metavar="N",
                        help="how many GPUs the train configs train on (one process each), "
                             "for the rules that depend on it (LLM-Foundry drops fsdp_config "
                             "in one process); an MCLI run config's compute.gpus wins; default "
                             "unknown: those rules warn")
    parser.add_argument("--override", action="extend", nargs="+", metavar="KEY=VALUE",
                        help="command-line overrides as the train script takes them "
                             "(`composer train.py cfg.yaml precision=amp_fp8 model.n_layers=24`: "
                             "--override precision=amp_fp8 model.n_layers=24, after the paths), "
                             "read by omegaconf's from_dotlist and merged into each train or "
                             "eval config (an MCLI run config's parameters) before it is "
                             "resolved, as LLM-Foundry does (an MCLI run config's command's "
                             "own first); a finding at a key one sets names it; default none")
    parser.add_argument("--format", choices=("text", "json", "sarif"), default="text",
                        help="text: a table per file (colour on a terminal unless NO_COLOR or "
                             "TERM=dumb); json: {files: [{path, error, findings}]}; "
                             "sarif: SARIF 2.1.0; default text")


def exit_code(report: dict[str, Any]) -> int:
    """2 if a file could not be linted, else 1 if any finding is an error, else 0."""
    if any(e["error"] for e in report["files"]):
        return 2
    return int(any(f["severity"] == "error" for e in report["files"] for f in e["findings"]))


def _lint_or_report(path: Path, fsdp_version: int, snapshot: Snapshot,
                    wandb_mode: str | None, gpus: int | None,
                    overrides: Sequence[str], walked: bool = False) -> dict[str, Any]:
    """lint_file (on standard input's text for STDIN itself: a file named `<stdin>` is read
    from disk), and for what escapes it (our bug) the file's one line, so that the other files
    of a folder are still linted and no traceback is printed. A dependency this Python lacks
    is no bug of ours and fails every file alike: it goes to the CLI's one line naming it."""
    try:
        if path is STDIN:
            try:
                text = read_stdin(STDIN)
            except LintInputError as e:
                return _error_entry(STDIN, str(e))
            return lint_file(STDIN, fsdp_version, snapshot, wandb_mode, text, gpus, overrides)
        return lint_file(path, fsdp_version, snapshot, wandb_mode, gpus=gpus, overrides=overrides,
                         walked=walked)
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and not is_ours(e):
            raise  # a dependency this Python lacks, for every file: the CLI's one line says so
        return _error_entry(path, f"{path}: the linter failed on this file ({type(e).__name__}: "
                            f"{first_line(e)}); this is a foundry-fp8 bug: please report it "
                            "with the file")


def run(args: argparse.Namespace) -> int:
    fsdp_version = fsdp_version_from_env(os.environ)
    wandb_mode = wandb_mode_from_env(os.environ)
    snapshot = gather_snapshot(probe_te_import=False, probe_gpu=False)
    gpus = getattr(args, "gpus", None)
    overrides = getattr(args, "override", None) or []
    try:
        read_overrides(overrides)  # the same for every file: a wrong one is said once
    except LintInputError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    report = {"files": [
        _lint_or_report(p, fsdp_version, snapshot, wandb_mode, gpus, overrides)
        if isinstance(p, Path) else _lint_or_report(p.path, fsdp_version, snapshot, wandb_mode,
                                                    gpus, overrides, walked=True)
        if isinstance(p, _Walked) else p for p in _expand(args.paths)]}
    if args.format == "json":
        print(render_json(report))
    elif args.format == "sarif":
        print(render_sarif(report))
    else:
        for entry in report["files"]:
            if entry["error"]:
                print(f"error: {one_line(entry['error'])}", file=sys.stderr)
        print(render_text(report, use_colour(sys.stdout.isatty(), os.environ)))
    return exit_code(report)
