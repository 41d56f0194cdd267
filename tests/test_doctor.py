"""Environment rules (FP82xx) on hand-made snapshots, and the real `foundry-fp8 doctor` on this
machine (which may have no GPU and no TransformerEngine)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from foundry_fp8 import doctor, environment
from foundry_fp8.cli import main
from foundry_fp8.doctor import exit_code, exit_reason
from foundry_fp8.environment import PROBE_OUTPUT_LIMIT, Snapshot, gather_snapshot, run_probe
from foundry_fp8.lint.registry import Finding, rules_of
from foundry_fp8.lint.rules import RULES
from foundry_fp8.lint.rules.environment import NO_GPU, environment_findings
from foundry_fp8.te.facts import parse_version

ACCELERATE_RULES = rules_of("accelerate")
ENVIRONMENT_RULES = rules_of("environment")

H100 = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                capability=(9, 0), te="2.8.0", te_torch="2.8.0", te_core="2.8.0",
                te_core_package="transformer-engine-cu12", te_import_checked=True)
CPU = Snapshot(python="3.11.7", torch="2.7.0")
#: TE built from source: no transformer-engine-torch / -cu12 packages beside it
SOURCE_BUILD = replace(H100, te_torch=None, te_core=None, te_core_package=None)
A100 = Snapshot(python="3", capability=(8, 0), gpu_name="A100")
TE_RUN = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}
EMULATED_RUN = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "emulate"}}}


def rules(snapshot: Snapshot, config: dict | None = None) -> list[tuple[str, str]]:
    return [(f.rule, f.severity) for f in environment_findings(snapshot, config)]


def test_a_good_gpu_machine_has_nothing_to_report():
    assert rules(H100) == []
    assert rules(H100, TE_RUN) == []


@pytest.mark.parametrize(("snapshot", "expected"), [
    (CPU, [("FP8201", "warning")]),
    (Snapshot(python="3", te="2.8.0"), [("FP8201", "warning")]),
    (Snapshot(python="3", capability=(8, 0), gpu_name="A100"), [("FP8202", "warning")]),
    (Snapshot(python="3", capability=(8, 9), torch_cuda="11.8", gpu_name="L4"),
     [("FP8203", "warning"), ("FP8204", "warning")]),
    (Snapshot(python="3", capability=(9, 0)), [("FP8204", "warning")]),
    (Snapshot(python="3", capability=(9, 0), te="2.8.0", te_torch="2.7.0", te_core="2.8.0",
              te_core_package="transformer-engine-cu12"), [("FP8205", "error")]),
    (Snapshot(python="3", capability=(9, 0), te="2.8.0", te_import_checked=True,
              te_import_error="ImportError: undefined symbol"), [("FP8206", "error")]),
    (replace(SOURCE_BUILD, te="unknown (no package metadata)"), [("FP8210", "warning")]),
    (replace(SOURCE_BUILD, te="not-a-version!!"), [("FP8210", "warning")]),
])
def test_each_environment_rule_triggers(snapshot, expected):
    assert rules(snapshot) == expected


@pytest.mark.parametrize("snapshot", [
    Snapshot(python="3", capability=(8, 9), torch_cuda="12.1", te="2.8.0"),  # Ada, CUDA ok
    Snapshot(python="3", capability=(10, 0), torch_cuda="12.8", te="2.8.0"),
    Snapshot(python="3", capability=(9, 0), te="2.8.0"),  # source build: no pip packages
    Snapshot(python="3", capability=(9, 0), te="2.8.0",  # import not checked (fp8_lint)
             te_import_error="never looked"),
])
def test_environment_rules_stay_quiet(snapshot):
    assert rules(snapshot) == []


def test_an_unreadable_te_version_does_not_stop_a_run():
    """The doctor's warning only: a run's findings are errors, and this one is no reason to
    stop a training whose TE imports."""
    assert rules(replace(SOURCE_BUILD, te="unknown (no package metadata)"), TE_RUN) == []


@pytest.mark.parametrize("where", ["nvidia-smi", "te-import"])
def test_probes_that_print_bytes_not_utf8_are_reported_not_fatal(tmp_path, where):
    """A driver tool or a broken TE that writes undecodable bytes: the doctor still reports."""
    env = {**__import__("os").environ}
    if where == "nvidia-smi":
        fake = tmp_path / "nvidia-smi"
        fake.write_bytes(b"#!/bin/sh\nprintf '\\377\\376 NVIDIA \\351, 9.0\\n'\n")
        fake.chmod(0o755)
        env["PATH"] = f"{tmp_path}:{env['PATH']}"
    else:
        package = tmp_path / "transformer_engine"
        (package / "pytorch").mkdir(parents=True)
        (package / "pytorch" / "__init__.py").write_text("")
        (package / "__init__.py").write_text(
            'import sys; sys.stderr.buffer.write(b"\\xff\\xfe bad\\n"); raise SystemExit(3)\n')
        env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    assert "TransformerEngine" in done.stdout
    if where == "te-import":
        assert "FP8206" in done.stdout and "\ufffd" in done.stdout  # the bytes, replaced
        assert done.returncode == 1


def test_no_gpu_message_is_plain():
    assert environment_findings(CPU)[0].message == NO_GPU
    assert NO_GPU == "no GPU: FP8 training needs an H100/Ada; the emulated backend works here"


def test_run_rules_judge_only_runs_that_need_te():
    assert rules(CPU, EMULATED_RUN) == []
    assert rules(CPU, {"precision": "amp_bf16"}) == []
    assert rules(CPU, TE_RUN) == [("FP8201", "error"), ("FP8204", "error")]
    assert rules(CPU, {"model": {"fc_type": {"name": "te"}}}) == [("FP8201", "error"),
                                                                  ("FP8204", "error")]
    a100 = Snapshot(python="3", capability=(8, 0), te="2.8.0")
    assert rules(a100, {"algorithms": {"te_swap": {}}}) == [("FP8202", "error")]  # te default


def test_old_te_with_activation_checkpointing():
    run = {**TE_RUN, "fsdp_config": {"activation_checkpointing": True}}
    old = Snapshot(python="3", capability=(9, 0), te="1.11.0")
    assert rules(old, run) == [("FP8207", "error")]
    assert rules(old, TE_RUN) == []
    assert rules(Snapshot(python="3", capability=(9, 0), te="1.12.0"), run) == []
    found = environment_findings(old, run)[0]
    assert found.key == "fsdp_config.activation_checkpointing" and "#1190" in found.message


def test_current_scaling_needs_te_2_2():
    run = {"algorithms": {"te_swap": {"backend": "te", "fp8_recipe": {"scaling": "current"}}}}
    assert rules(Snapshot(python="3", capability=(9, 0), te="2.1.0"), run) == [
        ("FP8208", "error")]
    assert rules(Snapshot(python="3", capability=(9, 0), te="2.2.0"), run) == []
    broken = {"algorithms": {"te_swap": {"fp8_recipe": {"scaling": "sometimes"}}}}
    assert rules(Snapshot(python="3", capability=(9, 0), te="2.1.0"), broken) == []  # FP8008's


def test_rule_ids_are_unique_and_documented():
    ids = [rule.id for rule in ENVIRONMENT_RULES]
    assert ids == [f"FP82{n:02d}" for n in range(1, 18)]
    assert not set(ids) & {rule.id for rule in [*RULES, *ACCELERATE_RULES]}
    for rule in ENVIRONMENT_RULES:
        assert rule.summary and rule.rationale and rule.source and rule.fix


#: The H200 of the first GPU run: Composer 0.32.1 under torch 2.11, past Composer's torch pin.
H200 = replace(H100, gpu_name="NVIDIA H200", torch="2.11.0+cu130", torch_cuda="13.0",
               te="2.20.2", te_torch="2.20.2", te_core="2.20.2",
               te_core_package="transformer-engine-cu13", composer="0.32.1", llmfoundry="0.22.0")


def test_composer_and_torch_that_cannot_auto_microbatch_under_fsdp_are_an_info():
    """The doctor says it (FP8209, info: FP8 itself is fine); a run's own config is judged by
    the config rule FP8031 instead, so fp8_lint gets nothing from FP8209."""
    assert rules(H200) == [("FP8209", "info")]
    found, = environment_findings(H200)
    assert found.key == "composer" and "torch 2.11.0+cu130" in found.message
    assert "'unshard_with_sync'" in found.message and "torch>=2.6.0,<2.7.1" in found.message
    assert rules(replace(H200, torch="2.7.0")) == []
    assert rules(replace(H200, composer=None)) == []  # not judged without Composer
    assert rules(H200, TE_RUN) == []


def test_an_info_leaves_the_machine_ready(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: H200)
    assert main(["doctor", "--strict"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("info FP8209 composer: Composer 0.32.1 with torch 2.11.0+cu130")
    assert out[-1] == "ready for FP8 training with TransformerEngine"


@pytest.mark.parametrize(("text", "version"), [
    ("2.7.0+cu126", (2, 7, 0)), ("1.12.0.dev0+abc", (1, 12, 0)), ("2.2rc1", (2, 2)),
    ("unknown (no package metadata)", None), (None, None), ("", None),
])
def test_parse_version(text, version):
    assert parse_version(text) == version


INFO = Finding("FP8201", "info", "gpu", "m", "f")
WARNING = Finding("FP8202", "warning", "gpu", "m", "f")
WARNING_2 = Finding("FP8204", "warning", "transformer_engine", "m", "f")
ERROR = Finding("FP8205", "error", "transformer_engine", "m", "f")


def test_exit_codes_errors_fail_strict_adds_warnings_infos_never_fail():
    assert exit_code([], strict=True) == 0
    assert exit_code([INFO], strict=False) == 0 and exit_code([INFO], strict=True) == 0
    assert exit_code([WARNING], strict=False) == 0 and exit_code([WARNING], strict=True) == 1
    assert exit_code([INFO, ERROR], strict=False) == 1
    error = environment_findings(Snapshot(python="3", capability=(9, 0), te="2", te_torch="1"))
    assert exit_code(error, strict=False) == 1


def test_exit_reason_is_one_line_naming_the_failing_findings():
    assert exit_reason([], strict=True) is None
    assert exit_reason([INFO, WARNING], strict=False) is None
    assert exit_reason([INFO], strict=True) is None
    assert exit_reason([INFO, WARNING, ERROR], strict=False) == (
        "foundry-fp8 doctor: exit 1 because of 1 error: FP8205")
    assert exit_reason([INFO, ERROR, WARNING, WARNING_2], strict=True) == (
        "foundry-fp8 doctor: exit 1 because of 1 error and 2 warnings: FP8205, FP8202, FP8204 "
        "(with --strict, warnings fail too)")


@pytest.mark.parametrize(("snapshot", "args", "code", "last_line"), [
    (A100, [], 0,
     "warning FP8202 gpu: A100: "),
    (A100, ["--strict"], 1, "foundry-fp8 doctor: exit 1 because of 1 warning: FP8202 "
                            "(with --strict, warnings fail too)"),
    (H100, ["--strict"], 0, "ready for FP8 training with TransformerEngine"),
    (Snapshot(python="3", capability=(9, 0), te="2.8.0", te_torch="2.7.0", te_core="2.8.0",
              te_core_package="transformer-engine-cu12"), [], 1,
     "foundry-fp8 doctor: exit 1 because of 1 error: FP8205"),
])
def test_doctor_output_ends_with_why_it_fails(capsys, monkeypatch, snapshot, args, code,
                                              last_line):
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: snapshot)
    assert main(["doctor", *args]) == code
    assert capsys.readouterr().out.splitlines()[-1].startswith(last_line)


def test_an_info_alone_never_fails_even_strict(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "environment_findings", lambda snapshot: [INFO])
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: H100)
    assert main(["doctor", "--strict"]) == 0
    assert "exit 1" not in capsys.readouterr().out
    assert main(["doctor", "--strict", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 0 and report["exit_reason"] is None


def test_the_probe_runs_here_without_importing_torch():
    code = ("import sys; from foundry_fp8.environment import gather_snapshot; "
            "s = gather_snapshot(probe_te_import=False); "
            "print(s.torch, s.torch_cuda, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    import torch  # the reference: what torch itself says about its build

    assert out == [torch.__version__.split("+")[0] if out[0] == torch.__version__.split("+")[0]
                   else torch.__version__, str(torch.version.cuda), "False"]
    assert environment_findings(gather_snapshot(probe_te_import=False), EMULATED_RUN) == []


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", *args],
                          capture_output=True, text=True, check=False, timeout=300)


def test_real_doctor_on_this_machine():
    snapshot = gather_snapshot(probe_te_import=True)
    findings = environment_findings(snapshot)
    done = _doctor()
    assert done.returncode == (1 if any(f.severity == "error" for f in findings) else 0)
    assert "Traceback" not in done.stderr
    assert "TransformerEngine" in done.stdout and "torch" in done.stdout
    if not snapshot.has_gpu:
        assert NO_GPU in done.stdout
    strict = _doctor("--strict")
    assert strict.returncode == exit_code(findings, strict=True)
    if strict.returncode:
        assert strict.stdout.splitlines()[-1] == exit_reason(findings, strict=True)
    report = json.loads(_doctor("--format", "json", "--no-te-import").stdout)
    assert report["environment"]["python"] == snapshot.python
    assert {f["rule"] for f in report["findings"]} >= ({"FP8201"} if not snapshot.has_gpu
                                                       else set())


@pytest.mark.parametrize(("script", "gpu_name", "capability", "gpu_error"), [
    ('echo "NVIDIA H100 80GB HBM3, 9.0"', "NVIDIA H100 80GB HBM3", [9, 0], None),
    ('echo "NVIDIA L4, 8.9"; echo "NVIDIA L4, 8.9"', "NVIDIA L4", [8, 9], None),  # the first GPU
    ("exit 0", None, None, None),  # a driver with no GPU listed
    ('echo "NVIDIA-SMI has failed" >&2; exit 9', None, None,
     "nvidia-smi failed with exit status 9: NVIDIA-SMI has failed"),
])
def test_the_probe_reads_the_gpu_from_nvidia_smi(tmp_path, script, gpu_name, capability,
                                                 gpu_error):
    """Without torch in the process, the GPU comes from `nvidia-smi --query-gpu=name,compute_cap
    --format=csv,noheader` (faked here: this machine has no GPU; never run on a real one)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    code = ("import json; from foundry_fp8.environment import gather_snapshot; "
            "s = gather_snapshot(probe_te_import=False); print(json.dumps([s.gpu_name, "
            "s.capability, s.gpu_error]))")
    env = {**__import__("os").environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert json.loads(out) == [gpu_name, capability, gpu_error]


def test_a_te_without_package_metadata_has_no_version_and_is_not_imported(tmp_path,
                                                                            monkeypatch):
    """A source tree on PYTHONPATH: TE's own `__version__` reads the metadata that is missing,
    so the probe says "unknown" and never imports TE (which would pull in torch and CUDA)."""
    import sys

    from foundry_fp8.te import probe

    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)

    def no_metadata(name: str) -> str:
        raise probe.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(probe.metadata, "version", no_metadata)  # even where TE is installed
    assert probe.te_available() and probe.te_version() is None


