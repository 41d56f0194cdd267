"""benchmarks/gpu/record.py, which turns a lease's `pytest -m gpu` files into the results: every
test case of the junit XML is read, a blank message included (it raised IndexError, losing the
whole record of a paid GPU lease)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu import record

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a_gpu" name="test_ok" time="1.5"/>
<testcase classname="tests.test_a_gpu" name="test_bad" time="0.7"><failure
 message="AssertionError: a&#10;second line">trace</failure></testcase>
<testcase classname="" name="tests.test_cpu_only" time="0.0"><error
 message="collection failure">ImportError</error></testcase>
<testcase classname="tests.test_b_gpu" name="test_skip" time="0.0"><skipped type="pytest.skip"
 message="">&#10;&#32;&#32;</skipped></testcase>
</testsuite></testsuites>
"""


def test_every_case_is_read_a_blank_message_included(tmp_path: Path) -> None:
    path = tmp_path / "gpu-tests.xml"
    path.write_text(JUNIT)
    assert record.tests(path) == [
        {"test": "tests.test_a_gpu::test_ok", "outcome": "passed", "seconds": 1.5,
         "message": ""},
        {"test": "tests.test_a_gpu::test_bad", "outcome": "failed", "seconds": 0.7,
         "message": "AssertionError: a"},
        {"test": "::tests.test_cpu_only", "outcome": "error", "seconds": 0.0,
         "message": "collection failure"},
        {"test": "tests.test_b_gpu::test_skip", "outcome": "skipped", "seconds": 0.0,
         "message": ""},
    ]
