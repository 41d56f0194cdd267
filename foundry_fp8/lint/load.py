"""Read a train YAML as LLM-Foundry does, keeping where each key sits in the file.

LLM-Foundry (`train_from_yaml`, llmfoundry/command_utils/train.py) loads the file with omegaconf
and resolves `variables` and `${...}` interpolations, after clearing omegaconf's `oc.env`
resolver. We resolve the same way, but first replace each `${oc.env:...}` value by its literal
text, so the file still lints and the `oc.env` rule can name every such key.
"""

from __future__ import annotations

import copy
import os
import re
import stat
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.lint.registry import first_line, join_key, parent_key, split_key

#: An interpolation that `train_from_yaml` cannot resolve (it clears the `oc.env` resolver).
OC_ENV = re.compile(r"\$\{\s*oc\.env\s*:")
#: The top-level name an absolute interpolation reads (`${name}`, `${name.key}`, `${name[0]}`).
_READ_NAME = re.compile(r"(?<!\\)\$\{\s*([A-Za-z_][\w-]*)\s*[.}\[]")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class _DatesAsText(_Loader):
    """YAML resolved as omegaconf resolves it, and so LLM-Foundry's train and eval configs: no
    implicit timestamp (`2001-13-45` stays text; omegaconf 2.4 `_yaml.py` get_yaml_loader drops
    the resolver, as 2.1's `_utils.py` one did), where yaml.safe_load (Accelerate's and MCLI's
    reader) makes a date of it, or raises."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
        for first, resolvers in _Loader.yaml_implicit_resolvers.items()}


class _Unconstructed(Exception):
    """A node PyYAML's safe constructor refused, and its error."""

    def __init__(self, node: yaml.Node, error: Exception):
        super().__init__(node, error)
        self.node, self.error = node, error


class _Constructor(yaml.constructor.SafeConstructor):
    """PyYAML's safe constructor (yaml.safe_load's, omegaconf's), naming the node it cannot
    construct: for some values of explicit tags (`!!bool maybe`, `!!int ''`, `!!timestamp zz`)
    it raises KeyError, IndexError or AttributeError without a mark. Called with `deep=True`,
    every node is built inside its own call, so the innermost one that fails is the one named."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (_Unconstructed, RecursionError, MemoryError):
            raise
        except Exception as e:  # whatever PyYAML raises for this node's value
            raise _Unconstructed(node, e) from None

#: Bounds that keep one file's lint short whatever it holds: bytes read, nesting depth, and
#: values (nodes, keys counted), as written and after alias expansion (a "billion laughs" file
#: is small but expands to 10^9 nodes). Values: omegaconf 2.4 refuses more than 10,000 unless
#: told otherwise (omegaconf/_yaml.py _DEFAULT_MAX_YAML_EXPANDED_NODES_VALUE); omegaconf < 2.4,
#: or 2.4 with its limit lifted, took 11 s to build a DictConfig of 120,000 (a flow mapping of
#: 60,000 keys, on a busy 2-core machine); LLM-Foundry's largest YAML
#: (scripts/eval/yamls/long_context_tasks.yaml) has under 800. Depth: YAML's C composer
#: recurses and crashes the interpreter near 100,000 levels, and omegaconf builds a DictConfig
#: recursively at about 12 Python frames per level (also into `${...}` nested in one value):
#: under Python's default limit of 1000 frames `OmegaConf.create` fails near 75 levels
#: (measured with omegaconf 2.4.0), in LLM-Foundry as here; 50 levels take about 650 frames,
#: leaving room for a caller of `lint_file` some 300 frames deep. The bound counts aliases
#: followed. A real train config is a few KiB, under 10 levels and a few hundred values.
MAX_BYTES = 2 * 1024 * 1024
MAX_DEPTH = 50
MAX_EXPANDED_NODES = 20_000
#: Interpolations (`${`) in a file: omegaconf parses each with its ANTLR grammar, several times
#: over for one value, so 60,000 in one 1.2 MB string took 32 s to resolve (70 s under a
#: profiler) on a busy 2-core machine, where 4,500 in separate values took 1.9 s of CPU; a real
#: config has under a hundred.
MAX_INTERPOLATIONS = 5_000
#: The most text a value (the whole document included) may resolve to: four times the largest
#: file the linter reads; a real config resolves to about its own size, a few KiB.
MAX_RESOLVED_CHARS = 4 * MAX_BYTES
#: Why MAX_DEPTH, in the one line that refuses a file.
_DEPTH_WHY = ("the linter's bound: real configs nest under 10 levels, and omegaconf (LLM-Foundry's "
              "reader) fails near 75")
#: Python's limit on int() of a decimal string (sys.get_int_max_str_digits, 4300 by default;
#: Python 3.10.0-3.10.6, which setup.cfg's python_requires admits, has neither: 4300 there).
_PYTHON_INT_DIGITS = getattr(sys, "get_int_max_str_digits", lambda: 0)() or 4300
#: Digits of the largest int a config may hold: a real one needs under 20 (int64); a product of
#: three such values (the rules' arithmetic) stays within what Python writes as text.
MAX_INT_DIGITS = 1000
#: An interpolation's opening and closing braces (an escaped `\${` is text).
_INTERPOLATION_BRACES = re.compile(r"(?<!\\)\$\{|\}")


class LintInputError(Exception):
    """A file we cannot lint; the message is one line naming the file (and line when known):
    `file[:line[:column]]: why` (`error_location` reads it back)."""


@dataclass(frozen=True)
class Reader:
    """A tool's YAML reader: the PyYAML loader it reads a file with, and how a refusal by it
    reads in our one line. Which kind of file each tool reads: `foundry_fp8/lint/cli.py`
    `reader_of`."""

    loader: type
    verdict: str


#: omegaconf 2.4 (omegaconf/_yaml.py: libyaml's CSafeLoader when PyYAML has it, as it does
#: here, and get_yaml_loader drops implicit timestamps), which LLM-Foundry's train_from_yaml
#: and eval_from_yaml read a config with (`om.load`), and the train script an MCLI run config's
#: `parameters` with.
OMEGACONF = Reader(_DatesAsText, "not valid YAML")
#: yaml.safe_load, PyYAML's pure-Python SafeLoader (not libyaml's), which Accelerate
#: (accelerate/commands/config/config_args.py load_config_from_file, from_yaml_file) and
#: MCLI (mcli/utils/utils_yaml.py load_yaml) read their config files with: it takes what
#: libyaml refuses (a `"\ud800"` escape, `%YAML 1.3`, a byte-order mark inside the file) and
#: refuses what libyaml takes (a tab after `key:`), and makes dates of implicit timestamps.
SAFE_LOAD = Reader(yaml.SafeLoader, "yaml.safe_load (MCLI's and Accelerate's reader) refuses it")


class NotParsed(LintInputError):
    """A reader's refusal of the file's YAML syntax (not a bound of ours, nor a value its
    constructor refuses): another tool's reader may still read the file."""


