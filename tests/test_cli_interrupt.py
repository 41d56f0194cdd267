"""Ctrl-C in any `foundry-fp8` subcommand (QA 8): one line on stderr and exit 130 (128 + SIGINT,
what a shell reports for a command SIGINT ended), never a KeyboardInterrupt traceback."""

from __future__ import annotations

import dataclasses
import importlib
import signal
import subprocess

import pytest

from foundry_fp8.cli import EXIT_INTERRUPTED, SUBCOMMANDS, main
from tests.test_tiny_data_build import CLI, _held, _stderr_line, whole  # noqa: F401 (fixture)

ARGS = {"lint": ["x.yaml"], "report": ["run"], "bench": ["--tiny"], "doctor": [],
        "tiny-data": ["data"]}


def _composer_s_handler(args):
    """What Composer's SIGINT handler (composer/core/engine.py, installed on import) does."""
    raise SystemExit(128 + signal.SIGINT)


def _python_s_handler(args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("interrupt", [_python_s_handler, _composer_s_handler],
                         ids=["python", "composer"])
@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_an_interrupt_in_any_subcommand_is_one_line_and_exit_130(command, interrupt,
                                                                 monkeypatch, capsys):
    module = importlib.import_module(SUBCOMMANDS[command][0])
    monkeypatch.setattr(module, "run", interrupt)
    try:
        code = main([command, *ARGS[command]])
    except (KeyboardInterrupt, SystemExit):  # must fail this test, not stop the whole session
        pytest.fail("the interrupt escaped main")
    assert code == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "foundry-fp8: interrupted\n"


def test_a_real_ctrl_c_while_tiny_data_waits_is_one_line(whole):  # noqa: F811 (the fixture)
    """SIGINT to a real process, sent once it is inside the subcommand (waiting for a lock)."""
    next(whole.root.glob("ready-*.json")).unlink()
    with _held(whole.root):
        process = subprocess.Popen([*CLI, "tiny-data", str(whole.root)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert "waiting for another tiny-data build" in _stderr_line(process, 90)
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 130 and stderr == "foundry-fp8: interrupted\n", stderr


def _ctrl_c_in_an_import(args):  # the pybind11 case below, for make run
    _ctrl_c_in_an_extension_import(args)


@pytest.mark.parametrize("interrupt", [_python_s_handler, _composer_s_handler,
                                       _ctrl_c_in_an_import],
                         ids=["python", "composer", "pybind-import"])
def test_an_interrupt_in_make_run_is_one_line_and_exit_130(interrupt, monkeypatch, capsys):
    """QA 17: Ctrl-C once `make run`'s demo had imported Composer (to train) ended it with exit
    130 and nothing said: Composer's handler raises SystemExit, which `entry` let through."""
    import runpy
    from pathlib import Path

    demo = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "demo.py"))
    monkeypatch.setitem(demo["entry"].__globals__, "main", interrupt)
    try:
        code = demo["entry"]([])
    except (KeyboardInterrupt, SystemExit):
        pytest.fail("the interrupt escaped entry")
    assert code == 130
    assert capsys.readouterr().err == "make run: interrupted\n"


def test_make_run_s_own_failure_is_not_called_an_interrupt(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    demo = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "demo.py"))

    def failed(argv):
        raise SystemExit("training failed (exit 1); full log: x.log")

    monkeypatch.setitem(demo["entry"].__globals__, "main", failed)
    with pytest.raises(SystemExit, match="training failed"):
        demo["entry"]([])
    assert capsys.readouterr().err == ""


