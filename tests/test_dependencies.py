"""Every third-party package foundry_fp8 imports (lazy imports inside functions included) is
declared in setup.cfg, so a user's environment resolver installs it: a package that arrives only
as some other dependency's dependency can vanish when that one drops it."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from foundry_fp8.lint.known import AUTO_MICROBATCH_CHECKED_FROM
from foundry_fp8.te.facts import MIN_TE, Version, parse_version

REPO = Path(__file__).resolve().parents[1]


def imported_top_level() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "foundry_fp8").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
    return names - set(sys.stdlib_module_names) - {"foundry_fp8"}


def normalise(name: str) -> str:
    """PEP 503 normalisation, extras and version specifiers dropped."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~;\s]", name.strip(), maxsplit=1)[0]).lower()


def requirements() -> list[str]:
    """setup.cfg's install_requires and extra `te`, comments left out."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    lines += config["options.extras_require"]["te"].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def declared() -> set[str]:
    return {normalise(line) for line in requirements()}


def floor(name: str) -> Version | None:
    """The `>=` lower bound setup.cfg gives distribution `name`."""
    for line in requirements():
        if normalise(line) == name:
            found = re.search(r">=\s*([\w.]+)", line)
            return parse_version(found.group(1)) if found else None
    raise AssertionError(f"{name} is not in setup.cfg")


#: Imports reached only through an object of that package the user's run already holds: the
#: package is there whenever the import runs, and declaring it would install it for everyone.
BROUGHT_BY_THE_RUN = {
    "mlflow": "composer/destinations.py, only for Composer's MLFlowLogger (which imports mlflow); "
              "report/mlflow_run.py, only when the user names an MLflow run (one line without it)",
}


def test_every_imported_package_is_declared() -> None:
    distributions = packages_distributions()
    wanted = declared()
    undeclared = []
    for module in sorted(imported_top_level() - BROUGHT_BY_THE_RUN.keys()):
        names = {normalise(d) for d in distributions.get(module, [module.replace("_", "-")])}
        if not names & wanted:
            undeclared.append(f"{module} ({', '.join(sorted(names))})")
    assert not undeclared, f"imported but not in setup.cfg install_requires / extras te: {undeclared}"


def test_the_check_sees_lazy_imports() -> None:
    """The scan must reach imports inside functions (bench's tqdm is one), and every package
    left out as brought by the run is still imported (else its entry is stale)."""
    assert {"tqdm", "torch", "composer", *BROUGHT_BY_THE_RUN} <= imported_top_level()


def test_setup_cfg_floors_are_the_codes() -> None:
    """setup.cfg cannot import the version facts, so its bounds are checked against them."""
    assert floor("transformer-engine") == MIN_TE  # te.facts: the oldest TE the backend knows
    # lint.known judges auto micro-batching from this Composer on, as the floor we need
    composer = floor("mosaicml")
    assert composer is not None and composer >= AUTO_MICROBATCH_CHECKED_FROM