#: A LintInputError message's `:line[:column]: ` after the file it names.
_LINE_COLUMN = re.compile(r":(\d+)(?::(\d+))?: ")


def error_location(message: str, path: str) -> tuple[str, int | None, int | None]:
    """(file, line, column) a LintInputError message names: `path`'s, or another file's where
    the message starts with another (the DeepSpeed JSON behind an Accelerate config); line and
    column None when it names none."""
    if message.startswith(f"{path}:"):
        found = _LINE_COLUMN.match(message, len(path))
    else:
        found = _LINE_COLUMN.search(message)
        path = message[:found.start()] if found else path
    if found is None:
        return path, None, None
    return path, int(found.group(1)), int(found.group(2)) if found.group(2) else None


@dataclass(frozen=True)
class LoadedConfig:
    """The resolved config, each dotted key's (line, column) (1-based), the keys whose
    value uses `${oc.env:...}`, the top-level names interpolations read (`seq` for
    `${seq}` and `${seq.x}`)."""

    config: dict[str, Any]
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)
    env_keys: tuple[str, ...] = ()
    interpolated: frozenset[str] = frozenset()
    #: `node_interpolations`' map: a key written as one interpolation -> (the key it takes
    #: whole, the value as written)
    taken: dict[str, tuple[str, str]] = field(default_factory=dict)


def _key_text(node: yaml.Node) -> str:
    """A mapping key as the loaded config spells it: `1` for `0x1`, `True` for `on`, `None`
    for `null`; the text itself for strings and for what does not construct."""
    if not isinstance(node, yaml.ScalarNode) or node.tag.endswith(":str"):
        return str(node.value)
    try:
        return str(_Constructor().construct_object(node, deep=True))
    except _Unconstructed:  # `!!bool maybe`: read_yaml names it
        return str(node.value)


def _merged(node: yaml.MappingNode) -> list[yaml.MappingNode]:
    """The mappings a mapping's merge keys (`<<: *anchor`, `<<: [*a, *b]`) bring in, the
    first one first: YAML gives the mapping's own keys precedence, then the merged ones in
    order."""
    found: list[yaml.MappingNode] = []
    for key_node, value in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            values = value.value if isinstance(value, yaml.SequenceNode) else [value]
            found += [v for v in values if isinstance(v, yaml.MappingNode)]
    return found


def _entries(root: yaml.Node) -> Iterator[tuple[str, yaml.Node | None, yaml.Node]]:
    """(dotted key path (`join_key`; list items by index), key node (None for a list item),
    value node) of every value under `root`, in document order; a mapping's own keys before
    those its merge keys bring in, which sit where their anchor's mapping writes them."""
    active: set[int] = set()  # nodes on the current path: a recursive alias must not loop

    def walk(node: yaml.Node, prefix: str) -> Iterator[tuple[str, yaml.Node | None, yaml.Node]]:
        if id(node) in active:
            return
        active.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value in node.value:
                if key_node.tag != "tag:yaml.org,2002:merge":
                    path = join_key(prefix, _key_text(key_node))
                    yield path, key_node, value
                    yield from walk(value, path)
            for merged in _merged(node):  # after the mapping's own keys, which win
                yield from walk(merged, prefix)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                path = join_key(prefix, index)
                yield path, None, item
                yield from walk(item, path)
        active.discard(id(node))

    return walk(root, "")


def key_positions(root: yaml.Node | None,
                  ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
    """Dotted key path -> (line, column) of the key (a list item's own) in a composed YAML
    document, and the (path, text) of every string value using `${oc.env:...}`."""
    positions: dict[str, tuple[int, int]] = {}
    env_values: list[tuple[str, str]] = []
    for path, key_node, value in _entries(root) if root is not None else ():
        mark = (key_node or value).start_mark
        positions.setdefault(path, (mark.line + 1, mark.column + 1))
        if isinstance(value, yaml.ScalarNode) and OC_ENV.search(str(value.value)):
            env_values.append((path, str(value.value)))
    return positions, env_values


#: A value that is one interpolation of a key and nothing else (`${variables.model}`,
#: `${..model}`, `${a.b[0]}`): omegaconf gives the key that node whole, keys beneath included.
_NODE_INTERPOLATION = re.compile(r"\$\{\s*(\.*)([\w-]+(?:\.[\w-]+|\[[\w-]+\])*)\s*\}")


def node_interpolations(root: yaml.Node | None, inside: str = "") -> dict[str, tuple[str, str]]:
    """Key path -> (the key path it takes whole, the value as written) for each string value
    that is one interpolation (`model: ${variables.model}`): a finding beneath `model` is
    about a value written under `variables.model`. Absolute paths start at `inside` (an MCLI
    run config's `parameters.`, resolved as its own document); relative ones (`${.x}`) at the
    key's mapping, one level up per further dot."""
    taken: dict[str, tuple[str, str]] = {}
    for path, _, value in _entries(root) if root is not None else ():
        if not (isinstance(value, yaml.ScalarNode) and value.tag.endswith(":str")
                and path.startswith(inside)):
            continue
        found = _NODE_INTERPOLATION.fullmatch(str(value.value))
        if found is None:
            continue
        dots, name = found.groups()
        base = inside.rstrip(".")
        if dots:
            base = parent_key(path)
            for _ in range(len(dots) - 1):
                base = parent_key(base)
        target = base
        for part in re.sub(r"\[([\w-]+)\]", r".\1", name).split("."):
            target = join_key(target, part)
        taken[path] = (target, str(value.value))
    return taken


def written_at(key: str, positions: Mapping[str, tuple[int, int]],
               taken: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """(the key path whose line holds `key`'s value, a note naming it) when `key` lies beneath
    a key written as one interpolation (`node_interpolations`), following chains of them;
    None when the file writes `key` where it is, or no interpolation leads to it."""
    current, via = key, None
    for _ in range(len(taken)):  # each interpolation once: a cycle does not resolve anyway
        above = None if current in positions else _taken_above(current, positions, taken)
        if above is None:
            break
        head, rest = above
        via = via or f"{head}: {taken[head][1]}"
        current = f"{taken[head][0]}.{rest}" if taken[head][0] else rest
    if via is None:
        return None
    if current in positions:
        return current, f" (written at {current}, through `{via}`)"
    return current, f" (through `{via}`)"


def _taken_above(key: str, positions: Mapping[str, tuple[int, int]],
                 taken: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """(the nearest key above `key` written as one interpolation, the rest of `key` below it);
    None when a key above it is written as a mapping or list first."""
    parts = split_key(key)
    for end in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:end])
        if head in taken:
            return head, ".".join(parts[end:])
        if head in positions:
            return None
    return None


def drop_duplicate_keys(root: yaml.Node | None) -> list[tuple[str, int, int]]:
    """Keep only the last of a key given twice in one mapping, in the node graph, as
    yaml.safe_load (MCLI's reader, mcli/utils/utils_yaml.py load_yaml) does without a word where
    omegaconf refuses the file. (dotted key path, line dropped, line kept) for each copy dropped;
    merge keys (`<<`) are left alone."""
    dropped: list[tuple[str, int, int]] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            last = {_key_text(k): k for k, _ in node.value
                    if k.tag != "tag:yaml.org,2002:merge"}
            kept = []
            for key_node, value in node.value:
                keep = last.get(_key_text(key_node), key_node)
                if keep is not key_node and key_node.tag != "tag:yaml.org,2002:merge":
                    dropped.append((join_key(prefix, _key_text(key_node)),
                                    key_node.start_mark.line + 1, keep.start_mark.line + 1))
                    continue
                kept.append((key_node, value))
            node.value = kept
            # in document order (a stack), so an anchored mapping is named where it is written
            stack += [(v, join_key(prefix, _key_text(k))) for k, v in reversed(kept)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, join_key(prefix, i)) for i, item in reversed(list(enumerate(
                node.value)))]
    return sorted(dropped, key=lambda d: d[1])