# -- the probes' own limits: output read, time, what a failure is called -------------------------


def _fake_nvidia_smi(folder, script: str) -> None:
    fake = folder / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)


def _fake_te(folder, init: str) -> None:
    """A transformer_engine with package metadata (so the probe imports it) on sys.path."""
    (folder / "transformer_engine" / "pytorch").mkdir(parents=True)
    (folder / "transformer_engine" / "pytorch" / "__init__.py").write_text("")
    (folder / "transformer_engine" / "__init__.py").write_text(init)
    info = folder / "transformer_engine-2.8.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\n"
                                   "Version: 2.8.0\n")


def _gpu_finding(tmp_path, monkeypatch, script: str | None):
    """FP8201's message, with `script` as nvidia-smi (None: there is none on PATH)."""
    if script is not None:
        _fake_nvidia_smi(tmp_path, script)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else the GPU comes from torch
    snapshot = gather_snapshot(probe_te_import=False)
    return snapshot, {f.rule: f for f in environment_findings(snapshot)}.get("FP8201")


def test_a_probe_printing_endlessly_is_stopped_at_the_byte_limit(tmp_path):
    """An nvidia-smi printing 50 MB (QA: one printing forever took 46 s and 22 GB): the doctor
    reads at most PROBE_OUTPUT_LIMIT bytes, stops it, and says so in one line."""
    _fake_nvidia_smi(tmp_path, 'yes "NVIDIA H100 80GB HBM3, 9.0" | head -c 50000000')
    code = ("import json, resource, time; from foundry_fp8.environment import gather_snapshot; "
            "from foundry_fp8.lint.rules.environment import environment_findings; "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; t = time.monotonic(); "
            "s = gather_snapshot(probe_te_import=False); "
            "print(json.dumps([time.monotonic() - t, "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "
            "[f.message for f in environment_findings(s) if f.rule == 'FP8201']]))")
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, timeout=120).stdout
    seconds, grown_kib, messages = json.loads(out)
    assert seconds < 10 and grown_kib < 20_000, (seconds, grown_kib)
    message, = messages
    assert f"nvidia-smi printed more than {PROBE_OUTPUT_LIMIT >> 20} MiB" in message
    assert "\n" not in message


