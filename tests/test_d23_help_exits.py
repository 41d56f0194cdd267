"""Each exit status a run gives is one its `--help` names with that meaning: the report's
`--out` (or run folder) it cannot write exits 2, which its help gave only for a run it cannot
read and a usage error (QA 23; tiny-data's ROOT it cannot write likewise)."""

from __future__ import annotations

from foundry_fp8.cli import main
from tests.test_cli_help import _exit_statuses
from tests.test_report import write_run


def test_a_report_it_cannot_write_exits_as_its_help_says(tmp_path, capsys):
    run = write_run(tmp_path)
    (tmp_path / "taken").write_text("a file where --out's folder goes")
    assert main(["report", str(run), "--out", str(tmp_path / "taken")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert any(code == 2 and "report cannot be written" in meaning
               for code, meaning in _exit_statuses("report"))
    assert any(code == 2 and "cannot be written" in meaning
               for code, meaning in _exit_statuses("tiny-data"))