def _path_of(root: yaml.Node, node: yaml.Node) -> str:
    """The dotted key path of a key or value node in the document ('' for the root)."""
    return next((path for path, key_node, value in _entries(root)
                 if node is key_node or node is value), "")


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


def _yaml_error(path: Path, error: yaml.YAMLError, text: str,
                verdict: str = OMEGACONF.verdict) -> NotParsed:
    mark = getattr(error, "problem_mark", None)
    if mark is not None and 0 <= mark.index < len(text) and text[mark.index] == "\t" \
            and isinstance(error, yaml.scanner.ScannerError):
        where = "in YAML indentation" if not text[mark.index - mark.column:mark.index].strip() \
            else "between YAML tokens, outside quotes"
        return NotParsed(f"{path}:{mark.line + 1}:{mark.column + 1}: {verdict}: a tab "
                              f"is not allowed {where} (use spaces)")
    if isinstance(error, yaml.reader.ReaderError):  # no mark; libyaml's position is in bytes
        bad = yaml.reader.Reader.NON_PRINTABLE.search(text)
        if bad is not None:
            line = text.count("\n", 0, bad.start()) + 1
            column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
            return NotParsed(f"{path}:{line}:{column}: {verdict}: character "
                                  f"{ord(bad.group()):#06x}: {error.reason}")
    where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    alias = _ALIAS.match(text, mark.index) if mark and problem.startswith(_UNDEFINED) else None
    if alias:
        problem = _undefined_alias(text, mark, alias.group(1))
    elif getattr(error, "context", None) == _ONE_DOCUMENT:
        problem = (f"{_ONE_DOCUMENT}, but a second document (after `---`) starts here: "
                   "omegaconf, LLM-Foundry's reader, and yaml.safe_load, MCLI's and "
                   "Accelerate's, read one document per file; put each config in its own file")
    return NotParsed(f"{path}{where}: {verdict}: {problem}")


#: PyYAML's and libyaml's context for a file of several documents.
_ONE_DOCUMENT = "expected a single document in the stream"


#: libyaml's words for an alias with no anchor before it (PyYAML's own add the name).
_UNDEFINED = "found undefined alias"
_ALIAS = re.compile(r"\*([^\s,\[\]{}]+)")
_LINE_KEY = re.compile(r"\s*(?:-\s+)?([^\s:#'\"][^:#]*?)\s*:(?:\s|$)")


def _undefined_alias(text: str, mark: yaml.Mark, name: str) -> str:
    """An undefined alias named, with its key and where its anchor is: zoo files meet this when
    a `<<: *base` names an anchor of another file (anchors do not cross files or documents) or
    one written further down (YAML reads an anchor before its aliases)."""
    line = text[mark.index - mark.column:].split("\n", 1)[0]
    key = _LINE_KEY.match(line)
    later = re.search(rf"&{re.escape(name)}(?=[\s,\]}}]|$)", text[mark.index:])
    where = (f"its anchor &{name} comes later, at line "
             f"{text.count(chr(10), 0, mark.index + later.start()) + 1}: an anchor must come "
             "before its aliases") if later else \
        f"no &{name} anchor before it in this file (anchors do not reach across files)"
    at = "" if not key else " in a merge key (<<)" if key.group(1) == "<<" else \
        f" at key {key.group(1)}"
    return f"{_UNDEFINED} *{name}{at}: {where}"


def cannot_read(path: Path | str, error: OSError) -> LintInputError:
    """The one line for a path the OS will not let us read, or even look at."""
    return LintInputError(f"{path}: cannot read: {error.strerror or error}")


def read_text(path: Path) -> str:
    """The text of a regular file of at most MAX_BYTES; LintInputError (one line) otherwise. A
    FIFO, a device (/dev/zero) or a socket is refused before it is opened: reading one could
    block forever or never end. The file is opened and read without blocking (`O_NONBLOCK`): a
    "regular" file whose read would wait (/proc/kmsg, size 0) is refused, not waited on."""
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise LintInputError(f"{path}: is a folder")
        if not stat.S_ISREG(info.st_mode):
            raise LintInputError(f"{path}: not a regular file (a FIFO, device or socket); "
                                 "refusing to read it")
        if info.st_size > MAX_BYTES:
            raise LintInputError(f"{path}: {info.st_size} bytes, more than the {MAX_BYTES} a "
                                 "config can sensibly be; refusing to read it")
        data = _read_bounded(path)
    except OSError as e:
        raise cannot_read(path, e) from None
    return _decoded(path, data)


def read_stdin(name: Path) -> str:
    """The text piped to standard input (`foundry-fp8 lint -`), named `name` in messages, within
    read_text's bounds. A terminal is refused: the linter would sit waiting for typed input."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        raise LintInputError(f"{name}: standard input is closed; pipe a config in")
    try:
        if stream.isatty():
            raise LintInputError(f"{name}: standard input is a terminal; pipe a config in "
                                 "(`cat train.yaml | foundry-fp8 lint -`) or name the file")
        data = stream.read(MAX_BYTES + 1)
    except OSError as e:
        raise cannot_read(name, e) from None
    return _decoded(name, data)


def _decoded(path: Path, data: bytes) -> str:
    """`data` (at most MAX_BYTES + 1 bytes read) as UTF-8 text; LintInputError otherwise."""
    if len(data) > MAX_BYTES:
        raise LintInputError(f"{path}: more than {MAX_BYTES} bytes; refusing to read it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, column = _line_column(data, e.start)
        raise LintInputError(f"{path}:{line}:{column}: cannot read: not UTF-8 text (byte "
                             f"0x{data[e.start]:02x})") from None


def _read_bounded(path: Path) -> bytes:
    """At most MAX_BYTES + 1 bytes of a regular file, never waiting for data: opened with
    O_NONBLOCK (a FIFO swapped in after the stat neither blocks the open nor is read: it is
    refused by its fstat), read until end of file; a read that would block is refused."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LintInputError(f"{path}: not a regular file (a FIFO, device or socket); "
                                 "refusing to read it")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_BYTES:
            try:
                chunk = os.read(fd, MAX_BYTES + 1 - size)
            except BlockingIOError:
                raise LintInputError(f"{path}: cannot read without blocking (a special file "
                                     "such as /proc/kmsg, not a config); refusing to wait for "
                                     "it") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _line_column(data: bytes, index: int) -> tuple[int, int]:
    """1-based (line, column) of byte `index`, the column in characters of the line's text
    before it (bytes that do not decode count one each)."""
    start = data.rfind(b"\n", 0, index) + 1
    return (data.count(b"\n", 0, index) + 1,
            len(data[start:index].decode("utf-8", errors="replace")) + 1)


