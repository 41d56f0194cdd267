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


def test_a_lease_without_an_nvidia_smi_line_is_kept_and_says_so(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """A device whose nvidia-smi printed nothing still ran the tests: the record keeps them and
    its title says no GPU was named (it printed "on None")."""
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    (tmp_path / "environment-tests.txt").write_text("Tue Dec  1 06:00:00 UTC 2026\n")
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["record.py", str(tmp_path), "--command", "verify.sh tests"])
    record.main()
    md = (tmp_path / "results" / "gpu_tests_a_gpu_nvidia_smi_did_not_name.md").read_text()
    assert md.splitlines()[0] == ("# `pytest -m gpu` on a GPU nvidia-smi did not name "
                                  "(Tue Dec  1 06:00:00 UTC 2026)")
    assert "1 passed, 1 failed, 1 error, 1 skipped." in md
    assert "no nvidia-smi GPU line" in capsys.readouterr().err


def test_a_second_lease_on_the_same_gpu_keeps_the_first_record(tmp_path: Path, monkeypatch
                                                               ) -> None:
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    (tmp_path / "environment-tests.txt").write_text(
        "Tue Dec  1 06:00:00 UTC 2026\nNVIDIA H200, 570.86.15, 143771 MiB, 1980 MHz\n")
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["record.py", str(tmp_path), "--command", "verify.sh tests"])
    record.main()
    first = (tmp_path / "results" / "gpu_tests_nvidia_h200.md").read_text()
    record.main()
    assert (tmp_path / "results" / "gpu_tests_nvidia_h200.md").read_text() == first
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "gpu_tests_nvidia_h200.json", "gpu_tests_nvidia_h200.md",
        "gpu_tests_nvidia_h200_run2.json", "gpu_tests_nvidia_h200_run2.md"]
