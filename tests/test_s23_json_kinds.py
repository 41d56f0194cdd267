"""A metrics-file line that is JSON but no record is named by JSON's own type (QA s23: `a JSON
NoneType`, `a JSON list`: Python's names), read back through `foundry-fp8 report`'s reader."""

from __future__ import annotations

import pytest

from foundry_fp8.jsonl import JsonlError, read_jsonl


@pytest.mark.parametrize(("line", "kind"), [
    ("null", "null"), ("[1, 2]", "an array"), ('"x"', "a string"), ("3", "a number"),
    ("2.5", "a number"), ("true", "a boolean"), ("false", "a boolean"),
])
def test_a_line_that_is_json_but_no_record_names_its_json_type(tmp_path, line, kind):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "metrics": {}}\n' + line + "\n")
    with pytest.raises(JsonlError) as raised:
        list(read_jsonl(path))
    assert str(raised.value) == (f"{path}:2: not a metrics record ({kind}, expected "
                                 '{"step": int, "metrics": {...}})')
