"""`foundry-fp8 doctor`: the environment FP8 training depends on, and what is wrong with it.

The machine is read by the torch-free probe `foundry_fp8.environment.gather_snapshot` (package
metadata, torch's version file, nvidia-smi, TE's import in a time-limited subprocess) and judged
by the FP82xx rules (`foundry_fp8.lint.rules.environment`). No probe can make the doctor fail;
an unknown value is shown as such. On a terminal, one line on stderr says which programs it
runs and for how long at most before it runs them (stdout, the JSON included, stays the report).

Exit codes: 0 nothing is broken (missing GPU or TE is reported, not failed: the emulated backend
runs anywhere); 1 an error finding (a broken TE install; torch, Composer or LLM-Foundry missing,
FP8214), or with `--strict` a warning too (one of those outside setup.cfg's range), i.e.
this machine cannot train FP8 with TE as it is (use `--strict` on GPU nodes and in their CI).
An info never fails. A non-zero exit ends the output with one line saying which findings caused it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from foundry_fp8.environment import STACK, Snapshot, gather_snapshot
from foundry_fp8.lint.registry import Finding
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.te.facts import BACKWARD_OVERRIDE_ENV, backward_override_effect

#: The version of `--format json`'s layout, its `schema` key: raised when a key is renamed,
#: removed or changes meaning (a key added to `environment` keeps it).
JSON_SCHEMA = 1
#: The text report's last line where nothing fails `--strict`.
READY = "ready for FP8 training with TransformerEngine"
#: What READY adds where TE is installed but its import was not tried (`--no-te-import`): the
#: package metadata can be right while the import fails (a core package without the torch
#: extension, a torch extension built for another torch), and that import is what runs first.
UNTRIED = (", as far as package metadata tells: TE's import was not tried (--no-te-import); run "
           "the doctor without it to know")
#: The most characters of a variable's value a row shows (the finding quotes more).
_ROW_VALUE_CHARS = 80


def _short(value: str | None) -> str:
    """`value`'s repr, cut to _ROW_VALUE_CHARS."""
    shown = repr(value)
    return shown if len(shown) <= _ROW_VALUE_CHARS else shown[:_ROW_VALUE_CHARS - 3] + "..."


def _rows(s: Snapshot) -> list[tuple[str, str]]:
    def shown(value: str | None, absent: str = "not installed") -> str:
        return value if value is not None else absent

    shadows = dict(s.shadowed)

    def version(field: str) -> str:
        """The installed version, and the folder Python imports instead where one shadows it."""
        if field not in shadows:
            return shown(getattr(s, field))
        return (f"{shown(getattr(s, field))} installed, but Python imports {field} from "
                f"{_short(shadows[field])} (PYTHONPATH, or the folder of the script run): that "
                "one runs")

    torch = version("torch")
    if s.torch is not None and "torch" not in shadows:
        torch += f" (CUDA {s.torch_cuda or 'none: CPU build'}, cuDNN {s.cudnn or 'none'})"
    gpu = "none" if not s.has_gpu else s.gpu_seen or f"{s.gpu_name} (compute capability " \
        f"{s.capability[0]}.{s.capability[1]})"
    if s.gpu_hidden:
        gpu = f"{s.gpu_name}, hidden from CUDA by CUDA_VISIBLE_DEVICES=" \
            f"{_short(s.cuda_visible_devices)}"
    elif not s.has_gpu and (s.gpu_error or s.gpu_name):
        gpu = f"unknown ({s.gpu_error})" if s.gpu_error else s.gpu_name
    if s.driver_cuda is not None:
        gpu += f"; its driver supports CUDA {s.driver_cuda} at most"
    te = shown(s.te)
    if s.te is not None:
        parts = [f"torch extension {shown(s.te_torch, 'no pip package')}",
                 f"core {s.te_core_package} {s.te_core}" if s.te_core else "core: no pip package"]
        if s.te_import_checked:
            parts.append("imports" if not s.te_import_error else "import FAILS")
        te += f" ({', '.join(parts)})"
    rows = [("python", s.python), ("torch", torch), ("GPU", gpu), ("TransformerEngine", te),
            *((label, version(field)) for field, label in STACK.values()
              if field != "torch"),  # torch has its row above, with its CUDA
            ("flash-attn", shown(s.flash_attn) + (" (import FAILS)" if s.flash_attn_import_error
                                                   else " (imports)"
                                                   if s.flash_attn_import_checked else "")),
            ("accelerate", shown(s.accelerate)),
            ("deepspeed", shown(s.deepspeed))]
    if s.nvte_backward_override is not None:  # TE's, so it shows only where it is set
        rows.append((BACKWARD_OVERRIDE_ENV, f"{_short(s.nvte_backward_override)}: "
                     + backward_override_effect(s.nvte_backward_override, s.te_version)))
    return rows


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
                        help="text: a table of versions, then the findings; json: {schema, "
                        "environment, findings, exit_code, exit_reason}; default text")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on warnings too, i.e. unless this machine can train FP8 "
                        "with TransformerEngine (infos never fail); default off: errors only")
    parser.add_argument("--no-te-import", action="store_true",
                        help="skip importing TransformerEngine in a subprocess (faster); default "
                        "off: a TE build that does not import is found")


def _progress(what: str) -> None:
    """Tell a person at a terminal what the doctor waits for; nothing otherwise (a script reads
    stdout, and stderr stays quiet)."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            print(f"foundry-fp8 doctor: {what}...", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or failing stderr must not stop the doctor
        pass


def run(args: argparse.Namespace) -> int:
    snapshot = gather_snapshot(probe_te_import=not args.no_te_import, progress=_progress)
    findings = environment_findings(snapshot)
    code, reason = exit_code(findings, args.strict), exit_reason(findings, args.strict)
    if args.format == "json":
        print(json.dumps({"schema": JSON_SCHEMA, "environment": asdict(snapshot),
                          "findings": [asdict(f) for f in findings], "exit_code": code,
                          "exit_reason": reason}, indent=2))
        return code
    width = max(len(name) for name, _ in _rows(snapshot))
    for name, value in _rows(snapshot):
        print(f"{name:<{width}}  {value}")
    print()
    for f in findings:
        print(f"{f.severity} {f.rule} {f.key}: {f.message} (fix: {f.fix})")
    if not failing(findings, strict=True):  # infos (FP8209) leave the machine FP8-ready
        print(READY + (UNTRIED if snapshot.te is not None and not snapshot.te_import_checked
                       else ""))
    if reason:
        print(reason)
    return code
