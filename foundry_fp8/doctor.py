"""`foundry-fp8 doctor`: the environment FP8 training depends on, and what is wrong with it.

Versions come from package metadata (no import); torch is imported for its CUDA build, cuDNN and
the GPU. TransformerEngine is imported only in a subprocess, with a time limit: a TE extension
built for another torch can fail at import or crash the interpreter, and the doctor must report
that, not die of it. No probe can make the doctor fail; an unknown value is shown as such.

Exit codes: 0 nothing is broken (missing GPU or TE is reported, not failed: the emulated backend
runs anywhere); 1 an error finding (a broken TE install), or with `--strict` a warning too, i.e.
this machine cannot train FP8 with TE as it is (use `--strict` on GPU nodes and in their CI).
An info never fails. A non-zero exit ends the output with one line saying which findings caused it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, replace
from importlib import metadata, util
from typing import Any

from foundry_fp8.environment import Snapshot, environment_findings
from foundry_fp8.lint.rules import Finding

#: Seconds allowed for `import transformer_engine.pytorch` in the subprocess (it loads CUDA).
TE_IMPORT_TIMEOUT_S = 120
TE_CORE_PACKAGES = ("transformer-engine-cu12", "transformer-engine-cu13")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except Exception:  # not installed, or a broken dist-info: neither may stop the doctor
        return None


def _torch_facts() -> dict[str, Any]:
    """torch's CUDA build, cuDNN and the first GPU; {} when torch cannot be imported."""
    try:
        import torch
    except Exception:
        return {}
    facts: dict[str, Any] = {"torch_cuda": torch.version.cuda}
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        facts["cudnn"] = str(cudnn) if cudnn else None
        if torch.cuda.is_available():
            facts["gpu_name"] = torch.cuda.get_device_name(0)
            facts["capability"] = tuple(torch.cuda.get_device_capability(0))
    except Exception as e:  # a driver problem is worth showing, not dying of
        facts["gpu_name"] = f"unknown ({type(e).__name__}: {e})"
    return facts


def te_import_error(timeout_s: float = TE_IMPORT_TIMEOUT_S) -> str | None:
    """Why `import transformer_engine.pytorch` fails in a fresh interpreter (None: it imports).
    torch is imported first, as in every training script: TE's core library finds NCCL only
    through the libraries torch loads, so TE imported alone can fail on a healthy install."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch, transformer_engine.pytorch"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout_s:.0f} s"
    except OSError as e:
        return f"could not start Python: {e}"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def gather_snapshot(probe_te_import: bool = True) -> Snapshot:
    """This machine's snapshot. `probe_te_import` spends a subprocess importing TE."""
    core_package = next((p for p in TE_CORE_PACKAGES if _version(p)), None)
    te = _version("transformer-engine")
    if te is None and util.find_spec("transformer_engine") is not None:
        te = "unknown (no package metadata)"
    snapshot = Snapshot(
        python=platform.python_version(), torch=_version("torch"),
        te=te, te_torch=_version("transformer-engine-torch"),
        te_core=_version(core_package) if core_package else None, te_core_package=core_package,
        composer=_version("mosaicml"), llmfoundry=_version("llm-foundry"),
        flash_attn=_version("flash-attn"), accelerate=_version("accelerate"),
        deepspeed=_version("deepspeed"), **_torch_facts())
    if probe_te_import and te is not None:
        snapshot = replace(snapshot, te_import_checked=True, te_import_error=te_import_error())
    return snapshot


def config_environment_findings(config: Mapping[str, Any]) -> list[Finding]:
    """Version rules for a run's resolved config on this machine, for the `fp8_lint` callback.

    Skips the TE import subprocess: the run imports TE itself moments later.
    """
    return environment_findings(gather_snapshot(probe_te_import=False), config)


def _rows(s: Snapshot) -> list[tuple[str, str]]:
    def shown(value: str | None, absent: str = "not installed") -> str:
        return value if value is not None else absent

    torch = shown(s.torch)
    if s.torch is not None:
        torch += f" (CUDA {s.torch_cuda or 'none: CPU build'}, cuDNN {s.cudnn or 'none'})"
    gpu = "none" if not s.has_gpu else f"{s.gpu_name} (compute capability " \
        f"{s.capability[0]}.{s.capability[1]})"
    if s.gpu_name and not s.has_gpu:
        gpu = s.gpu_name
    te = shown(s.te)
    if s.te is not None:
        parts = [f"torch extension {shown(s.te_torch, 'no pip package')}",
                 f"core {s.te_core_package} {s.te_core}" if s.te_core else "core: no pip package"]
        if s.te_import_checked:
            parts.append("imports" if not s.te_import_error else "import FAILS")
        te += f" ({', '.join(parts)})"
    return [("python", s.python), ("torch", torch), ("GPU", gpu), ("TransformerEngine", te),
            ("Composer (mosaicml)", shown(s.composer)), ("LLM-Foundry", shown(s.llmfoundry)),
            ("flash-attn", shown(s.flash_attn)), ("accelerate", shown(s.accelerate)),
            ("deepspeed", shown(s.deepspeed))]


def failing(findings: list[Finding], strict: bool) -> list[Finding]:
    """The findings that fail the doctor: errors, and with `strict` warnings; never infos."""
    severities = ("error", "warning") if strict else ("error",)
    return [f for f in findings if f.severity in severities]


def exit_code(findings: list[Finding], strict: bool) -> int:
    return int(bool(failing(findings, strict)))


def exit_reason(findings: list[Finding], strict: bool) -> str | None:
    """One line on why the doctor exits non-zero; None when it exits 0."""
    bad = failing(findings, strict)
    if not bad:
        return None
    errors = sum(f.severity == "error" for f in bad)
    warnings = len(bad) - errors
    what = " and ".join(f"{n} {kind}{'s' * (n > 1)}"
                        for kind, n in (("error", errors), ("warning", warnings)) if n)
    rules = ", ".join(dict.fromkeys(f.rule for f in bad))
    strict_note = " (with --strict, warnings fail too)" if warnings else ""
    return f"foundry-fp8 doctor: exit 1 because of {what}: {rules}{strict_note}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="text: a table of versions, then the findings; json: {environment, "
                        "findings, exit_code, exit_reason}; default text")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on warnings too, i.e. unless this machine can train FP8 "
                        "with TransformerEngine (infos never fail); default off: errors only")
    parser.add_argument("--no-te-import", action="store_true",
                        help="skip importing TransformerEngine in a subprocess (faster); default "
                        "off: a TE build that does not import is found")


def run(args: argparse.Namespace) -> int:
    snapshot = gather_snapshot(probe_te_import=not args.no_te_import)
    findings = environment_findings(snapshot)
    code, reason = exit_code(findings, args.strict), exit_reason(findings, args.strict)
    if args.format == "json":
        print(json.dumps({"environment": asdict(snapshot),
                          "findings": [asdict(f) for f in findings], "exit_code": code,
                          "exit_reason": reason}, indent=2))
        return code
    width = max(len(name) for name, _ in _rows(snapshot))
    for name, value in _rows(snapshot):
        print(f"{name:<{width}}  {value}")
    print()
    for f in findings:
        print(f"{f.severity} {f.rule} {f.key}: {f.message} (fix: {f.fix})")
    if not findings:
        print("ready for FP8 training with TransformerEngine")
    if reason:
        print(reason)
    return code
