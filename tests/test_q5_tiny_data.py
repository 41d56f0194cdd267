"""`foundry-fp8 tiny-data`'s YAML lines for a ROOT whose name holds a line break (QA Q5,
session 22): each stays one line and loads, with YAML's own loader, as the folder built."""

from __future__ import annotations

from pathlib import Path

import yaml

from foundry_fp8.cli import main
from tests.test_tiny_data_build import whole  # noqa: F401 (fixture)


def test_a_root_with_a_line_break_prints_one_loadable_line_each(whole, tmp_path,  # noqa: F811
                                                                capsys):
    """PyYAML's single quotes fold a line break over three lines (`'.../bad` + blank line +
    `name/...'`): the printed `(tokenizer: ...)` snippet broke over lines. Double quotes escape
    it (`\\n`) and load back the same path."""
    root = tmp_path / "bad\nname"
    whole.root.rename(root)
    assert main(["tiny-data", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["building", "tokenizer:", "dataset:"], lines
    tokenizer = yaml.safe_load(lines[1].split("(tokenizer: ", 1)[1][:-1])
    loader = yaml.safe_load(lines[2].split("(train_loader: ", 1)[1][:-1])
    assert Path(tokenizer["name"]) == (root / whole.tokenizer_dir.name).resolve()
    assert Path(loader["dataset"]["local"]) == (root / whole.data_dir.name).resolve()
