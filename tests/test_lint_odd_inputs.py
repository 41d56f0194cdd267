"""Odd bytes and YAML a user's file may hold that tests/test_lint_robust.py does not write
(other encodings, tags, keys that are collections, anchors given twice, interpolation cycles):
`foundry-fp8 lint` answers each with one line naming the file and its place, exit 2, no
traceback, and never hangs (the CLI runs in a child process under a timeout)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HANG_GUARD_S = 120

#: name: (bytes, what the one line says)
ODD = {
    "utf16": ("precision: amp_fp8\n".encode("utf-16"), ":1:1: cannot read: not UTF-8 text"),
    "binary": (bytes(range(256)) * 4, "cannot read: not UTF-8 text (byte 0x80)"),
    "python-tag": (b"model: !!python/object/apply:os.system ['true']\n",
                   ":1:8: cannot load key model: could not determine a constructor"),
    "custom-tag": (b"model: !foo {name: x}\n", ":1:8: cannot load key model: could not"),
    "set-tag": (b"model: !!set {a, b}\n", ":1: cannot load key model"),
    "sequence-key": (b"? [a, b]\n: 1\n", "keys must be strings"),
    "mapping-key": (b"{a: 1}: 2\n", "keys must be strings"),
    "anchor-twice": (b"a: &x 1\nb: &x 2\nc: *x\n", ":2:4: not valid YAML"),
    "yaml-9.9": (b"%YAML 9.9\n---\nprecision: amp_fp8\n", ":1:1: not valid YAML"),
    "merge-scalar": (b"model: {<<: 1}\n", ":1:13: cannot load key model"),
    "interpolation-cycle": (b"a: ${b}\nb: ${a}\nmax_seq_len: ${a}\n",
                            "cannot resolve key a: Recursive interpolation"),
    "interpolation-self": (b"max_seq_len: ${max_seq_len}\n",
                           "cannot resolve key max_seq_len: Recursive interpolation"),
    "select-cycle": (b"variables:\n  a: ${oc.select:variables.b}\n  b: ${variables.a}\n"
                     b"max_seq_len: ${variables.a}\n", ":2: cannot resolve key variables.a"),
    "key-of-2mb": (b"x" * 2_000_000 + b": 1\n", "not valid YAML"),
}


def test_each_odd_file_is_one_line_exit_2_without_a_hang(tmp_path):
    paths = []
    for name, (data, _) in ODD.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        paths.append(path)
    try:
        done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *map(str, paths)],
                              capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"foundry-fp8 lint ran past {HANG_GUARD_S} s on {len(paths)} small files")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    wrong = []
    for path, (name, (_, said)) in zip(paths, ODD.items(), strict=True):
        own = [line for line in lines if line.startswith(f"error: {path}:")
               or line.startswith(f"error: {path} ")]
        if len(own) != 1 or said not in own[0]:
            wrong.append((name, own))
    assert not wrong
    assert len(lines) == len(paths)
