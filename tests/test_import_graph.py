"""The package's import directions (issue 15), read with `ast` from our own sources: every import
statement counts, lazy ones inside functions too.

- No cycle between modules, nor between our subpackages (`lint/`, `te/`, ...) and modules.
- The training runtime never reaches the linter, the report, the doctor, the CLI or the
  benchmark tool, directly or through another module.
- TransformerEngine is imported only under `foundry_fp8/te/`, and only there are TE's module
  internals read (`TE_ONLY_ATTRIBUTES`: as `x.name` or `getattr`/`hasattr`/`setattr(x, "name")`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "foundry_fp8"

#: The training runtime: what a run imports (the fp8_lint callback, `composer.lint`, is the
#: linter's own entry and may import it).
RUNTIME = ("swap", "blocks", "emulate", "monitor", "numerics", "recipe", "options", "filters", "fp8_meta", "guard",
           "shapes", "jsonl", "attention", "sdpa_facts", "paths", "restore", "plain_state", "health", "te",
           "composer")
RUNTIME_EXCEPT = ("composer.lint",)
#: What the runtime must never import.
TOOLS = ("lint", "report", "doctor", "cli", "environment", "tools")

#: TE modules' own attributes and methods (TE 1.12-2.20 pytorch/module/base.py,
#: `TransformerEngineBaseModule`; pytorch/fp8.py, quantization.py): read or called only under
#: `te/`. Not here: the names our EmulatedFP8Linear shares on purpose, the delayed-scaling state
#: layout (`fp8_meta` with `scaling_fwd`/`scaling_bwd`, `scale`, `amax_history`) that
#: `fp8_meta.py` reads for both backends; `test_te_only_attributes_spare_the_emulated_backend`.
TE_ONLY_ATTRIBUTES = frozenset({
    "init_fp8_metadata", "fp8", "fp8_initialized", "fp8_calibration", "fp8_parameters",
    "fp8_meta_tensors_initialized", "init_fp8_meta_tensors", "set_meta_tensor",
    "get_fp8_meta_tensors", "reset_fp8_meta_tensors", "adjust_amax_history_length",
    "prepare_forward", "primary_weights_in_fp8", "FP8GlobalStateManager", "get_fp8_recipe",
})

#: Violations another engineer is removing this session, each with who and why; the lead
#: shrinks this at the end (an entry no longer violated fails, so it cannot go stale).
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(module: str) -> Iterator[str]:
    """The modules `module` imports (ours resolved to a module where one exists)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in MODULES else base


GRAPH = {m: sorted({t for t in _imports(m) if t in MODULES and t != m}) for m in MODULES}

_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def te_attributes_read(source: str) -> set[str]:
    """The `TE_ONLY_ATTRIBUTES` that `source` reads, calls or sets on an object."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTRIBUTE_CALLS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.add(node.args[1].value)
    return found & TE_ONLY_ATTRIBUTES


def _unit(module: str) -> str:
    """The package-level unit a module belongs to: `foundry_fp8.lint` for `lint/rules.py`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == f"foundry_fp8.{n}" or module.startswith(f"foundry_fp8.{n}.")
               for n in names)


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_to_tools(start: str) -> list[str] | None:
    """The shortest import chain from `start` to a tool module, if any."""
    seen, queue = {start}, [[start]]
    while queue:
        path = queue.pop(0)
        for nxt in GRAPH[path[-1]]:
            if _within(nxt, TOOLS):
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                queue.append([*path, nxt])
    return None


def violations() -> dict[tuple[str, str], str]:
    """Every broken direction: (kind, what) -> the import chain or cycle that shows it."""
    found: dict[tuple[str, str], str] = {}
    for cycle in _cycles(GRAPH):
        found[("cycle", " <-> ".join(cycle))] = " <-> ".join(cycle)
    units: dict[str, list[str]] = {}
    for module, targets in GRAPH.items():
        units.setdefault(_unit(module), [])
        units[_unit(module)] += [_unit(t) for t in targets if _unit(t) != _unit(module)]
    for cycle in _cycles({u: sorted(set(t)) for u, t in units.items()}):
        found[("cycle", " <-> ".join(cycle))] = " <-> ".join(cycle)
    for module in MODULES:
        if _within(module, RUNTIME) and not _within(module, RUNTIME_EXCEPT):
            path = _path_to_tools(module)
            if path is not None:
                found[("runtime", f"{path[-2]} -> {path[-1]}")] = " -> ".join(path)
        if not _within(module, ("te",)):
            for target in _imports(module):
                if target.split(".")[0] == "transformer_engine":
                    found[("te", f"{module} -> {target}")] = target
            for name in te_attributes_read(MODULES[module].read_text()):
                found[("te-attr", f"{module} reads {name}")] = f"{module} reads TE's .{name}"
    for module in RUNTIME_EXCEPT:
        for target in GRAPH[f"foundry_fp8.{module}"]:
            if _within(target, ("doctor", "cli", "report", "tools")):
                found[("callback", f"foundry_fp8.{module} -> {target}")] = target
    return found


def test_imports_point_inward():
    found = violations()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "imports against the allowed directions:\n" + "\n".join(
        f"  {kind}: {chain}" for (kind, _), chain in sorted(new.items()))


def test_the_allow_list_holds_only_what_is_still_violated():
    stale = sorted(set(ALLOWED) - set(violations()))
    assert not stale, f"fixed, remove from ALLOWED: {stale}"


def test_the_checker_sees_lazy_imports_and_chains():
    """A lazy import inside a function counts, and a chain through another module is found
    (te_backend -> environment -> lint.rules was such a chain)."""
    assert "foundry_fp8.te.backend" in GRAPH["foundry_fp8.swap"]  # imported inside a function
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _path_to_tools("foundry_fp8.composer.lint") is not None  # the linter's callback


def test_the_checker_sees_te_internals_read_outside_te():
    """`mod.init_fp8_metadata(...)` and `getattr(mod, "fp8", False)` (what fp8_state once did),
    not our own names."""
    source = ("def hook(mod):\n    mod.init_fp8_metadata(num_gemms=1)\n"
              "    return getattr(mod, 'fp8', False), mod.fp8_meta['scaling_fwd'].scale, mod.fp8s\n")
    assert te_attributes_read(source) == {"init_fp8_metadata", "fp8"}
    assert te_attributes_read(MODULES["foundry_fp8.te.backend"].read_text())  # te/ may


def test_te_only_attributes_spare_the_emulated_backend():
    """Our emulated backend names its FP8 state as TE does (`fp8_meta`, `scaling_fwd`, `scale`,
    `amax_history`): none of those, nor anything else it defines or reads, is TE-only."""
    emulated = set()
    for module in ("foundry_fp8.emulate", "foundry_fp8.fp8_meta"):
        tree = ast.parse(MODULES[module].read_text())
        emulated |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        emulated |= {n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        emulated |= {n.value for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert {"fp8_meta", "scale", "amax_history"} <= emulated
    assert not emulated & TE_ONLY_ATTRIBUTES