def test_the_reader_keeps_at_most_the_limit_and_stops_the_process():
    started = time.monotonic()
    done = run_probe([sys.executable, "-c", "print('x' * 50_000_000)"], timeout_s=60,
                     limit=10_000)
    assert time.monotonic() - started < 10
    assert done.stopped == "printed more than 10000 bytes of output"
    assert len(done.stdout) + len(done.stderr) <= 10_000 and done.returncode is None


def test_a_te_import_printing_endlessly_is_stopped(tmp_path, monkeypatch):
    _fake_te(tmp_path, "import sys\nfor _ in range(12_000): sys.stderr.write('warning ' * 512)\n"
             "raise SystemExit(3)\n")  # 50 MB: bounded, so that a broken reader cannot eat the memory
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started = time.monotonic()
    error = environment.te_import_error(timeout_s=60)
    assert time.monotonic() - started < 10
    assert error == (f"printed more than {PROBE_OUTPUT_LIMIT >> 20} MiB of output (the doctor's "
                     "limit), so it was stopped")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_a_hanging_te_import_is_announced_on_a_terminal_and_named_on_timeout(
        tmp_path, monkeypatch, capsys, terminal):
    """QA: a TE import that hangs left the doctor silent for its 120 s limit. On a terminal
    one line on stderr says what is running and for how long at most; stdout (JSON) stays clean,
    and the finding names the limit."""
    _fake_te(tmp_path, "import time\ntime.sleep(60)\n")
    _fake_nvidia_smi(tmp_path, 'echo "NVIDIA H100 80GB HBM3, 9.0"')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(environment, "TE_IMPORT_TIMEOUT_S", 1)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else the GPU comes from torch
    stderr = _Terminal()
    if terminal:
        monkeypatch.setattr(sys, "stderr", stderr)
    started = time.monotonic()
    assert main(["doctor", "--format", "json"]) == 1
    assert time.monotonic() - started < 10
    report = json.loads(capsys.readouterr().out)
    fp8206, = (f for f in report["findings"] if f["rule"] == "FP8206")
    assert "did not finish within 1 s (the doctor's limit), so it was stopped" in \
        fp8206["message"]
    expected = ("foundry-fp8 doctor: checking nvidia-smi (up to 20 s) and the TransformerEngine "
                "import (up to 1 s)...\n")
    assert stderr.getvalue() == (expected if terminal else "")


