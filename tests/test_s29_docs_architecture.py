"""docs/architecture.md is where a contributor looks up which module owns what, and which ones
the import test holds to the runtime's rules. Both drifted by hand: `blocks.py`,
`report/baseline.py` and `report/mlflow_run.py` were in no row of its tree, and its runtime list
lacked four of the test's `RUNTIME` (`blocks`, `sdpa_facts`, `paths`, `restore`)."""

from __future__ import annotations

import re
from pathlib import Path

import foundry_fp8
from tests.test_import_graph import RUNTIME

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
PACKAGE = Path(foundry_fp8.__file__).resolve().parent
#: The folders whose tree row names each file (the others are described as a whole).
LISTED_FOLDERS = ("te", "report")


def _tree() -> str:
    [tree] = re.findall(r"```\nfoundry_fp8/\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    return tree


def test_every_module_has_a_row_in_the_tree() -> None:
    tree = _tree()
    files = [*PACKAGE.glob("*.py")] + [
        p for folder in LISTED_FOLDERS for p in (PACKAGE / folder).glob("*.py")]
    named = set(re.findall(r"[\w]+\.py", tree))
    missing = sorted(str(p.relative_to(PACKAGE)) for p in files
                     if not p.name.startswith("__") and p.name not in named)
    assert missing == []


def test_the_runtime_list_is_the_import_tests() -> None:
    [bullet] = re.findall(r"- The runtime \((.*?) except\s+the", DOC.read_text(), flags=re.DOTALL)
    listed = {name.rstrip("/") for name in re.findall(r"`([\w/]+)`", bullet)}
    assert listed == set(RUNTIME)
