"""Each subcommand's --help names every exit status it can give: `doctor --bogus` exits 2, as
README's "doctor 0/1/2" says, but doctor's --help named only 0 and 1 of its own."""

from __future__ import annotations

import re

import pytest

from foundry_fp8.cli import EXITS, SUBCOMMANDS, main


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_a_usage_error_exits_with_a_status_its_help_names(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([command, "--no-such-option"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"foundry-fp8 {command}: error: " in err
    with pytest.raises(SystemExit):
        main([command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    own = shown[shown.index("exit status: "):].split(";")[0]  # before the shared statuses
    assert re.search(r"\b2 ", own), own
    assert " ".join(EXITS[command].split()) in shown