@pytest.mark.parametrize(("script", "message"), [
    (None, NO_GPU),  # no nvidia-smi: no driver, no GPU
    ("exit 0", NO_GPU),  # a driver that lists no GPU
    ("sleep 30", "no GPU found: nvidia-smi did not finish within 1 s, so it was stopped; "),
    ('echo "NVIDIA-SMI has failed because it couldnt communicate with the NVIDIA driver" >&2;'
     " exit 9", "no GPU found: nvidia-smi failed with exit status 9: NVIDIA-SMI has failed "
     "because it couldnt communicate with the NVIDIA driver; "),
    ('echo "NVIDIA-SMI has failed (on stdout, as the real one)"; exit 9',
     "no GPU found: nvidia-smi failed with exit status 9: NVIDIA-SMI has failed (on stdout, as "
     "the real one); "),
    ("kill -SEGV $$", "no GPU found: nvidia-smi was killed by signal SIGSEGV; "),
    ('echo "NVIDIA H100, nan"', "no GPU found: nvidia-smi printed no GPU name and compute "
     "capability but 'NVIDIA H100, nan'; "),
])
def test_a_failing_nvidia_smi_is_not_called_no_gpu(tmp_path, monkeypatch, script, message):
    """QA: a hung or failing nvidia-smi was reported as "no GPU ... the emulated backend works
    here": it is a driver problem to fix, and FP8201 says what nvidia-smi did."""
    monkeypatch.setattr(environment, "NVIDIA_SMI_TIMEOUT_S", 1)
    started = time.monotonic()
    snapshot, finding = _gpu_finding(tmp_path, monkeypatch, script)
    assert time.monotonic() - started < 8
    assert finding.message.startswith(message), finding.message
    if message != NO_GPU:
        assert "driver" in finding.message and "driver" in finding.fix
        assert snapshot.gpu_error and snapshot.gpu_name is None


