"""The CLI's output side, for every subcommand (`foundry_fp8/cli.py`, `main`): a terminal that is
not UTF-8, a pipe closed early, a full disk, a closed stdout or stderr; and one-line errors:
control characters in paths and keys escaped (`lint/output.py`, `one_line`), errors on stderr
(bench, tiny-data), tiny-data's build checked before it is called ready.

Process behaviour is tested on a real `foundry-fp8` process; each run takes about a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8.cli import EXIT_BROKEN_PIPE, main
from foundry_fp8.health.table import one_line
from foundry_fp8.lint.output import render_text
from foundry_fp8.tools import tiny_data as td

CLI = [sys.executable, "-m", "foundry_fp8.cli"]


def _cli(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([*CLI, *map(str, args)], text=True, timeout=120, **streams)


def _bash(script: str, *args: str | Path) -> subprocess.CompletedProcess:
    """`script` with "$@" the CLI and `args`: for redirections Python cannot spell."""
    return subprocess.run(["bash", "-c", script, "bash", *CLI, *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _typo_yaml(tmp_path: Path, name: str = "typo.yaml", key: str = "precisoin") -> Path:
    path = tmp_path / name
    path.write_text(f"{key}: amp_bf16\n", encoding="utf-8")
    return path


def test_a_terminal_that_is_not_utf8_gets_escapes_not_a_traceback(tmp_path):
    path = _typo_yaml(tmp_path, "unicode.yaml", "précisiön")
    done = _cli("lint", path, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "pr\\xe9cisi\\xf6n" in done.stdout  # FP8009's unknown key, escaped
    # stderr too: a tiny-data error naming a non-ASCII path
    blocker = tmp_path / "fïle"
    blocker.write_text("")
    done = _cli("tiny-data", blocker / "data", env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "f\\xefle: is a file" in done.stderr


def test_a_pipe_closed_early_ends_quietly_with_141(tmp_path):
    paths = [_typo_yaml(tmp_path, f"typo{i}.yaml") for i in range(400)]  # > 64 KiB of JSON
    process = subprocess.Popen([*CLI, "lint", "--format", "json", *map(str, paths)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(1) == b"{"
    process.stdout.close()  # as `| head -c 1` does
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == EXIT_BROKEN_PIPE and stderr == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_is_one_line_naming_the_output(tmp_path):
    with open("/dev/full", "w") as full:
        done = _cli("lint", _typo_yaml(tmp_path), stdout=full)
    assert done.returncode == 2
    assert done.stderr == ("foundry-fp8: cannot write to stdout (/dev/full): "
                           "No space left on device\n")


def test_a_closed_stderr_changes_nothing_when_nothing_goes_there(tmp_path):
    clean = tmp_path / "bf16.yaml"  # the bench's own YAML: no error findings
    clean.write_text((Path(td.__file__).parent / "yamls" / "mpt-1b-bf16.yaml").read_text())
    for path, code in ((clean, 0), (_typo_yaml(tmp_path), 1), (tmp_path / "missing.yaml", 2)):
        done = _bash('"$@" 2>&-; echo "exit $?"', "lint", path)
        assert done.stdout.splitlines()[-1] == f"exit {code}", (path, done.stdout[-300:])
        assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["bench", "--help"], ["doctor"],
                                  ["lint", "{clean}"], ["lint", "{typo}"]])
def test_a_closed_stdout_is_a_write_error_not_a_silent_exit_0(tmp_path, argv):
    """QA: `foundry-fp8 doctor >&-` printed nothing and exited 0. A closed stdout is an output
    that cannot be written, as for the shell's own echo and GNU cat (both exit 1 with 'Bad
    file descriptor'): one line on stderr, exit 2, as for `> /dev/full`."""
    clean = tmp_path / "bf16.yaml"
    clean.write_text((Path(td.__file__).parent / "yamls" / "mpt-1b-bf16.yaml").read_text())
    for reference in ('echo hi >&-; echo "exit $?"', 'cat "$0" >&-; echo "exit $?"'):
        done = subprocess.run(["bash", "-c", reference, str(clean)], capture_output=True,
                              text=True, timeout=60)
        assert done.stdout == "exit 1\n" and "Bad file descriptor" in done.stderr, done
    args = [a.format(clean=clean, typo=_typo_yaml(tmp_path)) for a in argv]
    done = _bash('"$@" >&-; echo "exit $?" >&2', *args)
    assert done.stderr == ("foundry-fp8: cannot write to stdout: Bad file descriptor\n"
                           "exit 2\n"), done.stderr[-2000:]
    done = _bash('"$@" >&- 2>&-; echo "exit $?"', *args)  # nothing left to say it on
    assert done.stdout == "exit 2\n", done.stdout