def _too_deep(path: Path, mark: yaml.Mark, keys: list[str], aliases: bool = False) -> str:
    """The one line for nesting past MAX_DEPTH: where the level past it opens, and the key path
    leading there (shortened in the middle)."""
    followed = ", once its aliases are followed" if aliases else ""
    return (f"{path}:{mark.line + 1}:{mark.column + 1}: nested more than {MAX_DEPTH} levels deep "
            f"at `{_shown(keys)}`{followed}; refusing to load it ({_DEPTH_WHY})")


def _shown(keys: list[str]) -> str:
    """A key path as a message shows it: dotted, shortened in the middle past six parts."""
    return ".".join(keys) if len(keys) <= 6 else f"{'.'.join(keys[:3])}...{'.'.join(keys[-2:])}"


def _check_depth(path: Path, text: str, loader: type) -> None:
    """Refuse nesting deeper than MAX_DEPTH, or more than MAX_EXPANDED_NODES values as written,
    found from YAML's parse events (a loop, no recursion) before anything composes the
    document recursively: a file past the bound is read only up to the value past it."""
    # per open collection: [key (or index) of the child being read, is a mapping, next is a key]
    open_: list[list[Any]] = []
    values = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.NodeEvent) and open_:
            parent = open_[-1]
            if not parent[1]:
                parent[0] += 1
            elif parent[2]:
                parent[0] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            parent[2] = parent[1] and not parent[2]
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            values += 1
            if values > MAX_EXPANDED_NODES:
                mark = event.start_mark
                raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: more than "
                                     f"{MAX_EXPANDED_NODES} values by this line, at "
                                     f"`{_shown([str(p[0]) for p in open_])}` (a config holds "
                                     "a few hundred); refusing to load it")
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_) >= MAX_DEPTH:
                raise LintInputError(_too_deep(path, event.start_mark,
                                               [str(p[0]) for p in open_]))
            mapping = isinstance(event, yaml.MappingStartEvent)
            open_.append([None if mapping else -1, mapping, mapping])
        elif isinstance(event, yaml.CollectionEndEvent):
            open_.pop()


def _check_interpolations(path: Path, text: str) -> None:
    """Refuse more than MAX_INTERPOLATIONS interpolations, at the line of the one past it."""
    if text.count("${") <= MAX_INTERPOLATIONS:
        return
    index = -1
    for _ in range(MAX_INTERPOLATIONS + 1):
        index = text.index("${", index + 1)
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    raise LintInputError(f"{path}:{line}:{column}: more than {MAX_INTERPOLATIONS} "
                         "interpolations (`${`) by this point (a config holds a few dozen); "
                         "refusing to resolve them")


def _int_too_long(value: str) -> str | None:
    """Why the int PyYAML's constructor makes of `value` (yaml/constructor.py
    construct_yaml_int: sign and `_` dropped; 0b, 0x and a leading 0 read in base 2, 16, 8; a
    sexagesimal `1:30` part by part) cannot be linted: a decimal string of more digits than
    Python's int() reads, which omegaconf's load refuses too; or a value of more than
    MAX_INT_DIGITS digits, which LLM-Foundry's loader reads but no config needs, and which the
    rules' arithmetic (d_model x expansion_ratio, tokens per micro-batch) would take past what
    Python writes as text. None when neither."""
    digits = value.replace("_", "").lstrip("+-")
    decimal = not digits.startswith(("0b", "0x", "0"))
    longest = max(len(part) for part in digits.split(":")) if decimal else 0
    if longest > _PYTHON_INT_DIGITS:
        return (f"an integer of {longest} digits; Python reads at most {_PYTHON_INT_DIGITS} "
                "(quote it if it is a string)")
    if decimal:
        large = longest > MAX_INT_DIGITS
    else:
        base = 2 if digits.startswith("0b") else 16 if digits.startswith("0x") else 8
        try:
            large = int(digits if base == 8 else digits[2:], base) >= 10 ** MAX_INT_DIGITS
        except ValueError:  # not an int after all (`!!int 0x`): the constructor names it
            return None
    return (f"an integer of more than {MAX_INT_DIGITS} digits, which no config needs; refusing "
            "to load it (the linter's bound; YAML's and JSON's readers take it)") if large else None


def _interpolation_depth(text: str) -> int:
    depth = deepest = 0
    for brace in _INTERPOLATION_BRACES.finditer(text):
        depth = max(depth - 1, 0) if brace.group() == "}" else depth + 1
        deepest = max(deepest, depth)
    return deepest


def _check_scalar(path: Path, node: yaml.ScalarNode) -> None:
    """Refuse, at its line, an integer too long for Python to read."""
    too_long = _int_too_long(str(node.value)) if node.tag.endswith(":int") else None
    if too_long:
        mark = node.start_mark
        raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: {too_long}")


def check_interpolations(path: Path, text: str, root: yaml.Node) -> None:
    """Refuse more than MAX_INTERPOLATIONS interpolations in `text`, or a value of `root` with
    interpolations nested deeper than MAX_DEPTH (omegaconf's parser recurses on them for
    seconds, then fails): bounds on what omegaconf resolves, so checked before it reads `text`
    (Accelerate and DeepSpeed never resolve `${...}`: a `${` is text there)."""
    _check_interpolations(path, text)
    seen: set[int] = set()
    stack = [root]
    while stack:  # each distinct node once (the bounds of `compose` hold: no recursion needed)
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        value = node.value if isinstance(node, yaml.ScalarNode) else ""
        if "${" in value and _interpolation_depth(value) > MAX_DEPTH:
            mark = node.start_mark
            raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: interpolations "
                                 f"nested more than {MAX_DEPTH} levels deep; refusing to load it")
        stack += reversed(_children(node))


#: An innermost interpolation (an escaped `\${` is text), and one that names a key (`${a.b}`,
#: `${..a}`, `${a[0]}`) rather than a resolver's call (`${oc.env:X}`).
_INNERMOST = re.compile(r"(?<!\\)\$\{([^${}]*)\}")
_REFERENCE = re.compile(r"\s*(\.*)([\w-]+(?:\.[\w-]+|\[[\w-]+\])*)\s*")
_ABSENT = object()