def test_an_nvidia_smi_leaving_a_child_behind_is_read_at_once(tmp_path, monkeypatch):
    """Its child holds the output pipe open: the doctor reads what nvidia-smi printed when it
    exits, instead of waiting for the child until the time limit."""
    started = time.monotonic()
    snapshot, finding = _gpu_finding(tmp_path, monkeypatch,
                                     'echo "NVIDIA H100, 9.0"; (sleep 30) &')
    assert time.monotonic() - started < 5
    assert (snapshot.gpu_name, snapshot.capability, finding) == ("NVIDIA H100", (9, 0), None)


def test_the_gpu_row_says_why_the_gpu_is_unknown(capsys, monkeypatch):
    broken = replace(CPU, gpu_error="nvidia-smi failed with exit status 9: NVIDIA-SMI has failed")
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: broken)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GPU                  unknown (nvidia-smi failed with exit status 9: NVIDIA-SMI has " \
        "failed)\n" in out
    assert NO_GPU not in out


@pytest.mark.parametrize("te", ["1.5.0", "1.11.0", "1.12.0rc1", "1.12.0", "2.8.0"])
def test_a_te_older_than_te_swap_takes_is_not_ready(te, monkeypatch):
    """QA: TE 1.5 on an H100 passed `doctor --strict` ("ready for FP8 training") although
    te_swap's `backend: te` stops the run at its start for it. The doctor warns exactly where
    te_swap's own check (te.backend.require_te) refuses the installed TE."""
    from foundry_fp8.te import backend, probe

    monkeypatch.setattr(probe, "te_available", lambda: True)
    monkeypatch.setattr(probe, "te_version", lambda: parse_version(te))
    try:
        backend.require_te()
        refused = False
    except RuntimeError:
        refused = True
    machine = replace(H100, te=te, te_torch=te, te_core=te)
    assert rules(machine) == ([("FP8204", "warning")] if refused else [])
    assert refused == (te in ("1.5.0", "1.11.0"))
    assert rules(machine, TE_RUN) == []  # a run's te_swap says it itself, at its start


