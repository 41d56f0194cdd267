"""The README's and docs' YAML examples are what users paste first: they must parse and lint clean."""

import re
from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.recipe import recipe_problems

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TE_SWAP_DOC = ROOT / "docs" / "te_swap.md"


def _yaml_blocks(path: Path = README) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.DOTALL)


def _commented_alternatives(block: str) -> list[str]:
    """`# fp8_recipe: {...}` lines that the README offers as the other choice."""
    return [line.lstrip("# ") for line in block.splitlines() if re.match(r"#\s*\w+:", line)]


def test_readme_has_the_examples_this_file_checks() -> None:
    blocks = _yaml_blocks()
    assert len(blocks) == 1
    assert blocks[0].startswith("algorithms:")
    assert "fp8_recipe" in _yaml_blocks(TE_SWAP_DOC)[0]


def test_readme_train_example_lints_without_errors(tmp_path: Path) -> None:
    path = tmp_path / "readme.yaml"
    path.write_text(_yaml_blocks()[0])
    report = lint_file(path)
    assert report["error"] is None
    assert [f for f in report["findings"] if f["severity"] == "error"] == []


@pytest.mark.parametrize("alternative", [False, True])
def test_readme_recipes_are_valid(tmp_path: Path, alternative: bool) -> None:
    import yaml

    block = _yaml_blocks(TE_SWAP_DOC)[0]
    text = _commented_alternatives(block)[0] if alternative else block
    recipe = yaml.safe_load(text)["fp8_recipe"]
    assert recipe["scaling"] == ("current" if alternative else "delayed")
    assert recipe_problems(recipe) == []