def _at(tree: Any, key: tuple[str, ...]) -> Any:
    """The value at `key` in a plain (unresolved) container, _ABSENT where there is none."""
    for part in key:
        if isinstance(tree, Mapping):
            tree = tree.get(part, tree.get(int(part), _ABSENT) if part.isdigit() else _ABSENT)
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return _ABSENT
    return tree


def _references(key: tuple[str, ...], value: str) -> list[tuple[str, ...]]:
    """The keys `value`'s innermost interpolations name, one per occurrence; relative ones
    (`${.x}`) from the key's container, one level up per further dot."""
    found = []
    for body in _INNERMOST.findall(value):
        match = _REFERENCE.fullmatch(body)
        if match is None:  # a resolver's call: what it returns is not read here
            continue
        dots, name = match.groups()
        base = key[:-1] if dots else ()
        base = base[:len(base) - len(dots) + 1] if len(dots) > 1 else base
        found.append(base + tuple(re.sub(r"\[([\w-]+)\]", r".\1", name).split(".")))
    return found


def _dependencies(key: tuple[str, ...], value: Any) -> list[tuple[str, ...]]:
    if isinstance(value, Mapping):
        return [(*key, str(k)) for k in value]
    if isinstance(value, list):
        return [(*key, str(i)) for i in range(len(value))]
    return _references(key, value) if isinstance(value, str) else []


def _resolved_size(key: tuple[str, ...], value: Any,
                   sizes: Mapping[tuple[str, ...], tuple[int, int]]) -> tuple[int, int]:
    """(values, characters) `value` resolves to, from its dependencies' (a cycle's: none)."""
    parts = [sizes.get(d, (0, 0)) for d in _dependencies(key, value)]
    if isinstance(value, (Mapping, list)):
        return 1 + sum(v for v, _ in parts), 2 + sum(c + 2 for _, c in parts)
    if not isinstance(value, str) or not parts:
        return 1, len(str(value))
    if _REFERENCE.fullmatch(value[2:-1]) and _INNERMOST.fullmatch(value):
        return parts[0]  # the key's node whole, a mapping or list included
    return 1, len(_INNERMOST.sub("", value)) + sum(c for _, c in parts)


def check_resolved_size(path: Path, tree: Any, positions: Mapping[str, tuple[int, int]],
                        inside: str = "") -> None:
    """Refuse interpolations that resolve to more than MAX_EXPANDED_NODES values or
    MAX_RESOLVED_CHARS characters of text (`l1: [${l0}, ${l0}]`, `s1: ${s0}${s0}`,
    doubling at each line): omegaconf resolves every reference anew, so a few hundred bytes
    took minutes and gigabytes. Sizes are counted on `tree`, the unresolved plain container,
    each key once and without recursion (chains of thousands of interpolations resolve);
    refused at the line of the first value past a bound."""
    sizes: dict[tuple[str, ...], tuple[int, int]] = {}
    started: set[tuple[str, ...]] = set()
    stack: list[tuple[tuple[str, ...], bool]] = [((), False)]
    while stack:
        key, done = stack.pop()
        if key in sizes or (not done and key in started):
            continue
        value = _at(tree, key)
        if value is _ABSENT:
            sizes[key] = (1, 0)
            continue
        if not done:
            started.add(key)
            stack.append((key, True))
            stack += [(d, False) for d in _dependencies(key, value)
                      if d not in sizes and d not in started]
            continue
        started.discard(key)
        sizes[key] = values, chars = _resolved_size(key, value, sizes)
        if values > MAX_EXPANDED_NODES or chars > MAX_RESOLVED_CHARS:
            dotted = inside.rstrip(".")
            for part in key:
                dotted = join_key(dotted, part)
            line, column = position_of(dotted, positions) or (1, 1)
            past = (f"more than {MAX_EXPANDED_NODES} values" if values > MAX_EXPANDED_NODES
                    else f"a text of more than {MAX_RESOLVED_CHARS} characters")
            raise LintInputError(f"{path}:{line}:{column}: the interpolations in "
                                 f"`{dotted or '<root>'}` resolve to {past} (an interpolation "
                                 "bomb?); refusing to resolve it")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _deepest(root: yaml.Node, heights: dict[int, int]) -> tuple[yaml.Node, list[str]]:
    """The collection MAX_DEPTH + 1 levels down the tallest path (aliases followed), and the
    keys leading to it."""
    node, keys = root, []
    for _ in range(MAX_DEPTH):
        steps = ([(_key_text(k), v) for k, v in node.value] + [("?", k) for k, _ in node.value]
                 if isinstance(node, yaml.MappingNode) else list(enumerate(node.value)))
        key, node = max(steps, key=lambda step: heights[id(step[1])])
        keys.append(str(key))
    return node, keys


