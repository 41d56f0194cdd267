"""Reading Accelerate configs and the DeepSpeed JSON they point to, for the rules in
`foundry_fp8.lint.rules.accelerate`: the impure part (files, the installed Accelerate's
version). `lint_accelerate_file` returns None for a file that is neither (a train config).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.environment import imported_version
from foundry_fp8.lint.known import TRAIN_CONFIG_KEYS
from foundry_fp8.lint.load import (
    OMEGACONF,
    SAFE_LOAD,
    LintInputError,
    Reader,
    compose,
    key_positions,
    read_text,
    read_yaml,
)
from foundry_fp8.lint.registry import Finding, LintContext, first_line, run_rules, section
from foundry_fp8.lint.rules.accelerate import (
    LOCAL,
    TORCHAO_MIN,
    AccelerateInput,
    accelerate_keys,
)
from foundry_fp8.te.facts import parse_version

#: Top-level keys that mark an Accelerate config (`process_config` requires distributed_type;
#: `accelerate config` always writes compute_environment). LLM-Foundry YAMLs have neither.
ACCELERATE_MARKERS = ("compute_environment", "distributed_type")
#: Keys only an Accelerate config has: a file holding one and no LLM-Foundry key is an
#: Accelerate config even without its markers (a snippet from Accelerate's docs).
ACCELERATE_ONLY = accelerate_keys(LOCAL) - TRAIN_CONFIG_KEYS - {
    "fsdp_config", "deepspeed_config", "fp16"}  # fp16: a DeepSpeed JSON key too
#: Keys a DeepSpeed JSON shares with a train config; any other TrainConfig key makes a JSON file
#: an LLM-Foundry train config.
DEEPSPEED_SHARED = frozenset({"optimizer", "scheduler"})


def lint_input(accelerate: Mapping[str, Any] | None, deepspeed: Mapping[str, Any] | None = None,
               *, version: tuple[int, ...] | None = None, deepspeed_path: str | None = None,
               deepspeed_positions: Mapping[str, tuple[int, int]] | None = None,
               deepspeed_missing: str | None = None,
               deepspeed_lookup_error: str | None = None,
               deepspeed_kind: str | None = None,
               deepspeed_duplicates: tuple[str, ...] = (),
               torchao: bool = False) -> AccelerateInput:
    """What the rules read (see AccelerateInput)."""
    return AccelerateInput(accelerate or {}, deepspeed, version, deepspeed_path,
                           deepspeed_positions or {}, deepspeed_missing, deepspeed_lookup_error,
                           deepspeed_kind, deepspeed_duplicates, torchao)


def lint_accelerate(inp: AccelerateInput) -> list[Finding]:
    """All findings for one `lint_input(...)`."""
    return run_rules("accelerate", inp, LintContext(scope="file"))


def is_accelerate(config: Any) -> bool:
    """An Accelerate config: its markers, or its own keys and none of LLM-Foundry's."""
    if not isinstance(config, Mapping):
        return False
    keys = {str(k) for k in config}
    return bool(keys & set(ACCELERATE_MARKERS)) or (
        bool(keys & ACCELERATE_ONLY) and not keys & (TRAIN_CONFIG_KEYS - {"fsdp_config"}))


def is_train_json(config: Any) -> bool:
    """A JSON file holding an LLM-Foundry train config rather than a DeepSpeed config."""
    return isinstance(config, Mapping) and bool(
        {str(k) for k in config} & (TRAIN_CONFIG_KEYS - DEEPSPEED_SHARED))


# -- reading files: the impure part -----------------------------------------------------------

def installed_accelerate() -> tuple[int, ...] | None:
    """The Accelerate Python imports here (`imported_version`: a folder shadowing the installed
    one runs, not the installed one)."""
    return parse_version(imported_version("accelerate", "accelerate"))


def installed_torchao() -> bool:
    """Is a torchao that Accelerate would use (>= 0.6.1) installed here?"""
    try:
        version = parse_version(metadata.version("torchao"))
    except Exception:
        return False
    return version is not None and version >= TORCHAO_MIN


def read_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LintInputError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except (RecursionError, ValueError) as e:  # too deep, or an integer too long for Python
        with contextlib.suppress(yaml.YAMLError):
            compose(path, text, OMEGACONF)  # YAML reads JSON too, and refuses either at its line
        raise LintInputError(f"{path}:1: cannot load: {first_line(e)}") from None


