"""Read a train YAML as LLM-Foundry does, keeping where each key sits in the file.

LLM-Foundry (`train_from_yaml`, llmfoundry/command_utils/train.py) loads the file with omegaconf
and resolves `variables` and `${...}` interpolations, after clearing omegaconf's `oc.env`
resolver. We resolve the same way, but first replace each `${oc.env:...}` value by its literal
text, so the file still lints and the `oc.env` rule can name every such key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: An interpolation that `train_from_yaml` cannot resolve (it clears the `oc.env` resolver).
OC_ENV = re.compile(r"\$\{\s*oc\.env\s*:")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class LintInputError(Exception):
    """A file we cannot lint; the message is one line naming the file (and line when known)."""


@dataclass(frozen=True)
class LoadedConfig:
    """The resolved config, each dotted key's (line, column) (1-based), and the keys whose
    value uses `${oc.env:...}`."""

    config: dict[str, Any]
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)
    env_keys: tuple[str, ...] = ()


def _key_text(node: yaml.Node) -> str:
    """A mapping key as the loaded config spells it: `1` for `0x1`, `True` for `on`, `None`
    for `null`; the text itself for strings and for what does not construct."""
    if not isinstance(node, yaml.ScalarNode) or node.tag.endswith(":str"):
        return str(node.value)
    try:
        return str(yaml.SafeLoader("").construct_object(node, deep=True))
    except (yaml.YAMLError, ValueError, TypeError, OverflowError):
        return str(node.value)


def key_positions(root: yaml.Node | None,
                  ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
    """Dotted key path (list items by index) -> (line, column) of the key in a composed YAML
    document, and the (path, text) of every string value using `${oc.env:...}`."""
    positions: dict[str, tuple[int, int]] = {}
    env_values: list[tuple[str, str]] = []
    active: set[int] = set()  # nodes on the current path: a recursive alias must not loop

    def walk(node: yaml.Node, prefix: str) -> None:
        if id(node) in active:
            return
        active.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                key = _key_text(key_node)
                path = f"{prefix}.{key}" if prefix else key
                positions.setdefault(path, (key_node.start_mark.line + 1,
                                            key_node.start_mark.column + 1))
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                path = f"{prefix}.{index}"
                positions.setdefault(path, (item.start_mark.line + 1, item.start_mark.column + 1))
                walk(item, path)
        elif isinstance(node, yaml.ScalarNode) and OC_ENV.search(str(node.value)):
            env_values.append((prefix, str(node.value)))
        active.discard(id(node))

    if root is not None:
        walk(root, "")
    return positions, env_values


def _key_problem(root: yaml.Node) -> tuple[yaml.Node, str] | None:
    """The first mapping key omegaconf refuses (null, a list or a mapping), and why; other
    keys that are not strings load, and FP8022 reports them where LLM-Foundry refuses them."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    return key, "is a list or a mapping; keys must be strings"
                if key.tag.endswith(":null"):
                    return key, (f"`{key.value}` is read as null" if key.value else
                                 "is empty, read as null") + "; keys must be strings (quote it)"
            stack += [value for _, value in reversed(node.value)]
        elif isinstance(node, yaml.SequenceNode):
            stack += list(reversed(node.value))
    return None


def _yaml_error(path: Path, error: yaml.YAMLError, text: str) -> LintInputError:
    mark = getattr(error, "problem_mark", None)
    if mark is not None and 0 <= mark.index < len(text) and text[mark.index] == "\t" \
            and isinstance(error, yaml.scanner.ScannerError):
        return LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: a tab "
                              "is not allowed in YAML indentation (use spaces)")
    where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return LintInputError(f"{path}{where}: not valid YAML: {problem}")


def load_config(path: Path) -> LoadedConfig:
    """The resolved config with key positions; LintInputError (one line) when we cannot."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise LintInputError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        root = yaml.compose(text, Loader=_Loader)
        if root is None:  # LLM-Foundry's train_from_yaml cannot train from it either
            raise LintInputError(f"{path}: a train config must be a mapping; the file has no "
                                 "YAML content (empty, or only comments)")
        if not isinstance(root, yaml.MappingNode):
            raise LintInputError(f"{path}:{root.start_mark.line + 1}: a train config must be a "
                                 "mapping")
        bad_key = _key_problem(root)
        if bad_key:
            mark = bad_key[0].start_mark
            raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: cannot load: the key "
                                 f"{bad_key[1]}")
        positions, env_values = key_positions(root)
        raw = OmegaConf.create(text)
    except yaml.YAMLError as e:
        raise _yaml_error(path, e, text) from None
    except (OmegaConfBaseException, ValueError, TypeError, RecursionError) as e:
        raise LintInputError(f"{path}:1: cannot load: {str(e).splitlines()[0]}") from None
    env_keys = []
    for key, value in env_values:
        try:
            OmegaConf.update(raw, key, value.replace("${", "\\${"), merge=False)
            env_keys.append(key)
        except (OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError):
            pass  # a key omegaconf cannot address; resolution reports it if it matters
    try:
        config = OmegaConf.to_container(raw, resolve=True)
    except (OmegaConfBaseException, ValueError, TypeError, RecursionError) as e:
        key = str(getattr(e, "full_key", None) or "?")
        line = positions.get(key, ("?",))[0]
        raise LintInputError(f"{path}:{line}: cannot resolve key {key}: "
                             f"{str(e).splitlines()[0]}") from None
    return LoadedConfig(config, positions, tuple(env_keys))


def position_of(key: str, positions: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """(line, column) of `key`, or of its nearest parent present in the file."""
    while key:
        if key in positions:
            return positions[key]
        key = key.rpartition(".")[0]
    return None