def _check_expansion(path: Path, root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it to more than MAX_EXPANDED_NODES values, or
    nest it deeper than MAX_DEPTH (sizes and heights counted once per distinct node, in one
    iterative walk, so counting stays linear), or that holds a scalar `_check_scalar`
    refuses."""
    sizes: dict[int, int] = {}
    heights: dict[int, int] = {}  # collections nested in a node, aliases followed
    expanding: set[int] = set()  # the collections whose children are being counted: ancestors
    # per open collection: [node, its children, index of the next child]
    open_: list[list[Any]] = []

    def enter(node: yaml.Node) -> None:
        if isinstance(node, yaml.ScalarNode):
            _check_scalar(path, node)
            sizes[id(node)], heights[id(node)] = 1, 0
            return
        children = _children(node)
        expanding.add(id(node))
        looped = next((c for c in children if id(c) in expanding), None)
        if looped is not None:
            mark = looped.start_mark  # the anchor: an alias inside its value names it again
            raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: an alias refers to "
                                 "a value that contains it (a recursive alias, infinite when "
                                 "expanded); refusing to load it")
        open_.append([node, children, 0])

    enter(root)
    while open_:
        top = open_[-1]
        node, children, index = top
        if index < len(children):
            top[2] = index + 1
            if id(children[index]) not in sizes:  # an alias to a value counted already
                enter(children[index])
            continue
        open_.pop()
        expanding.discard(id(node))
        size = sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
        heights[id(node)] = 1 + max((heights[id(c)] for c in children), default=0)
        if size > MAX_EXPANDED_NODES:  # the text is within it (_check_depth): aliases repeat
            mark = node.start_mark
            raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: the aliases in "
                                 f"this value expand to more than {MAX_EXPANDED_NODES} "
                                 "values (an alias bomb?); refusing to load it")
    if heights[id(root)] > MAX_DEPTH:  # the text is within it (_check_depth): aliases nest
        node, keys = _deepest(root, heights)
        raise LintInputError(_too_deep(path, node.start_mark, keys, aliases=True))


def compose(path: Path, text: str, reader: Reader = OMEGACONF) -> yaml.Node | None:
    """The YAML document's node graph as `reader` (omegaconf's unless told) composes it, within
    the bounds above, with keys omegaconf can load; yaml.YAMLError as PyYAML raises it,
    LintInputError past a bound or for such a key."""
    _check_depth(path, text, reader.loader)
    root = yaml.compose(text, Loader=reader.loader)
    if root is not None:
        _check_expansion(path, root)
        bad_key = _key_problem(root)
        if bad_key:
            mark = bad_key[0].start_mark
            raise LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: cannot load: the key "
                                 f"{bad_key[1]}")
    return root


@dataclass(frozen=True)
class Document:
    """A YAML file composed once within the bounds above: its node graph as composed (key
    positions are read from it) and its values (`read_yaml`)."""

    root: yaml.Node | None
    data: Any


def read_yaml(path: Path, text: str, reader: Reader) -> Document:
    """The YAML document as plain Python values as `reader` reads it, within the bounds above;
    and its node graph, for `load_config` and `key_positions` without composing the text again.
    LintInputError (one line) when it cannot be read so: NotParsed when the reader refuses its
    syntax, a value the constructor refuses at its own line, column and key."""
    try:
        root = compose(path, text, reader)
        # PyYAML's constructor rewrites the mappings that hold merge keys (flatten_mapping): it
        # works on a copy, so `root` keeps each key where the file writes it
        built = root if root is None or "<<" not in text else copy.deepcopy(root)
        data = None if built is None else _Constructor().construct_object(built, deep=True)
    except _Unconstructed as e:
        raise _unconstructed(path, built, e.node, e.error) from None
    except yaml.YAMLError as e:
        raise _yaml_error(path, e, text, reader.verdict) from None
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        raise LintInputError(f"{path}: cannot load: {first_line(e)}") from None
    return Document(root, data)


def _unconstructed(path: Path, root: yaml.Node, node: yaml.Node,
                   error: Exception) -> LintInputError:
    """The one line for a node PyYAML's constructor refuses: where its error marks it (a
    mapping's merge value), else where the node starts, with the node's key path."""
    mark = getattr(error, "problem_mark", None) or node.start_mark
    key = _path_of(root, node)
    if isinstance(error, yaml.MarkedYAMLError):
        why = error.problem or first_line(error)
    else:
        kind = str(node.tag).rpartition(":")[2]
        why = (f"PyYAML cannot read {str(node.value)[:60]!r} as !!{kind} "
               f"({type(error).__name__}: {first_line(error)})")
    return LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: cannot load"
                          f"{f' key {key}' if key else ''}: {why}")


def load_config(path: Path, text: str | None = None, subtree: str | None = None,
                document: Document | None = None,
                overrides: Overrides | None = None) -> LoadedConfig:
    """The resolved config with key positions; LintInputError (one line) when we cannot.
    `subtree`: resolve only this top-level section, as its own document (an MCLI run config's
    `parameters`, which MCLI hands to the train script as the whole config); positions and
    `${oc.env:...}` keys stay relative to the file. `document`: `text` as `read_yaml` read it
    already (MCLI's reader for a run config). `overrides`: the command line's `KEY=VALUE`s, merged into the
    loaded (unresolved) config as `train_from_yaml` merges `om.from_cli(args_list)`."""
    from omegaconf import OmegaConf

    text = read_text(path) if text is None else text
    try:
        root = compose(path, text, OMEGACONF) if document is None else document.root
    except yaml.YAMLError as e:
        raise _yaml_error(path, e, text) from None
    if root is None:  # LLM-Foundry's train_from_yaml cannot train from it either
        raise LintInputError(f"{path}: a train config must be a mapping; the file has no YAML "
                             "content (empty, or only comments)")
    if not isinstance(root, yaml.MappingNode):
        raise LintInputError(f"{path}:{root.start_mark.line + 1}: a train config must be a "
                             "mapping")
    check_interpolations(path, text, root)
    failures = omegaconf_failures()
    positions, env_values = key_positions(root)  # recursive: compose bounds its depth
    inside = f"{subtree}." if subtree is not None else ""
    with warnings.catch_warnings():  # omegaconf's own (oc.deprecated's) are not our output
        warnings.simplefilter("ignore")
        try:
            raw = OmegaConf.create(text)
        except yaml.YAMLError as e:  # the YAML composed above: one of omegaconf's own limits
            raise _omegaconf_yaml_error(path, e, text, root) from None
        except failures as e:
            raise _omegaconf_error(path, e, positions, "", "cannot load") from None
        try:
            if subtree is not None:
                raw = OmegaConf.create(OmegaConf.to_container(raw[subtree], resolve=False))
        except failures as e:
            raise _omegaconf_error(path, e, positions, inside, "cannot load") from None
        if overrides is not None:
            try:
                raw = OmegaConf.merge(raw, overrides.config)
            except failures as e:
                raise overrides.error(path, raw, e, positions, inside) from None
            # a value an override replaced is not the file's: its `${oc.env:...}` is gone, and
            # an override's own is the override's
            env_values = [(k, v) for k, v in env_values if overrides.item_for(k[len(inside):])
                          is None]
            env_values += [(inside + k, v) for k, v in overrides.env_values]
        env_keys = []
        for key, value in env_values:
            if not key.startswith(inside):
                continue
            key = key[len(inside):]
            if _set_at(raw, key, _escaped(value)):
                env_keys.append(key)
        try:
            check_resolved_size(path, OmegaConf.to_container(raw, resolve=False), positions,
                                inside)
        except LintInputError as error:
            raise _by_override(error, path, text, subtree, document, overrides) from None
        try:
            config = OmegaConf.to_container(raw, resolve=True)
        except failures as e:
            error = _omegaconf_error(path, e, positions, inside, "cannot resolve")
            error = LintInputError(f"{error}{_under_variables(raw, e)}")
            raise _by_override(error, path, text, subtree, document, overrides) from None
        if _holds_interpolation(config):  # text such as an escaped `\${x}` resolves to
            try:
                check_resolved_size(path, config, positions, inside)
            except LintInputError as error:
                raise _by_override(error, path, text, subtree, document, overrides) from None
            try:
                config = _resolved_again(config, env_values, inside)
            except failures as e:
                error = _omegaconf_error(path, e, positions, inside, "cannot resolve")
                error = LintInputError(f"{error}{_AGAIN}")
                raise _by_override(error, path, text, subtree, document, overrides) from None
    names = read_names(text + (overrides.text if overrides else ""))
    return LoadedConfig(config, positions, tuple(env_keys), names,
                        node_interpolations(root, inside))


def _under_variables(raw: Any, error: BaseException) -> str:
    """What to add when an absolute `${name}` finds nothing but `variables:` holds `name`: the
    form LLM-Foundry's configs took before `variables:` (0.8), which its loader refuses alike
    (make_dataclass_and_log_config resolves the whole config with omegaconf first)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationKeyError

    found = re.fullmatch(r"Interpolation key '([^']+)' not found", first_line(error))
    if not isinstance(error, InterpolationKeyError) or found is None:
        return ""
    name = found.group(1)
    absent = object()
    try:
        value = OmegaConf.select(raw, f"variables.{name}", default=absent,
                                 throw_on_resolution_failure=False)
    except omegaconf_failures():
        return ""
    if value is absent:
        return ""
    return (f" (LLM-Foundry's loader raises the same: `{name}` is under `variables:`, so read "
            f"it as `${{variables.{name}}}`)")


def read_names(text: str) -> frozenset[str]:
    """The top-level names the text's absolute interpolations read (`${name}`, `${name.key}`)."""
    return frozenset(_READ_NAME.findall(text))


def omegaconf_failures() -> tuple[type[BaseException], ...]:
    """What omegaconf raises for input it refuses (loading, merging, resolving), as opposed to
    our own bug, which lint/cli.py reports as one. Its key and index errors are
    OmegaConfBaseException (ConfigKeyError, ConfigIndexError: errors.py); resolving wraps any
    other, RecursionError too, in InterpolationResolutionError (base.py:1027); a file's
    nesting is bounded before it loads (MAX_DEPTH)."""
    from omegaconf.errors import OmegaConfBaseException

    return (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError, MemoryError)


def _dotted_key_failures() -> tuple[type[BaseException], ...]:
    """What omegaconf raises for a dotted key it refuses (`OmegaConf.update`, and
    `from_dotlist`, which calls it): also a plain IndexError for a key that opens a `[` it
    never closes (`[`, `[x`: omegaconf.py:1429 `split[-1]` of an empty split)."""
    return (*omegaconf_failures(), IndexError)


def _set_at(config: Any, key: str, value: str) -> bool:
    """Set the value at `key` (a `join_key` path) part by part; False when `config` has no such
    key. Not OmegaConf.update, which splits a key by its own grammar: `"a["` wrote `a`,
    `"m.x"` added a key `"m`, and `[` raised IndexError (omegaconf.py:1429)."""
    import json

    from omegaconf import ListConfig

    parts = split_key(key)
    node = config
    try:
        for i, part in enumerate(parts):
            name = json.loads(part) if part.startswith('"') else part
            name = int(name) if isinstance(node, ListConfig) else name
            if i == len(parts) - 1:
                if not isinstance(node, ListConfig) and name not in node:
                    return False
                node[name] = value
            else:
                node = node[name]
    except (*omegaconf_failures(), KeyError, IndexError):
        return False
    return True


def _by_override(error: LintInputError, path: Path, text: str, subtree: str | None,
                 document: Document | None, overrides: Overrides | None) -> LintInputError:
    """A resolution error the file alone does not have names the override that causes it
    (the first that does alone, else all of them): `--override variables=null` leaves
    `${variables.max_seq_len}` nothing to resolve, and the error names only that key."""
    if overrides is None:
        return error

    def fails(one: Overrides | None) -> bool:
        try:
            load_config(path, text, subtree, document, one)
        except LintInputError:
            return True
        return False

    if fails(None):
        return error
    # each tried alone (items and each too: with all of them, its failing load would search
    # again, and again, until Python's recursion limit); a lone item needs no search
    item = overrides.items[0] if len(overrides.items) == 1 else next(
        (name for name, config in zip(overrides.items, overrides.each, strict=True)
         if fails(replace(overrides, config=config, items=(name,), each=(config,)))),
        ", ".join(overrides.items))
    return LintInputError(f"{error} (caused by {item}: the file alone resolves)")


@dataclass(frozen=True)
class Overrides:
    """Command-line `KEY=VALUE` overrides as `llmfoundry train cfg.yaml KEY=VALUE...` (and
    `composer train.py`, and eval) take them: `om.from_cli(args_list)` merged with
    `om.merge(yaml_cfg, cli_cfg)` (llmfoundry/command_utils/train.py train_from_yaml, eval.py
    eval_from_yaml). `keys`: each dotted key (`join_key`) they set, with the item that set it
    as messages name it (`--override KEY=VALUE`, or the MCLI `command:`'s); `whole`: those
    whose value replaces all the file holds beneath (not a mapping, which omegaconf merges key
    by key)."""

    items: tuple[str, ...]  # as messages name them
    config: Any  # the DictConfig om.from_cli builds
    keys: Mapping[str, str]
    whole: frozenset[str]
    env_values: tuple[tuple[str, str], ...]
    text: str

    def item_for(self, key: str, in_file: bool = True) -> str | None:
        """The override that sets `key`'s value, if one does (then no line of the file holds
        it); None when the file's value stands. `in_file` False: the file does not write
        `key`, so one that sets a key beneath it (`a.b.c=1` for `a`) made it."""
        if key in self.keys:
            return self.keys[key]
        parent = parent_key(key)
        while parent:
            if parent in self.whole:
                return self.keys[parent]
            parent = parent_key(parent)
        if not in_file:
            return next((item for k, item in self.keys.items() if k.startswith(f"{key}.")), None)
        return None

    def error(self, path: Path, raw: Any, error: BaseException,
              positions: Mapping[str, tuple[int, int]], inside: str) -> LintInputError:
        """omegaconf's refusal to merge them into `path`'s config (`raw`), at the line of the
        file's key the first item that omegaconf refuses alone would replace."""
        from omegaconf import OmegaConf

        item, key = ", ".join(self.items), ""
        for one, config in zip(self.items, self.each, strict=True):
            try:
                OmegaConf.merge(raw, config)
            except Exception:  # whatever omegaconf raises: this item is the one
                item, key = one, next((k for k, i in self.keys.items() if i == one), "")
                break
        at = position_of(inside + key, positions) if key else None
        return LintInputError(f"{path}{f':{at[0]}' if at else ''}: {item}: cannot merge it into "
                              f"this config: {first_line(error)}")

    each: tuple[Any, ...] = ()  # each item's own from_dotlist config


#: How a command's overrides are named, and where a run config writes them.
COMMAND_OVERRIDE = "`command:`'s {}"


def read_overrides(items: list[str], command: list[str] | None = None) -> Overrides:
    """`items` (`--override`'s) after `command` (those an MCLI run config's command line gives
    the train script) read by omegaconf's own `from_dotlist` (what `om.from_cli` calls), all at
    once as the train script does; LintInputError (one line naming the item) for one it refuses,
    or an `--override` without `=`, which is far likelier a config path given after `--override`
    than a key set to null (as from_dotlist reads it, and reads the command's)."""
    from omegaconf import OmegaConf

    # from_dotlist's grammar parser recurses on a value's nesting (`a=[[[...]]]`), unbounded
    failures = (*_dotted_key_failures(), RecursionError)
    command = command or []
    named = [COMMAND_OVERRIDE.format(i) for i in command] + [f"--override {i}" for i in items]
    keys: dict[str, str] = {}
    each = []
    for item, name in zip(command + items, named, strict=True):
        if name.startswith("--") and ("=" not in item or item.startswith("=")):
            raise LintInputError(f"--override {item!r}: not KEY=VALUE " + (
                f"(omegaconf's from_cli has no Hydra `~KEY` deletion: it sets `{item}` to null,"
                f" under a top-level key `{item.split('.')[0]}` that LLM-Foundry refuses)"
                if item.startswith("~") else "(name the config files before --override)"))
        try:
            each.append(OmegaConf.from_dotlist([item]))
            one = OmegaConf.to_container(each[-1], resolve=False)
        except failures as e:
            raise LintInputError(f"{name}: omegaconf cannot read it: {first_line(e)}") from None
        keys.update((key, name) for key, _ in _leaves(one, ""))
        if any(_large_int(v) for _, v in _leaves(one, "")):
            raise LintInputError(f"{name}: an integer of more than {MAX_INT_DIGITS} digits, which "
                                 "no config needs (the linter's bound)")
    try:
        config = OmegaConf.from_dotlist(command + items)
        merged = OmegaConf.to_container(config, resolve=False)
    except failures as e:
        raise LintInputError(f"{', '.join(named)}: omegaconf cannot read them together: "
                             f"{first_line(e)}") from None
    leaves = dict(_leaves(merged, ""))
    env_values = tuple((k, v) for k, v in leaves.items() if isinstance(v, str) and OC_ENV.search(v))
    return Overrides(tuple(named), config, {k: i for k, i in keys.items() if k in leaves},
                     frozenset(k for k, v in leaves.items() if not isinstance(v, Mapping)),
                     env_values, " ".join(command + items), tuple(each))


def _large_int(value: Any) -> bool:
    """An int past MAX_INT_DIGITS digits, in a value or in its lists and mappings at any depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, Mapping)):
            stack += item.values() if isinstance(item, Mapping) else item
        elif isinstance(item, int) and abs(item) >= 10 ** MAX_INT_DIGITS:
            return True
    return False


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of each value an override writes: scalars, lists and empty
    mappings, which replace the config's; a non-empty mapping merges key by key."""
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _leaves(inner, join_key(prefix, key))
    elif prefix:
        yield prefix, value


#: An interpolation's opening and the backslashes before it: an odd number escapes it.
_BACKSLASHES_OPENING = re.compile(r"(\\*)\$\{")


def _escaped(value: str) -> str:
    """`value` with each interpolation escaped, so it resolves to its text whatever this
    machine's environment holds; one escaped already (`\\${oc.env:X}`) is left: LLM-Foundry
    fails on it too, as `make_dataclass_and_log_config` resolves the text again (om.structured)."""
    return _BACKSLASHES_OPENING.sub(
        lambda m: m.group(1) + ("${" if len(m.group(1)) % 2 else "\\${"), value)


#: Why a value that resolved once fails: LLM-Foundry's second resolution.
_AGAIN = (" (once resolved: LLM-Foundry's make_dataclass_and_log_config resolves every value "
          "a second time, so an escaped \\${...} is resolved then)")


def _holds_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_holds_interpolation(v) for v in value.values())
    return isinstance(value, list) and any(_holds_interpolation(v) for v in value)


