"""The YAML options of our own registry entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_lint`,
`jsonl`), read from their classes' `__init__` signatures with `ast`, never by importing them.

LLM-Foundry passes an entry's YAML mapping as keyword arguments to the class its entry point
names, so the signature is the option list. Reading it from the source keeps one copy of each
option (the one the code uses) and keeps linting torch-free.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

#: LLM-Foundry's registries (llmfoundry/registry.py) read entry points in the group
#: "llmfoundry_<registry>"; the YAML section each registry is built from.
ENTRY_POINT_SECTIONS = {
    "llmfoundry_algorithms": "algorithms",
    "llmfoundry_callbacks": "callbacks",
    "llmfoundry_callbacks_with_config": "callbacks",
    "llmfoundry_loggers": "loggers",
}

#: `build_callback` (llmfoundry/utils/builders.py) passes the train config as this keyword to
#: callbacks_with_config and raises if the YAML gives it too.
TRAIN_CONFIG_KWARG = "train_config"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
NO_DEFAULT = object()  # a required option
UNREADABLE = object()  # a default that is not a literal (a module constant, a call)


@dataclass(frozen=True)
class Option:
    """One keyword argument: its name, annotation source text (or None) and default."""

    name: str
    annotation: str | None
    default: Any = NO_DEFAULT


@dataclass(frozen=True)
class Entry:
    """A registry entry of ours: YAML section and name, the class, and its options."""

    section: str
    name: str
    target: str  # "module:Class"
    options: Mapping[str, Option]
    any_options: bool  # `**kwargs` in the signature
    reserved: tuple[str, ...] = ()


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError):
        return UNREADABLE


def signature_options(source: str, class_name: str) -> tuple[dict[str, Option], bool]:
    """Options of `class_name.__init__` in `source`, and whether it takes `**kwargs`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            init = next((f for f in node.body
                         if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None:
                return {}, False
            args = init.args
            positional = args.posonlyargs + args.args
            defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
            pairs = (list(zip(positional, defaults, strict=True))[1:]
                     + list(zip(args.kwonlyargs, args.kw_defaults, strict=True)))
            options = {a.arg: Option(a.arg, ast.unparse(a.annotation) if a.annotation else None,
                                     _literal(d)) for a, d in pairs}
            return options, args.kwarg is not None
    raise LookupError(f"class {class_name} not found")


def _source_file(module: str) -> Path | None:
    """Our module's file, found without importing it (importing would import torch)."""
    parts = module.split(".")
    if parts[0] != "foundry_fp8":
        return None
    path = _PACKAGE_DIR.joinpath(*parts[1:]).with_suffix(".py")
    return path if path.is_file() else None


@functools.cache
def module_constant(module: str, name: str) -> Any:
    """A literal module-level constant of ours (`FAIL_ON = ("error", "never")`), read from the
    module's source so that nothing is imported (our Composer modules import torch)."""
    path = _source_file(module)
    if path is None:
        raise LookupError(f"{module} is not a module of ours")
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)  # type: ignore[union-attr,arg-type]
    raise LookupError(f"no literal constant {name} in {module}")


@functools.cache
def our_entries() -> dict[tuple[str, str], Entry]:
    """(section, name) -> Entry for every entry point of ours that LLM-Foundry would load."""
    entries: dict[tuple[str, str], Entry] = {}
    for group, section in ENTRY_POINT_SECTIONS.items():
        for point in metadata.entry_points(group=group):
            module, _, class_name = point.value.partition(":")
            path = _source_file(module)
            if path is None or not class_name:
                continue
            options, any_options = signature_options(path.read_text(), class_name)
            reserved = ()
            if group == "llmfoundry_callbacks_with_config":
                options.pop(TRAIN_CONFIG_KWARG, None)
                reserved = (TRAIN_CONFIG_KWARG,)
            entries[(section, point.name)] = Entry(section, point.name, point.value, options,
                                                   any_options, reserved)
    return entries


# -- what a YAML value may be, from an annotation --------------------------------------------

Check = Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_NAMED: dict[str, Check] = {
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
    "list": lambda v: isinstance(v, list),
    # YAML gives lists; tuples are what a constructor's own defaults hold
    "tuple": lambda v: isinstance(v, (list, tuple)),
    "Sequence": lambda v: isinstance(v, (list, tuple)),
    "dict": lambda v: isinstance(v, Mapping),
    "Mapping": lambda v: isinstance(v, Mapping),
    # A YAML value is never callable, so only `None` (from an Optional) fits a Callable there.
    "Callable": callable,
}


def _union(checks: list[Check | None]) -> Check | None:
    if any(c is None for c in checks):
        return None  # some member we cannot judge: accept anything
    return lambda v: any(c(v) for c in checks)  # type: ignore[misc]


def _name(node: ast.expr) -> str:
    """`int` for `int`, `Callable` for `typing.Callable`; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def _check_for(node: ast.expr) -> Check | None:
    """A predicate for the YAML values an annotation admits; None when we cannot judge it."""
    if isinstance(node, ast.Constant) and node.value is None:
        return _NAMED["None"]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _check_for(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_check_for(node.left), _check_for(node.right)])
    if isinstance(node, (ast.Name, ast.Attribute)):
        return _NAMED.get(_name(node))
    if isinstance(node, ast.Subscript):
        name = _name(node.value)
        members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if name == "Optional":
            return _union([_check_for(members[0]), _NAMED["None"]])
        if name == "Union":
            return _union([_check_for(m) for m in members])
        if name == "Literal":
            allowed = [m.value for m in members if isinstance(m, ast.Constant)]
            return lambda v: any(v == a and type(v) is type(a) for a in allowed)
        return _NAMED.get(name)
    return None


def _members(node: ast.expr) -> list[ast.expr]:
    """The parts of a union (`A | B`, `Optional[A]`, `Union[A, B]`), or [node]."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left) + _members(node.right)
    if isinstance(node, ast.Subscript) and _name(node.value) in ("Optional", "Union"):
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        parts = [m for part in inner for m in _members(part)]
        return parts + ([ast.Constant(None)] if _name(node.value) == "Optional" else [])
    return [node]


def literal_values(annotation: str | None) -> list[Any] | None:
    """The values a `Literal[...]` annotation admits, None included when it is a union with
    None (`Literal["a", "b"] | None`); None for any other annotation."""
    try:
        parts = _members(ast.parse(annotation or "", mode="eval").body)
    except SyntaxError:
        return None
    values: list[Any] = []
    for part in parts:
        if isinstance(part, ast.Constant) and part.value is None:
            values.append(None)
        elif isinstance(part, ast.Subscript) and _name(part.value) == "Literal":
            members = part.slice.elts if isinstance(part.slice, ast.Tuple) else [part.slice]
            values += [m.value for m in members if isinstance(m, ast.Constant)]
        else:
            return None
    return values if any(v is not None for v in values) else None


def accepts(annotation: str | None, value: Any) -> bool:
    """Whether a YAML value fits an annotation's source text (True when we cannot tell)."""
    if annotation is None:
        return True
    try:
        check = _check_for(ast.parse(annotation, mode="eval").body)
    except SyntaxError:
        return True
    return check is None or check(value)
