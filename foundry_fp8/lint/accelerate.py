"""Reading Accelerate configs and the DeepSpeed JSON they point to, for the rules in
`foundry_fp8.lint.rules.accelerate`: the impure part (files, the installed Accelerate's
version). `lint_accelerate_file` returns None for a file that is neither (a train config).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.lint.known import TRAIN_CONFIG_KEYS
from foundry_fp8.lint.load import (
    LintInputError,
    compose,
    first_line,
    key_positions,
    load_data,
    read_text,
)
from foundry_fp8.lint.registry import Finding, LintContext, run_rules, section
from foundry_fp8.lint.rules.accelerate import LOCAL, AccelerateInput, accelerate_keys
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
               deepspeed_lookup_error: str | None = None) -> AccelerateInput:
    """What the rules read (see AccelerateInput)."""
    return AccelerateInput(accelerate or {}, deepspeed, version, deepspeed_path,
                           deepspeed_positions or {}, deepspeed_missing, deepspeed_lookup_error)


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
    try:
        return parse_version(metadata.version("accelerate"))
    except Exception:
        return None


def read_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LintInputError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except (RecursionError, ValueError) as e:  # too deep, or an integer too long for Python
        with contextlib.suppress(yaml.YAMLError):
            compose(path, text)  # YAML reads JSON too, and refuses either at its line
        raise LintInputError(f"{path}:1: cannot load: {first_line(e)}") from None


def _positions(path: Path, text: str) -> dict[str, tuple[int, int]]:
    try:
        return key_positions(compose(path, text))[0]
    except yaml.YAMLError:  # JSON that YAML cannot read (tabs): findings lose their lines
        return {}


def _find_deepspeed(path: Path, name: str) -> tuple[Path | None, str | None]:
    """The DeepSpeed JSON, looked for next to `path` then in the current directory, the name
    as written (HfDeepSpeedConfig opens it so: no `~`); else None and why a place could not
    be looked at (None: it is not there)."""
    candidate, error = Path(name), None
    for place in [candidate] if candidate.is_absolute() else [path.parent / candidate,
                                                              candidate]:
        try:
            if place.is_file():
                return place, None
        except OSError as e:  # a name too long, a folder we may not search
            error = e.strerror or str(e)
    return None, error


def lint_accelerate_file(path: Path, text: str | None = None, data: Any = None,
                         ) -> tuple[list[Finding], dict[str, tuple[int, int]]] | None:
    """(findings, key positions) for an Accelerate config or a DeepSpeed JSON (`text` and its
    parsed `data` when the caller has read them); None for any other file (a train config).
    LintInputError (one line, naming file and line) when a file cannot be read or parsed."""
    is_json = path.suffix.lower() == ".json"
    if text is None:
        text = read_text(path)
        data = read_json(path, text) if is_json else load_data(path, text)
    if not (is_accelerate(data) or (is_json and isinstance(data, Mapping)
                                    and not is_train_json(data))):
        if is_json and not isinstance(data, Mapping):
            raise LintInputError(f"{path}:1: a DeepSpeed or Accelerate config must be a JSON "
                                 "object")
        return None
    positions = _positions(path, text)
    if not is_accelerate(data):  # a DeepSpeed JSON on its own
        return lint_accelerate(lint_input({}, data)), positions
    ds_name = section(data, "deepspeed_config").get("deepspeed_config_file")
    deepspeed, ds_positions, missing, lookup_error, ds_path = None, {}, None, None, None
    if isinstance(ds_name, str) and ds_name:
        found, lookup_error = _find_deepspeed(path, ds_name)
        if found is None:
            missing = ds_name
        else:
            ds_text = read_text(found)
            deepspeed = read_json(found, ds_text)
            ds_positions, ds_path = _positions(found, ds_text), found
            if not isinstance(deepspeed, Mapping):
                raise LintInputError(f"{found}:1: a DeepSpeed config must be a JSON object")
    inp = lint_input(data, deepspeed, version=installed_accelerate(),
                     deepspeed_path=str(ds_path) if ds_path else None,
                     deepspeed_positions=ds_positions, deepspeed_missing=missing,
                     deepspeed_lookup_error=lookup_error)
    return lint_accelerate(inp), positions