def _resolved_again(config: dict[str, Any], env_values: list[tuple[str, str]],
                    inside: str) -> dict[str, Any]:
    """`config` resolved a second time, as LLM-Foundry's make_dataclass_and_log_config
    (llmfoundry/utils/config_utils.py) does: it builds `om.structured` from the resolved dict
    and resolves that, so resolved text holding `${...}` is an interpolation again. The
    `${oc.env:...}` values stay text, as in the first pass."""
    from omegaconf import OmegaConf

    again = OmegaConf.create(config)
    for key, value in env_values:
        if key.startswith(inside):
            _set_at(again, key[len(inside):], _escaped(value))
    return OmegaConf.to_container(again, resolve=True)


#: omegaconf's (2.4) refusal of a document past its node limit, which it marks at the document's
#: start whatever line the limit is passed on.
_OMEGACONF_NODE_LIMIT = re.compile(r"node expansion exceeds the configured limit of (\d+)")


def _omegaconf_yaml_error(path: Path, error: yaml.YAMLError, text: str,
                          root: yaml.Node) -> LintInputError:
    """omegaconf's refusal of YAML we composed: at the value past its node limit (counted as
    omegaconf counts, aliases expanded), or at the file alone for another refusal of the whole
    document (the alias expansion ratio), which omegaconf marks at its first line whatever
    causes it; else where omegaconf marks it (a duplicate key)."""
    verdict = "omegaconf, which LLM-Foundry reads YAML with, refuses it"
    problem = getattr(error, "problem", None) or first_line(error)
    limit = _OMEGACONF_NODE_LIMIT.search(problem)
    if limit is not None:
        mark = _node_past(root, int(limit.group(1))).start_mark
        return LintInputError(f"{path}:{mark.line + 1}:{mark.column + 1}: {verdict} (value "
                              f"{int(limit.group(1)) + 1}, counting aliases expanded, is "
                              f"here): {problem}")
    mark = getattr(error, "problem_mark", None)
    if mark is not None and mark.index == root.start_mark.index \
            and isinstance(error, yaml.constructor.ConstructorError) and error.context is None:
        return LintInputError(f"{path}: {verdict}: {problem}")
    return _yaml_error(path, error, text, verdict)