def test_an_undecodable_byte_in_a_file_name_is_shown_as_that_byte(tmp_path):
    """A name's byte the file-system encoding cannot decode is held as a lone surrogate
    (PEP 383) and was shown as `\\udcff`, which names no byte; now `\\xff`, the byte
    os.fsencode gives back. Under an ASCII file-system encoding (LC_ALL=C, no UTF-8 mode)
    `é` is two such bytes."""
    name = os.fsdecode(b"typo\xff.yaml")
    _typo_yaml(tmp_path, name)
    assert os.fsencode(name)[4:5] == b"\xff"
    done = _cli("lint", tmp_path / name)
    assert done.returncode == 1 and f"{tmp_path}/typo\\xff.yaml" in done.stdout, done.stdout
    ascii_env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    ascii_env.pop("PYTHONIOENCODING", None)
    _typo_yaml(tmp_path, "caf\u00e9.yaml")
    done = subprocess.run([*CLI, "lint", "caf\u00e9.yaml"], capture_output=True, timeout=120,
                          env=ascii_env, cwd=tmp_path)
    assert done.returncode == 1 and b"caf\\xc3\\xa9.yaml" in done.stdout, done.stdout
    assert "caf\u00e9".encode()[3:] == b"\xc3\xa9" and b"Traceback" not in done.stderr


def test_one_line_escapes_what_would_break_the_line_or_drive_the_terminal():
    assert one_line("new\nline\r\t\x1b[2J\x7f\x85\u2028.yaml") == (
        "new\\nline\\r\\t\\x1b[2J\\x7f\\x85\\u2028.yaml")
    assert one_line("précisiön: блок.0 – ok") == "précisiön: блок.0 – ok"


def test_lint_text_output_keeps_each_finding_on_its_lines():
    finding = {"rule": "FP8009", "severity": "error", "key": "a\nb", "line": 1, "column": 1,
               "message": "unknown key `a\nb`", "fix": "fix\rit"}
    text = render_text({"files": [{"path": "new\nline.yaml", "error": None,
                                   "findings": [finding]}]})
    lines = text.splitlines()
    assert lines[0] == "new\\nline.yaml" and len(lines) == 5, text  # path, finding, fix, "", sum
    assert "a\\nb  unknown key `a\\nb`" in lines[1] and lines[2].strip() == "fix: fix\\rit"