@pytest.mark.parametrize(("te", "core", "expected"), [
    ("2.9.0", "2.8.0", [("FP8205", "error")]),  # TE >= 2.9 checks at `import transformer_engine`
    ("2.18.0", "2.17.1", [("FP8205", "error")]),
    ("2.8.0", "2.7.0", []),  # before 2.9 only with the torch extension installed
    ("2.9.0", "2.9.0", []),
])
def test_te_core_and_metapackage_versions_differ_without_the_torch_extension(te, core,
                                                                              expected):
    """QA: `pip install transformer-engine[core]` at two versions passed the doctor (FP8205
    looked only where transformer-engine-torch is installed); TE 2.9's
    sanity_checks_for_pypi_installation (transformer_engine/common/__init__.py:195-212) fails
    `import transformer_engine` for it."""
    core_only = replace(H100, te=te, te_torch=None, te_core=core)
    assert rules(core_only) == expected


@pytest.mark.parametrize("value", ["", "-1", "0", "1", "0,1", "1,0", "0,0", "2", "abc", "0gpu",
                                   " 1", "+0", "0,-1,1", "0,5", "0,5,0", "1,0,1"])
@pytest.mark.parametrize("listed", [1, 2])
def test_visible_gpus_reads_cuda_visible_devices_as_torch_does(value, listed, monkeypatch):
    """The count of GPUs CUDA sees, against torch's own reading of the variable
    (`torch.cuda._parse_visible_devices`, trimmed at the first ordinal past the GPUs as its
    `_device_count_nvml` does)."""
    import torch.cuda

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    parsed = torch.cuda._parse_visible_devices()
    torch_count = next((i for i, ordinal in enumerate(parsed) if ordinal >= listed), len(parsed))
    assert environment.visible_gpus(value, listed) == torch_count