def _node_past(root: yaml.Node, limit: int) -> yaml.Node:
    """The node at which omegaconf's count of a document's nodes (each node once per path to
    it, a mapping's key before its value: omegaconf/_yaml.py `_expanded_node_count`) passes
    `limit`; the root when it never does."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # each distinct node's expanded size, iteratively (the bounds above hold)
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
            continue
        stack.append((node, True))
        stack += [(c, False) for c in _children(node) if id(c) not in sizes]
    node, counted = root, 0
    while True:
        counted += 1
        if counted > limit:
            return node
        for child in _children(node):
            if counted + sizes[id(child)] > limit:
                node = child
                break
            counted += sizes[id(child)]
        else:
            return root


def _omegaconf_error(path: Path, error: BaseException, positions: dict[str, tuple[int, int]],
                     inside: str, doing: str) -> LintInputError:
    """omegaconf's error at the line of the key it names (its `full_key`, `a[0].b` for our
    `a.0.b`, under the subtree `inside`); line 1 when it names none."""
    key = str(getattr(error, "full_key", None) or "")
    if not key:
        return LintInputError(f"{path}:1: {doing}: {first_line(error)}")
    key = inside + re.sub(r"\[(\d+)\]", r".\1", key)
    line = (position_of(key, positions) or (1,))[0]
    return LintInputError(f"{path}:{line}: {doing} key {key}: {first_line(error)}")


def position_of(key: str, positions: Mapping[str, tuple[int, int]]) -> tuple[int, int] | None:
    """(line, column) of `key`, or of its nearest parent present in the file."""
    while key:
        if key in positions:
            return positions[key]
        key = parent_key(key)
    return None
