"""The linter's three outputs, from one report `{"files": [{path, error, findings}]}`.

Text is a table per file for people (colour only on a terminal, never with NO_COLOR set);
JSON keeps the contract of issue #5 plus `column` (and `skipped`, why a file had nothing to
lint; `path_bytes`, a path's bytes where they are not UTF-8); SARIF 2.1.0 feeds code-scanning
UIs. Both are valid UTF-8 whatever a file's name.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from foundry_fp8 import __version__
from foundry_fp8.health.table import one_line
from foundry_fp8.lint.load import error_location
from foundry_fp8.lint.registry import SEVERITIES
from foundry_fp8.lint.rules import all_rules

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVELS = {"error": "error", "warning": "warning", "info": "note"}
#: A lone surrogate: what Python holds for a byte the file-system encoding could not decode.
_SURROGATE = re.compile("[\ud800-\udfff]")
_COLOURS = {"error": "31", "warning": "33", "info": "36", "dim": "2", "bold": "1"}


def use_colour(is_tty: bool, environ: Mapping[str, str]) -> bool:
    """Colour on a terminal unless NO_COLOR is set to anything non-empty (no-color.org) or
    TERM is `dumb` (a terminal without escape codes: Emacs' shell; git and grep turn theirs
    off there too). An unset TERM keeps colour (Windows terminals set none)."""
    return is_tty and not environ.get("NO_COLOR") and environ.get("TERM") != "dumb"


def _paint(text: str, style: str, colour: bool) -> str:
    return f"\033[{_COLOURS[style]}m{text}\033[0m" if colour else text


def _where(finding: Mapping[str, Any]) -> str:
    line, column = finding.get("line"), finding.get("column")
    if line is None:
        return "-"
    return f"{line}:{column}" if column else str(line)


def render_text(report: Mapping[str, Any], colour: bool = False) -> str:
    """One table per file with findings (location, severity, rule, key, message, fix)."""
    out: list[str] = []
    counts = dict.fromkeys(SEVERITIES, 0)
    for entry in report["files"]:
        findings = [{**f, **{k: one_line(f[k]) for k in ("key", "message", "fix")}} for f in
                    sorted(entry["findings"], key=lambda f: (f["line"] or 0, f["column"] or 0))]
        path = one_line(entry["path"])
        if entry.get("skipped"):
            out += [_paint(path, "bold", colour), f"  skipped: {one_line(entry['skipped'])}", ""]
        if entry["error"] or not findings:
            continue
        out.append(_paint(path, "bold", colour))
        widths = [max(len(_where(f)) for f in findings),
                  max(len(f["severity"]) for f in findings),
                  max(len(f["rule"]) for f in findings),
                  max(len(f["key"]) for f in findings)]
        for f in findings:
            counts[f["severity"]] += 1
            cells = [_where(f).ljust(widths[0]),
                     _paint(f["severity"].ljust(widths[1]), f["severity"], colour),
                     f["rule"].ljust(widths[2]), f["key"].ljust(widths[3])]
            out.append("  " + "  ".join(cells) + "  " + f["message"])
            indent = " " * (2 + sum(widths) + 2 * len(widths))
            out.append(indent + _paint(f"fix: {f['fix']}", "dim", colour))
        out.append("")
    unreadable = sum(1 for e in report["files"] if e["error"])
    summary = (f"{len(report['files']) - unreadable} file(s) linted: {counts['error']} "
               f"error(s), {counts['warning']} warning(s), {counts['info']} info")
    if unreadable:
        summary += f"; {unreadable} path(s) could not be linted"
    skipped = sum(1 for e in report["files"] if e.get("skipped"))
    if skipped:
        summary += f"; {skipped} skipped (nothing to lint)"
    out.append(summary)
    return "\n".join(out)


def _unicode(value: Any) -> Any:
    """`value` with every str made valid Unicode: a file name's undecodable byte, held as a
    lone surrogate (PEP 383), becomes U+FFFD. json.dumps would write it as `\\udcff`, which
    strict JSON readers refuse and jq reads as U+FFFD anyway."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, Mapping):
        return {k: _unicode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unicode(v) for v in value]
    return value


def _dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(_unicode(document), indent=2)


def render_json(report: Mapping[str, Any]) -> str:
    """The report as JSON. A path that is not valid UTF-8 (`bad\\xff.yaml` on Linux) keeps a
    readable `path` (U+FFFD for each undecodable byte) and gains `path_bytes`: its file-system
    bytes in base64 (ripgrep's --json convention), which name the file (`base64 -d`)."""
    files = [{**entry, "path_bytes": base64.b64encode(os.fsencode(entry["path"])).decode()}
             if entry["path"] and _SURROGATE.search(entry["path"]) else entry
             for entry in report["files"]]
    return _dumps({**report, "files": files})


def _uri(path: str) -> str:
    """A SARIF artifact URI: relative paths stay relative (resolved against the repo root by
    code-scanning UIs), absolute ones become file:// URIs; both percent-encoded as a URI must be
    (`a#1.yaml` would otherwise name `a` with a fragment; `<stdin>` has characters no URI has),
    from the name's file-system bytes (RFC 3986 section 2.1: `bad\\xff.yaml` is `bad%FF.yaml`)."""
    p = Path(path)
    return p.as_uri() if p.is_absolute() else quote(os.fsencode(p.as_posix()))


def _location(path: str, line: int | None, column: int | None) -> dict[str, Any]:
    physical: dict[str, Any] = {"artifactLocation": {"uri": _uri(path)}}
    if line is not None:
        physical["region"] = {"startLine": line, **({"startColumn": column} if column else {})}
    return {"physicalLocation": physical}


def render_sarif(report: Mapping[str, Any]) -> str:
    """A SARIF 2.1.0 log: one run, our rules as reportingDescriptors, one result per finding;
    files that could not be linted become error notifications of the invocation, at the line
    their message names."""
    known = all_rules()
    index = {rule.id: i for i, rule in enumerate(known)}
    rules = [{"id": rule.id, "name": rule.id,
              "shortDescription": {"text": rule.summary.replace("`", "")},
              "fullDescription": {"text": rule.rationale},
              "help": {"text": f"{rule.rationale}\nFix: {rule.fix}\nSource: {rule.source}"},
              "defaultConfiguration": {"level": SARIF_LEVELS[rule.severity]}}
             for rule in known]
    results = []
    notifications = []
    for entry in report["files"]:
        if entry["error"]:
            notifications.append({"level": "error", "message": {"text": entry["error"]},
                                  "locations": [_location(*error_location(
                                      entry["error"], entry["path"]))] if entry["path"] else []})
        for f in entry["findings"]:
            result: dict[str, Any] = {
                "ruleId": f["rule"], "level": SARIF_LEVELS[f["severity"]],
                "message": {"text": f"{f['key']}: {f['message']} (fix: {f['fix']})"},
                "locations": [_location(entry["path"], f["line"], f["column"])]}
            if f["rule"] in index:
                result["ruleIndex"] = index[f["rule"]]
            results.append(result)
    run = {"tool": {"driver": {"name": "foundry-fp8 lint", "version": __version__,
                               "rules": rules}},
           "invocations": [{"executionSuccessful": not notifications,
                            "toolExecutionNotifications": notifications}],
           "results": results}
    return _dumps({"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]})