@pytest.mark.parametrize(("value", "hidden"), [("", True), ("-1", True), ("1", True),
                                               ("0,0", True), ("0", False), (None, False)])
def test_a_gpu_cuda_visible_devices_hides_is_not_ready(tmp_path, monkeypatch, value, hidden):
    """QA: with CUDA_VISIBLE_DEVICES='' on an H100 the doctor said "ready for FP8 training"
    (nvidia-smi ignores the variable) while torch and TE see no GPU."""
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    snapshot, finding = _gpu_finding(tmp_path, monkeypatch, 'echo "NVIDIA H100 80GB HBM3, 9.0"')
    assert snapshot.has_gpu is not hidden and snapshot.gpu_hidden is hidden
    assert snapshot.gpu_name == "NVIDIA H100 80GB HBM3"
    if hidden:
        assert finding.message == (
            f"no GPU visible to CUDA: nvidia-smi lists 1 GPU(s), but CUDA_VISIBLE_DEVICES="
            f"{value!r} hides every one from CUDA, so torch and TE see none")
        assert "CUDA_VISIBLE_DEVICES" in finding.fix and "driver" not in finding.fix
    else:
        assert finding is None


@pytest.mark.parametrize(("env", "named"), [
    ({"NVTE_DEBUG": "true"}, " (NVTE_DEBUG: TE reads it as an integer)"),
    ({"NVTE_DEBUG": "", "NVTE_FLASH_ATTN": ""}, " (NVTE_DEBUG, NVTE_FLASH_ATTN: TE reads them as "
                                                "an integer)"),
    ({"NVTE_DEBUG": "1", "NVTE_FLASH_ATTN": "x"}, " (NVTE_FLASH_ATTN: TE reads it as an integer)"),
    ({"NVTE_DEBUG": "1"}, None),
])
def test_an_nvte_variable_te_cannot_read_as_an_integer_is_named(tmp_path, monkeypatch, env,
                                                                named):
    """QA: `NVTE_DEBUG=true` makes `import transformer_engine.pytorch` raise int()'s ValueError
    (TE reads NVTE_DEBUG and NVTE_FLASH_ATTN with int() at import:
    pytorch/attention/dot_product_attention/utils.py:65-68, here in a stand-in TE doing the
    same); the doctor said so with the fix "rebuild TE against the installed torch"."""
    _fake_te(tmp_path, "import os\nint(os.getenv('NVTE_DEBUG', '0'))\n"
             "int(os.getenv('NVTE_FLASH_ATTN', '1'))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for name in [n for n in os.environ if n.startswith("NVTE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    error = environment.te_import_error(timeout_s=60)
    if named is None:
        assert error is None
        return
    bad = next(v for v in env.values() if not v.strip().isdigit())
    assert error == f"ValueError: invalid literal for int() with base 10: {bad!r}{named}"
    finding = environment_findings(replace(H100, te_import_error=error))[0]
    assert (finding.rule, finding.fix) == (
        "FP8206", "set the NVTE_ variable(s) named to an integer (0 or 1), or unset them")


def _dist(site, name: str, version: str, purelib: bool) -> None:
    """A dist-info as pip leaves it: METADATA and the wheel's WHEEL file."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: bdist_wheel (0.45.1)\n"
                                f"Root-Is-Purelib: {'true' if purelib else 'false'}\nTag: x\n")


@pytest.mark.parametrize(("packages", "purelib", "flagged"), [
    (["transformer-engine"], True, True),  # `pip install transformer-engine`: the metapackage
    (["transformer-engine"], False, False),  # a source build: one platform wheel, all inside
    (["transformer-engine", "transformer-engine-cu12", "transformer-engine-torch"], True, False),
])
def test_te_s_metapackage_alone_is_found_without_importing_it(tmp_path, packages, purelib,
                                                             flagged):
    """QA: `pip install transformer-engine` without `[pytorch]` installs TE's empty metapackage
    (TE setup.py: NVTE_BUILD_METAPACKAGE, install_requires=[]); `import transformer_engine`
    raises for it from TE 2.9 (common/__init__.py:214-221), and `doctor --no-te-import` said
    "ready for FP8 training". The WHEEL file tells it, as TE's own check reads it."""
    for name in packages:
        _dist(tmp_path, name, "2.9.0", purelib and name == "transformer-engine")
    code = ("import json; from foundry_fp8.environment import gather_snapshot; "
            "from foundry_fp8.lint.rules.environment import environment_findings; "
            "s = gather_snapshot(probe_te_import=False, probe_gpu=False); "
            "print(json.dumps([s.te, s.te_pure_wheel, [[f.rule, f.message, f.fix] "
            "for f in environment_findings(s)]]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env, timeout=120)
    te, pure, findings = json.loads(done.stdout)
    assert (te, pure) == ("2.9.0", purelib)
    fp8204 = [f for f in findings if f[0] == "FP8204"]
    assert fp8204 == ([["FP8204", "TransformerEngine 2.9.0 is its metapackage alone (`pip install "
                        "transformer-engine` without `[pytorch]`): no core library and no torch "
                        "extension, so `import transformer_engine.pytorch` fails (from TE 2.9: "
                        "'Found empty `transformer-engine` meta package installed'); with torch "
                        "installed `import llmfoundry` fails with it (its hf_checkpointer "
                        "catches only ModuleNotFoundError): no training starts here, BF16 and "
                        "the emulated backend included",
                        "pip install --no-build-isolation 'transformer-engine[pytorch]==2.9.0'"]]
                      if flagged else [])