def duplicate_keys(text: str) -> tuple[str, ...]:
    """The dotted keys a JSON text gives twice in one object (json.load keeps the last; DeepSpeed
    refuses them when it reads the file); () when it does not parse."""
    found: list[tuple[dict[str, Any], str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result:
                found.append((result, key))
            result[key] = value
        return result

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return ()
    paths: dict[int, str] = {id(data): ""}
    stack = [data]
    while stack:  # each object's dotted path (list items by index)
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else \
            enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, (dict, list)) and id(value) not in paths:
                paths[id(value)] = f"{paths[id(node)]}{key}."
                stack.append(value)
    return tuple(dict.fromkeys(f"{paths.get(id(obj), '')}{key}" for obj, key in found))


def _positions(path: Path, text: str, is_json: bool) -> dict[str, tuple[int, int]]:
    """Each key's (line, column): as Accelerate's reader composes a YAML file, and as libyaml
    does a JSON file (which json.load reads; libyaml takes a tab between its tokens)."""
    reader: Reader = OMEGACONF if is_json else SAFE_LOAD
    try:
        return key_positions(compose(path, text, reader))[0]
    except yaml.YAMLError:  # JSON that YAML cannot read (tabs): findings lose their lines
        return {}


def _kind(mode: int) -> str | None:
    """What a path that is not a regular file names (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _find_deepspeed(path: Path, name: str) -> tuple[Path | None, str | None, str | None]:
    """The DeepSpeed JSON, looked for next to `path` then in the current directory, the name
    as written (HfDeepSpeedConfig opens it so: no `~`); else None, why a place could not be
    looked at (None: it is not there), and what the first place that exists is when it is not
    a regular file (`a folder`, `a FIFO`, `a device`: never opened)."""
    candidate, error = Path(name), None
    for place in [candidate] if candidate.is_absolute() else [path.parent / candidate,
                                                              candidate]:
        try:
            kind = _kind(os.stat(place).st_mode)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:  # a name too long, a folder we may not search
            error = getattr(e, "strerror", None) or str(e)
            continue
        return (place, None, None) if kind is None else (None, None, kind)
    return None, error, None


def lint_accelerate_file(path: Path, text: str | None = None, data: Any = None,
                         is_json: bool | None = None,
                         ) -> tuple[list[Finding], dict[str, tuple[int, int]]] | None:
    """(findings, key positions) for an Accelerate config or a DeepSpeed JSON (`text` and its
    parsed `data` when the caller has read them); None for any other file (a train config).
    LintInputError (one line, naming file and line) when a file cannot be read or parsed.
    `is_json`: the text is JSON (None: as its name ends)."""
    is_json = path.suffix.lower() == ".json" if is_json is None else is_json
    if text is None:
        text = read_text(path)
        data = read_json(path, text) if is_json else read_yaml(path, text, SAFE_LOAD).data
    if not (is_accelerate(data) or (is_json and isinstance(data, Mapping)
                                    and not is_train_json(data))):
        if is_json and not isinstance(data, Mapping):
            raise LintInputError(f"{path}:1: a DeepSpeed or Accelerate config must be a JSON "
                                 "object")
        return None
    positions = _positions(path, text, is_json)
    if not is_accelerate(data):  # a DeepSpeed JSON on its own
        return lint_accelerate(lint_input({}, data, deepspeed_duplicates=duplicate_keys(text))), \
            positions
    ds_name = section(data, "deepspeed_config").get("deepspeed_config_file")
    deepspeed, ds_positions, missing, lookup_error, ds_path = None, {}, None, None, None
    duplicates: tuple[str, ...] = ()
    kind = None
    if isinstance(ds_name, str) and ds_name and ds_name != "none":  # "none": no file (Accelerate)
        found, lookup_error, kind = _find_deepspeed(path, ds_name)
        if found is None:
            missing = ds_name
        else:
            ds_text = read_text(found)
            deepspeed = read_json(found, ds_text)
            ds_positions, ds_path = _positions(found, ds_text, True), found
            duplicates = duplicate_keys(ds_text)
            if not isinstance(deepspeed, Mapping):
                raise LintInputError(f"{found}:1: a DeepSpeed config must be a JSON object")
    inp = lint_input(data, deepspeed, version=installed_accelerate(),
                     deepspeed_path=str(ds_path) if ds_path else None,
                     deepspeed_positions=ds_positions, deepspeed_missing=missing,
                     deepspeed_lookup_error=lookup_error, deepspeed_kind=kind,
                     deepspeed_duplicates=duplicates, torchao=installed_torchao())
    return lint_accelerate(inp), positions