def _ctrl_c_in_an_extension_import(args):
    """What Ctrl-C during a pybind11 extension's import raises: PYBIND11_MODULE's init wraps
    the KeyboardInterrupt as ImportError('initialization failed') from it
    (torch/include/pybind11/detail/common.h:409, `raise_from`)."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        raise ImportError("initialization failed") from interrupt


def _half_imported_module_fails_after_ctrl_c(args):
    """QA 19: a Ctrl-C in numpy's import ended the bench in `AttributeError: module 'numpy' has
    no attribute 'ndarray'`, raised while the interrupt was being handled."""
    try:
        raise SystemExit(128 + signal.SIGINT)  # Composer's handler, once it is imported
    except SystemExit:
        raise AttributeError("module 'numpy' has no attribute 'ndarray'") from None


@pytest.mark.parametrize("interrupt", [_ctrl_c_in_an_extension_import,
                                       _half_imported_module_fails_after_ctrl_c],
                         ids=["pybind-import", "during-handling"])
def test_an_error_a_ctrl_c_caused_is_the_interrupt_s_one_line(interrupt, monkeypatch, capsys):
    module = importlib.import_module(SUBCOMMANDS["report"][0])
    monkeypatch.setattr(module, "run", interrupt)
    assert main(["report", "run"]) == 130
    assert capsys.readouterr().err == "foundry-fp8: interrupted\n"


def test_an_error_with_no_interrupt_behind_it_is_still_raised(monkeypatch):
    module = importlib.import_module(SUBCOMMANDS["report"][0])

    def broken(args):
        try:
            raise ValueError("first")
        except ValueError as first:
            raise ImportError("initialization failed") from first

    monkeypatch.setattr(module, "run", broken)
    with pytest.raises(ImportError, match="initialization failed"):
        main(["report", "run"])


def test_ctrl_c_in_a_bench_variant_s_import_stops_the_bench(monkeypatch, tmp_path, capsys):
    """QA 19: Ctrl-C while a variant imported a pybind11 extension (scipy's HiGHS, via Composer)
    was recorded as that variant failing ("ImportError: initialization failed"); the bench
    went on with every other variant ("type 'ObjSense' is already registered!") and exited 1
    minutes later."""
    from foundry_fp8.tools import bench

    started = []

    def run_variant(variant, config, bar):
        started.append(variant.name)
        _ctrl_c_in_an_extension_import(None)

    monkeypatch.setattr(bench, "run_variant", run_variant)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-te-swap,fp8-te-swap-stats1",
                 "--out", str(tmp_path)]) == 130
    assert started == ["bf16"]
    assert capsys.readouterr().err.splitlines()[-1] == "foundry-fp8: interrupted"


def _in_a_wrapper_s_ctrl_c_handler(call):
    """QA 19: a wrapper that writes a report after Ctrl-C calls us inside its own
    `except KeyboardInterrupt:`; Python sets that interrupt as the `__context__` of whatever
    is raised inside, which is the wrapper's, not ours."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        return call()


def _a_real_bug(args):
    raise ValueError("a real bug in report")


def test_a_real_error_inside_a_caller_s_ctrl_c_handler_is_raised(monkeypatch, capsys):
    """It was 'foundry-fp8: interrupted' and exit 130, the ValueError lost."""
    module = importlib.import_module(SUBCOMMANDS["report"][0])
    monkeypatch.setattr(module, "run", _a_real_bug)
    with pytest.raises(ValueError, match="a real bug in report"):
        _in_a_wrapper_s_ctrl_c_handler(lambda: main(["report", "run"]))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("interrupt", [_python_s_handler, _ctrl_c_in_an_extension_import],
                         ids=["python", "pybind-import"])
def test_a_ctrl_c_inside_a_caller_s_ctrl_c_handler_is_still_one(interrupt, monkeypatch, capsys):
    module = importlib.import_module(SUBCOMMANDS["report"][0])
    monkeypatch.setattr(module, "run", interrupt)
    assert _in_a_wrapper_s_ctrl_c_handler(lambda: main(["report", "run"])) == 130
    assert capsys.readouterr().err == "foundry-fp8: interrupted\n"


def test_a_bench_variant_s_real_error_inside_a_caller_s_ctrl_c_handler_fails_it(monkeypatch,
                                                                               tmp_path):
    """The variant is recorded as failed and the next one runs, as outside any handler."""
    from foundry_fp8.tools import bench

    started = []

    def run_variant(variant, config, bar):
        started.append(variant.name)
        raise ValueError("a real bug in the variant")

    monkeypatch.setattr(bench, "run_variant", run_variant)
    config = dataclasses.replace(bench.TINY_CONFIG, variants=("bf16", "fp8-te-swap"))
    result = _in_a_wrapper_s_ctrl_c_handler(lambda: bench.run_bench(config))
    assert started == ["bf16", "fp8-te-swap"]
    assert [(f["name"], f["reason"]) for f in result["failed"]] == [
        ("bf16", "ValueError: a real bug in the variant"),
        ("fp8-te-swap", "ValueError: a real bug in the variant")]


def test_make_run_s_real_error_inside_a_caller_s_ctrl_c_handler_is_raised(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    demo = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "demo.py"))
    monkeypatch.setitem(demo["entry"].__globals__, "main", _a_real_bug)
    with pytest.raises(ValueError, match="a real bug in report"):
        _in_a_wrapper_s_ctrl_c_handler(lambda: demo["entry"]([]))
    assert capsys.readouterr().err == ""