def test_bench_errors_go_to_stderr():
    done = _cli("bench", "--tiny", "--steps", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "foundry-fp8 bench: --steps must be >= 1, got 0\n"


@pytest.mark.parametrize(("in_the_way", "root"), [
    ("data/tokenizer-v512", "data"), ("data/text-2048", "data"), ("data/text-2048/val", "data"),
    ("new\nfile", "new\nfile/data")])
def test_tiny_data_names_the_file_in_the_way_on_one_stderr_line(tmp_path, in_the_way, root):
    blocker = tmp_path / in_the_way
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("")
    done = _cli("tiny-data", tmp_path / root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"foundry-fp8 tiny-data: {one_line(str(blocker))}: is a file, where "
                           "tiny-data needs a folder (move it away, or build in another ROOT)\n")
    assert not list(tmp_path.rglob("ready-*.json"))


def test_tiny_data_checks_its_build_before_calling_it_ready(tmp_path, monkeypatch, capsys):
    """A build that saved nothing (as Hugging Face does into a file, with a logged error only)
    fails in one line, without the ready marker; a marker over a broken build is not trusted."""
    monkeypatch.setattr(td, "_build_tokenizer", lambda path, vocab_size, corpus: None)
    monkeypatch.setattr(td, "_build_dataset", lambda path, corpus: None)
    assert main(["tiny-data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"foundry-fp8 tiny-data: the build failed: "
                   f"{tmp_path / 'tokenizer-v512' / 'tokenizer.json'}: not written\n")
    assert not list(tmp_path.glob("ready-*.json"))
    marker = tmp_path / "ready-v512-2048-0.json"
    marker.write_text(json.dumps({"root": str(tmp_path)}))  # an earlier, broken build's
    assert main(["tiny-data", str(tmp_path)]) == 2 and not marker.exists()


def test_a_whole_build_passes_the_check(tiny_data):
    assert td._unusable(tiny_data) is None


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_stderr_does_not_stop_a_command_but_fails_its_exit(tmp_path, monkeypatch, capsys):
    """QA: `foundry-fp8 bench 2>/dev/full` (or `2>&-`) stopped at the progress bar's first write
    with exit 2 and saved nothing. stderr holds diagnostics: the bench now runs and saves its
    results, and the exit status says the diagnostics were lost (2, not 0), as GNU tools check
    stderr at exit."""
    from foundry_fp8.tools import bench

    def one_row(variant, config, bar):
        return {"name": variant.name, "label": variant.label(config.tiny), "precision": "fp32",
                "tokens_per_s": 1000.0, "mfu": 0.1, "hfu": 0.1, "mfu_peak_tflops": 989.0,
                "peak_mem_gb": 1.0, "loss": 1.0, "loss_first_timed_step": 2.0,
                "attention_share": None, "micro_batch": 4, "what": variant.what}

    monkeypatch.setattr(bench, "run_variant", one_row)
    with open("/dev/full", "w", buffering=1) as full:
        with pytest.raises(OSError):
            full.write("a diagnostic\n")  # the reference: /dev/full refuses every write
        monkeypatch.setattr(sys, "stderr", full)
        assert main(["bench", "--tiny", "--variants", "bf16", "--out", str(tmp_path)]) == 2
    saved = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())
    assert [row["name"] for row in saved["variants"]] == ["bf16"]
    assert capsys.readouterr().out.endswith("mpt-tiny-cpu.md\n")


@pytest.mark.parametrize(("blocked", "argv", "one_line_error"), [
    ("omegaconf", ["bench", "--tiny", "--steps", "1"], True),
    ("foundry_fp8.report", ["report", "x"], False),
], ids=["a-dependency", "our-own-module"])
def test_a_python_without_a_dependency_is_one_line_naming_it(blocked, argv, one_line_error):
    """QA 17: `python benchmarks/mpt_throughput.py --tiny` with a Python that is not the venv's
    ended in a ModuleNotFoundError traceback. A missing dependency is one line naming the module
    and the interpreter, exit 2; a module of ours that does not import stays a traceback (a bug)."""
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"  # import raises ModuleNotFoundError
            f"from foundry_fp8.cli import main; sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    if one_line_error:
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith(f"foundry-fp8: no module {blocked!r} in {sys.executable}: ")
    else:
        assert done.returncode == 1 and "Traceback" in done.stderr and blocked in done.stderr


@pytest.mark.parametrize("args", [["lint", "{bad}"], ["lint", "{good}"], ["--version"], ["bogus"]],
                         ids=["bad-yaml", "good-yaml", "version", "unknown-command"])
def test_python_m_foundry_fp8_is_the_foundry_fp8_command(args, tmp_path):
    """QA 17: `python -m foundry_fp8 lint x.yaml` ended in 'No module named foundry_fp8.__main__'.
    The reference is the installed `foundry-fp8` console script: same output, same exit code."""
    (tmp_path / "bad.yaml").write_text("model: [\n")
    (tmp_path / "good.yaml").write_text("max_seq_len: 8\n")
    argv = [a.format(bad=tmp_path / "bad.yaml", good=tmp_path / "good.yaml") for a in args]
    script = Path(sys.executable).with_name("foundry-fp8")
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    expected = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", *argv], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (
        expected.returncode, expected.stdout, expected.stderr)
    assert expected.returncode != 0 or args != ["lint", "{bad}"]


@pytest.mark.parametrize(("script", "blocked"), [
    ("emulation_cost.py", "torch"), ("stats_gpu_cost.py", "torch"),
    ("stats_overhead.py", "omegaconf"), ("guard_overhead.py", "omegaconf"),
    ("mpt_throughput.py", "omegaconf"),
])
def test_a_benchmark_script_without_a_dependency_is_one_line(script, blocked):
    """QA 17: the benchmark scripts run with a Python outside the venv ended in a
    ModuleNotFoundError traceback (mpt_throughput.py aside, 4f7a6f4). Each now says what
    `main` says: one line naming the module and the interpreter, exit 2."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    argv = ["--tiny", "--steps", "1", "--out", "/nonexistent"] if script == "mpt_throughput.py" \
        else ["--help"]
    code = (f"import runpy, sys; sys.modules[{blocked!r}] = None\n"  # its import fails
            f"sys.argv = [{str(path)!r}, *{argv!r}]\n"
            f"runpy.run_path({str(path)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"foundry-fp8: no module {blocked!r} in {sys.executable}: ")
    assert done.stderr.count("\n") == 1, done.stderr
