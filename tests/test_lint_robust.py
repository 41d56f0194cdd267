"""`foundry-fp8 lint` never crashes and never hangs: every input it cannot lint gives exit 2 and
one line naming the file, with no traceback (issue 14). A hang would trip the subprocess time
limit, which is a guard, not a speed target (speed: benchmarks/lint_speed.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint import load
from foundry_fp8.lint.cli import exit_code, lint_file
from foundry_fp8.lint.load import (
    MAX_BYTES,
    MAX_DEPTH,
    MAX_EXPANDED_NODES,
    MAX_INTERPOLATIONS,
    LintInputError,
    read_text,
)
from foundry_fp8.lint.registry import MAX_HITS

HANG_GUARD_S = 60


def _lint(*paths: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *map(str, paths)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)


def _one_line_exit_2(done: subprocess.CompletedProcess, path: Path, snippet: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}"), done.stderr
    assert snippet in errors[0], errors[0]


def _billion_laughs() -> str:
    text, previous = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n', "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]\n"
        previous = name
    return text


def _deep_aliases(levels: int = 40, chain: int = 15) -> str:
    """Each anchor nested `levels` deep around the previous one: within the text's depth bound
    (MAX_DEPTH), yet nested levels x chain deep once the aliases are followed."""
    text = f"v0: &a0 {'[' * levels}1{']' * levels}\n"
    for i in range(1, chain):
        text += f"v{i}: &a{i} {'[' * levels}*a{i - 1}{']' * levels}\n"
    return text


@pytest.mark.parametrize(("text", "snippet"), [
    ("a: " + "[" * 1000 + "]" * 1000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    ("".join(" " * i + f"k{i}:\n" for i in range(1000)) + " " * 1000 + "x: 1\n",
     f"nested more than {MAX_DEPTH} levels"),
    ("a: " + "[" * 200_000 + "]" * 200_000 + "\n", "nested more than"),  # libyaml would crash
    ("max_seq_len: " + "9" * 5000 + "\n", ":1:14: an integer of 5000 digits"),
    (_billion_laughs(), f"more than {MAX_EXPANDED_NODES} values"),
    ("distributed_type: 'NO'\n" + _billion_laughs(), "an alias bomb"),  # Accelerate-shaped
    ("a: &a [*a]\nmodel: *a\n", ":1:4: an alias refers to a value that contains it"),
    ("model: &m\n  name: mpt_causal_lm\n  sub: *m\n", ":1:8: an alias refers to a value"),
    ("a: &a\n  b: 1\n  <<: *a\n", "a recursive alias"),  # a merge key naming its own mapping
    ("x: &x {k: [&y [1, *y]]}\n", ":1:12: an alias refers to a value"),  # the cycle deeper down
    ("seed: 1\nfoo: " + "${" * 3000 + "seed" + "}" * 3000 + "\n",  # omegaconf: 4 s, then fails
     f":2:6: interpolations nested more than {MAX_DEPTH} levels"),
    (_deep_aliases() + "model: {name: mpt_causal_lm, x: *a14}\n",  # the 51st level: a13's
     f":14:19: nested more than {MAX_DEPTH} levels deep at `model.x.0...0.0`, once its aliases "
     "are followed"),
    ("model: &m\n  name: mpt_causal_lm\n  ffn_config:\n    inner:\n      again: *m\n",
     ":1:8: an alias refers to a value"),  # named at the anchor, not where the alias is
], ids=["flow-1000", "block-1000", "flow-200000", "5000-digits", "laughs", "laughs-accelerate",
        "self-sequence", "self-mapping", "self-merge", "inner-cycle", "interpolation-3000",
        "deep-aliases", "self-nested"])
def test_hostile_yaml_is_refused_in_one_line(tmp_path, text, snippet):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    _one_line_exit_2(_lint(path), path, snippet)


def test_a_value_of_many_interpolations_is_refused_at_the_one_past_the_bound(tmp_path):
    """60,000 interpolations in one string took omegaconf's grammar 32 s to resolve; the file is
    refused at the interpolation past MAX_INTERPOLATIONS (its column: 7, plus 7 per `${seed}`
    before it), and one at the bound is linted (FP8009 names `foo`, not exit 2)."""
    path = tmp_path / "many.yaml"
    path.write_text("seed: 1\nfoo: '" + "${seed}" * (MAX_INTERPOLATIONS + 1) + "'\n")
    _one_line_exit_2(_lint(path), path, f":2:{7 + 7 * MAX_INTERPOLATIONS}: more than "
                     f"{MAX_INTERPOLATIONS} interpolations")
    path.write_text("seed: 1\nfoo: '" + "${seed}" * MAX_INTERPOLATIONS + "'\n")
    done = _lint(path)
    assert done.returncode == 1 and not done.stderr and "FP8009" in done.stdout, done.stderr


@pytest.mark.parametrize(("text", "snippet"), [
    ("[" * 100_000 + "]" * 100_000, f":1:{MAX_DEPTH + 1}: nested more than {MAX_DEPTH} levels"),
    ('{"zero_optimization": {}, "train_batch_size":\n  ' + "9" * 5000 + "}",
     ":2:3: an integer of 5000 digits"),
], ids=["deep", "5000-digits"])
def test_json_python_cannot_read_is_refused_at_its_line(tmp_path, text, snippet):
    path = tmp_path / "ds.json"
    path.write_text(text)
    _one_line_exit_2(_lint(path), path, snippet)


def test_a_name_too_long_is_one_line(tmp_path):
    path = tmp_path / ("a" * 300 + ".yaml")
    _one_line_exit_2(_lint(path), path, "cannot read: File name too long")


def test_a_subfolder_that_cannot_be_listed_is_reported_not_skipped(tmp_path):
    """Its configs would go unlinted. A folder whose path is longer than PATH_MAX cannot be
    listed by that path, also by root (for whom a chmod 0 folder is readable)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.yaml").write_text("seed: 1\n")
    fd = os.open(tree, os.O_RDONLY)
    for _ in range(os.pathconf(tree, "PC_PATH_MAX") // 200 + 1):
        os.mkdir("d" * 200, dir_fd=fd)
        inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    done = _lint(tree)
    _one_line_exit_2(done, tree / ("d" * 200), ": cannot read: File name too long")
    assert "1 file(s) linted" in done.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root may search any folder")
def test_a_folder_we_may_not_search_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "x.yaml").write_text("seed: 1\n")
    (tmp_path / "ok.yaml").write_text("seed: 1\n")
    locked.chmod(0)
    try:
        _one_line_exit_2(_lint(locked / "x.yaml"), locked / "x.yaml", "Permission denied")
        done = _lint(tmp_path)
        _one_line_exit_2(done, locked, "cannot read: Permission denied")
        assert "1 file(s) linted" in done.stdout
    finally:
        locked.chmod(0o700)


ACCELERATE_DS = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                 "deepspeed_config:\n  deepspeed_config_file: {}\n")


def _fp8109(path: Path) -> list[tuple[str, int, str]]:
    done = _lint(path, "--format", "json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return [(f["rule"], f["line"], f["message"])
            for f in json.loads(done.stdout)["files"][0]["findings"]]


@pytest.mark.parametrize(("name", "why"), [
    ("~nosuchuser/ds.json", "not found next to this file"),  # Accelerate does not expand `~`
    ("a" * 300 + ".json", "could not be looked for (File name too long)"),
])
def test_a_deepspeed_config_file_we_cannot_look_for_is_fp8109(tmp_path, name, why):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_DS.format(name))
    (rule, line, message), = _fp8109(path)
    assert (rule, line) == ("FP8109", 4) and why in message, message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may search any folder")
def test_a_deepspeed_config_file_in_a_folder_we_may_not_search_is_fp8109(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "ds.json").write_text("{}")
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_DS.format("locked/ds.json"))
    locked.chmod(0)
    try:
        (rule, line, message), = _fp8109(path)
    finally:
        locked.chmod(0o700)
    assert (rule, line) == ("FP8109", 4) and "(Permission denied)" in message, message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_alone_or_in_a_folder_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes: never here
    _one_line_exit_2(_lint(fifo), fifo, "not a regular file")
    folder = tmp_path / "configs"
    folder.mkdir()
    os.mkfifo(folder / "x.yaml")
    _one_line_exit_2(_lint(folder), folder / "x.yaml", "not a regular file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_regular_file_whose_read_would_block_is_refused_not_waited_on(tmp_path, monkeypatch):
    """/proc/kmsg is a regular file of size 0 whose read waits for the kernel's next message
    (before: `foundry-fp8 lint /proc/kmsg` hung). Here a FIFO held open by a writer, which the
    stat checks are told is regular, stands in for it: its read waits for data that never
    comes. Reading /proc/kmsg itself in a test would consume the kernel's log."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer: a read waits, never ends
    monkeypatch.setattr(load, "stat", SimpleNamespace(S_ISDIR=stat.S_ISDIR,
                                                      S_ISREG=lambda mode: True))
    outcome: dict[str, str] = {}

    def read() -> None:
        try:
            outcome["text"] = read_text(fifo)
        except LintInputError as e:
            outcome["error"] = str(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(HANG_GUARD_S / 6)
    try:
        assert not reader.is_alive(), "read_text waited on a read that blocks"
        assert outcome == {"error": f"{fifo}: cannot read without blocking (a special file such "
                           "as /proc/kmsg, not a config); refusing to wait for it"}
    finally:
        os.write(writer, b"x")  # lets a waiting read (before the fix) end
        os.close(writer)
        reader.join(5)


def test_text_that_is_not_utf8_is_named_at_its_line_and_column(tmp_path):
    """Before: 'not UTF-8 text (byte 30)', an offset in the file."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("precision: fp32\nrun_name: café\n".encode("latin-1"))
    _one_line_exit_2(_lint(path), path, f"{path}:2:14: cannot read: not UTF-8 text (byte 0xe9)")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_dev_zero_is_refused():
    _one_line_exit_2(_lint("/dev/zero"), Path("/dev/zero"), "not a regular file")


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024 * 1024)  # sparse: 64 GiB that would never fit in memory
    _one_line_exit_2(_lint(path), path, f"more than the {MAX_BYTES}")


_scalars = (st.none() | st.booleans() | st.integers() | st.integers(10 ** 4000, 10 ** 4400)
            | st.floats() | st.text(max_size=12)
            | st.sampled_from(["${variables.x}", "${oc.env:HOME}", "${", "amp_fp8", "te",
                               "te_ln_mlp", "emulate", "fp8", "NO", "DEEPSPEED", "(false,)"]))
_keys = st.text(max_size=10) | st.sampled_from([
    "precision", "model", "models", "parameters", "image", "fsdp_config", "algorithms",
    "callbacks", "loggers", "te_swap", "fp8_stats", "fp8_state", "fc_type", "ffn_config",
    "ffn_config_defaults", "name", "mpt_causal_lm", "mixed_precision", "distributed_type",
    "fp8_config", "override_linear_precision", "deepspeed_config", "variables", "loss_fn",
    "activation_checkpointing", "te_checkpoint_wrapper", "save_folder", "zero_optimization"])
_documents = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(_keys, inner, max_size=5), max_leaves=25)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(document=_documents, depth=st.integers(0, 130), suffix=st.sampled_from([".yaml", ".json"]))
def test_any_yaml_structure_lints_or_fails_in_one_line(tmp_path, document, depth, suffix):
    """Property: whatever structure and values a file holds (nested past the depth bound,
    integers past Python's digit limit, NaN, interpolations, Accelerate/MCLI/eval shapes), the
    linter returns findings or one line naming the file, never an exception."""
    for _ in range(depth):
        document = {"k": document}
    path = tmp_path / f"doc{suffix}"
    try:
        path.write_text(yaml.safe_dump(document) if suffix == ".yaml" else
                        json.dumps(document, default=str))
    except (ValueError, RecursionError):
        return  # a document the writers themselves cannot write
    entry = lint_file(path, 1, Snapshot(python="3"))
    assert exit_code({"files": [entry]}) in (0, 1, 2)
    if entry["error"]:
        assert "\n" not in entry["error"] and entry["error"].startswith(str(path))
    for f in entry["findings"]:
        assert f["severity"] in ("error", "warning", "info") and f["message"] and f["fix"]


def test_an_accelerate_config_with_deep_aliases_is_refused_at_its_line(tmp_path):
    """PyYAML would read it; LLM-Foundry's omegaconf would not: the bound is the same for every
    kind of config, and named where the level past it opens (line 15: a13's 10th list)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: 'NO'\n" + _deep_aliases())
    _one_line_exit_2(_lint(path), path, f":15:20: nested more than {MAX_DEPTH} levels deep at "
                     "`v14.0.0...0.0`, once its aliases are followed")


# -- the bounds are real: within them a file loads, past them one line names where ------------

def _maps(levels: int) -> str:
    """A train config whose `model` holds mappings nested `levels` deep in all."""
    return "precision: amp_bf16\nmodel:\n" + "".join(
        "  " * (i - 1) + f"k{i}:\n" for i in range(2, levels)) + "  " * (levels - 1) + "x: 1\n"


def _block_lists(levels: int) -> str:
    return "precision: amp_bf16\nmodel:\n" + "".join(
        "  " * (i - 1) + "-\n" for i in range(2, levels)) + "  " * (levels - 1) + "- 1\n"


def _flow_lists(levels: int) -> str:
    return "precision: amp_bf16\nmodel: " + "[" * (levels - 1) + "1" + "]" * (levels - 1) + "\n"


def _deep_stack(frames: int, call):
    """Call with `frames` more frames on the stack: a caller of `lint_file` deeper than ours."""
    return _deep_stack(frames - 1, call) if frames else call()


@pytest.mark.parametrize("make", [_maps, _block_lists, _flow_lists])
def test_nesting_up_to_the_bound_loads_even_from_a_deep_caller(tmp_path, make):
    """Before: 75 levels of maps (81 of lists) failed with 'maximum recursion depth exceeded',
    under the documented bound, at line 1."""
    path = tmp_path / "deep.yaml"
    path.write_text(make(MAX_DEPTH))  # the top-level mapping is level 1
    for frames in (0, 200):
        entry = _deep_stack(frames, lambda: lint_file(path, 1, Snapshot(python="3")))
        assert entry["error"] is None, entry["error"]


@pytest.mark.parametrize(("make", "where", "keys"), [
    (_maps, f"{MAX_DEPTH + 2}:{2 * MAX_DEPTH + 1}", "model.k2.k3...k49.k50"),
    (_block_lists, f"{MAX_DEPTH + 2}:{2 * MAX_DEPTH + 1}", "model.0.0...0.0"),
    (_flow_lists, f"2:{MAX_DEPTH + 7}", "model.0.0...0.0"),
])
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 80, 98])
def test_nesting_past_the_bound_is_named_where_it_starts(tmp_path, make, where, keys, levels):
    path = tmp_path / "deep.yaml"
    path.write_text(make(levels))
    _one_line_exit_2(_lint(path), path, f"{path}:{where}: nested more than {MAX_DEPTH} levels "
                     f"deep at `{keys}`; refusing to load it")


def test_too_many_plain_values_are_not_called_an_alias_bomb(tmp_path):
    """Before: 'its aliases expand to more than 200000 values (an alias bomb?)' for a file
    without an alias. Each `kN: N` is two values, after the top-level mapping: the value past
    the bound is line N's value, N = MAX_EXPANDED_NODES / 2, whose key is k{N - 1}."""
    path = tmp_path / "many.yaml"
    path.write_text("".join(f"k{i}: {i}\n" for i in range(MAX_EXPANDED_NODES // 2 + 10)))
    last = f"k{MAX_EXPANDED_NODES // 2 - 1}"
    entry = lint_file(path, 1, Snapshot(python="3"))
    assert entry["error"] == (f"{path}:{MAX_EXPANDED_NODES // 2}:{len(last) + 3}: more than "
                              f"{MAX_EXPANDED_NODES} values by this line, at `{last}` (a config "
                              "holds a few hundred); refusing to load it")


def _flow_mapping(keys: int) -> str:
    """One flow mapping of `keys` keys, `key_00000: 0` on: 60,000 make some 900 KB."""
    return "{" + ", ".join(f"key_{i:05d}: {i}" for i in range(keys)) + "}\n"


@pytest.mark.parametrize("limit", [None, "none"])
def test_a_flow_mapping_of_60000_keys_is_refused_at_the_value_past_the_bound(tmp_path, limit):
    """Before: 30 s to 3 min (omegaconf < 2.4, or 2.4 with OMEGACONF_MAX_YAML_EXPANDED_NODES=none,
    built a DictConfig of 120,000 nodes, then did-you-means for 60,000 unknown keys and a copy
    of the positions per finding). The value past the bound, counted from the text: the
    mapping, then two per key."""
    path = tmp_path / "flow.yaml"
    text = _flow_mapping(60_000)
    path.write_text(text)
    key = f"key_{(MAX_EXPANDED_NODES - 1) // 2:05d}"
    column = text.index(f"{key}: ") + len(f"{key}: ") + 1
    env = {k: v for k, v in os.environ.items() if k != "OMEGACONF_MAX_YAML_EXPANDED_NODES"}
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", str(path)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
                          env=env if limit is None else {**env,
                                                         "OMEGACONF_MAX_YAML_EXPANDED_NODES": limit})
    _one_line_exit_2(done, path, f"{path}:1:{column}: more than {MAX_EXPANDED_NODES} values by "
                     f"this line, at `{key}`")


def test_a_rule_stops_after_max_hits_and_says_where(tmp_path):
    """Before: one FP8009 per unknown key, 60,000 rows for a generated file. 150 unknown
    top-level keys, one a line: MAX_HITS findings at lines 1..MAX_HITS, then one more at the
    next key's line saying the rule stopped there."""
    path = tmp_path / "many.yaml"
    path.write_text("".join(f"unknown_{i:03d}: {i}\n" for i in range(150)))
    entry = lint_file(path, 1, Snapshot(python="3"))
    found = [f for f in entry["findings"] if f["rule"] == "FP8009"]
    assert [(f["key"], f["line"]) for f in found] == \
        [(f"unknown_{i:03d}", i + 1) for i in range(MAX_HITS + 1)]
    assert "unknown_099" in found[MAX_HITS - 1]["message"]
    assert found[MAX_HITS]["message"].startswith(f"FP8009 has {MAX_HITS} findings in this input "
                                                 "and stops here")


def test_a_train_config_past_omegaconfs_own_limit_says_so(tmp_path):
    """Within our bound, but past omegaconf's (10,000 in 2.4 unless raised): its reason, as
    LLM-Foundry would meet it."""
    path = tmp_path / "many.yaml"
    path.write_text("precision: amp_bf16\n" + "".join(f"k{i}: {i}\n" for i in range(7_000)))
    entry = lint_file(path, 1, Snapshot(python="3"))
    if entry["error"] is not None:  # omegaconf < 2.4 has no such limit
        assert "omegaconf, which LLM-Foundry reads YAML with, refuses it" in entry["error"]
        assert "alias bomb" not in entry["error"]


# -- folders and SARIF ----------------------------------------------------------------------

def test_a_folder_of_upper_case_suffixes_is_linted(tmp_path):
    """Before: `.YAML` and `.Yml` were skipped, and a folder holding only them was 'empty'."""
    for name in ("b.YAML", "a.Yml", "c.yaml", "notes.txt"):
        (tmp_path / name).write_text("precision: amp_bf16\n")
    done = _lint(tmp_path, "--format", "json")
    assert done.returncode == 0, done.stderr
    linted = [Path(e["path"]).name for e in json.loads(done.stdout)["files"]]
    assert linted == ["b.YAML", "c.yaml", "a.Yml"]  # .yaml then .yml, each sorted
    only = tmp_path / "only"
    only.mkdir()
    (only / "TRAIN.YAML").write_text("precision: amp_bf16\n")
    done = _lint(only)
    assert done.returncode == 0 and "1 file(s) linted" in done.stdout, done.stderr


def _sarif_notes(*paths: Path) -> list[dict]:
    done = _lint(*paths, "--format", "sarif")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    invocation, = json.loads(done.stdout)["runs"][0]["invocations"]
    return invocation["toolExecutionNotifications"]


def test_sarif_load_errors_carry_the_line_their_message_names(tmp_path):
    """Before: no region, though the message named the line."""
    deep = tmp_path / "deep.yaml"
    deep.write_text(_maps(MAX_DEPTH + 1))
    tab = tmp_path / "tab.yaml"
    tab.write_text("model:\n\tname: mpt\n")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    (folder / "x.yaml").write_text("seed: 1\n")
    notes = _sarif_notes(deep, tab, tmp_path / "missing.yaml")
    regions = [note["locations"][0]["physicalLocation"].get("region") for note in notes]
    assert regions == [{"startLine": MAX_DEPTH + 2, "startColumn": 2 * MAX_DEPTH + 1},
                       {"startLine": 2, "startColumn": 1}, None]
    uris = [note["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for note in notes]
    assert uris == [deep.as_uri(), tab.as_uri(), (tmp_path / "missing.yaml").as_uri()]


def test_sarif_names_the_deepspeed_json_whose_line_is_wrong(tmp_path):
    (tmp_path / "ds.json").write_text('{\n  "fp16": {"enabled": true},,\n}\n')
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_DS.format("ds.json"))
    note, = _sarif_notes(path)
    location = note["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == (tmp_path / "ds.json").as_uri()
    assert location["region"] == {"startLine": 2, "startColumn": 29}


# -- values PyYAML's constructor refuses: at their own line, column and key ---------------------

@pytest.mark.parametrize(("text", "where"), [
    ("x: !!bool maybe\n", ":1:4: cannot load key x: "),  # before: KeyError, a traceback
    ("x: !!bool ''\n", ":1:4: cannot load key x: "),
    ("x: !!int ''\n", ":1:4: cannot load key x: "),  # before: IndexError
    ("x: !!float ''\n", ":1:4: cannot load key x: "),
    ("x: !!int '-'\n", ":1:4: cannot load key x: "),
    ("x: !!timestamp zz\n", ":1:4: cannot load key x: "),  # before: AttributeError
    ("!!bool maybe: 1\n", ":1:1: cannot load key maybe: "),  # a key
    ("max_seq_len: 128\nmodel:\n  name: mpt_causal_lm\n  d_model: 64\n  n_heads: !!int abc\n",
     ":5:12: cannot load key model.n_heads: "),  # before: ':1: cannot load'
    ("model:\n  layers: [1, !!float x]\n", ":2:15: cannot load key model.layers.1: "),
    ("seed: 1\nx: {<<: 3}\n", ":2:9: cannot load key x: "),  # the mapping's own check
])
def test_a_value_yaml_cannot_construct_is_named_at_its_line_and_key(tmp_path, text, where):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    entry = lint_file(path, 1, Snapshot(python="3"))
    assert entry["error"] is not None and entry["error"].startswith(f"{path}{where}"), entry
    assert "\n" not in entry["error"]


def test_a_folder_with_a_value_yaml_cannot_construct_still_lints_the_others(tmp_path):
    """Before: the traceback of the first such file ended the run; no file got a report."""
    (tmp_path / "a.yaml").write_text("x: !!bool maybe\n")
    (tmp_path / "b.yaml").write_text("precision: amp_bf16\n")
    done = _lint(tmp_path)
    _one_line_exit_2(done, tmp_path / "a.yaml", "a.yaml:1:4: cannot load key x: ")
    assert "1 file(s) linted" in done.stdout, done.stdout


def test_a_date_that_is_no_date_is_text_to_omegaconf_and_refused_by_safe_load(tmp_path):
    """omegaconf's loader, which LLM-Foundry reads train configs with, resolves no implicit
    timestamp: `2001-13-45` is text there, and the train config lints. yaml.safe_load, which
    Accelerate and MCLI read their configs with, raises on it: refused at its line and key.
    Before: 'ts.yaml:1: cannot load: month must be in 1..12' for both."""
    from omegaconf import OmegaConf

    train = "max_seq_len: 128\nmodel:\n  name: mpt_causal_lm\n  d_model: 64\n  started: 2001-13-45\n"
    assert OmegaConf.create(train)["model"]["started"] == "2001-13-45"
    with pytest.raises(ValueError, match="month must be in 1..12"):
        yaml.safe_load(train)
    path = tmp_path / "ts.yaml"
    path.write_text(train)
    assert lint_file(path, 1, Snapshot(python="3"))["error"] is None
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                          "started: 2001-13-45\n")
    assert lint_file(accelerate, 1, Snapshot(python="3"))["error"] == (
        f"{accelerate}:3:10: cannot load key started: PyYAML cannot read '2001-13-45' as "
        "!!timestamp (ValueError: month must be in 1..12)")
    mcli = tmp_path / "mcli.yaml"
    mcli.write_text("name: run\nimage: img\ncommand: echo\nparameters:\n  day: 2001-13-45\n")
    assert lint_file(mcli, 1, Snapshot(python="3"))["error"].startswith(
        f"{mcli}:5:8: cannot load key parameters.day: ")


def test_an_empty_path_is_refused_not_read_as_the_current_folder(tmp_path):
    """`foundry-fp8 lint "$CONFIGS"` with CONFIGS unset: before, Path('') is '.', and the job
    linted whatever folder it ran in (exit 0 here)."""
    (tmp_path / "ok.yaml").write_text("precision: amp_bf16\n")

    def lint(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "", *options],
                              cwd=tmp_path, capture_output=True, text=True, check=False,
                              timeout=HANG_GUARD_S,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})

    done = lint()
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: an empty path: name a config file or a folder (an unset "
                      "variable?)"], done.stderr
    note, = json.loads(lint("--format", "sarif").stdout)["runs"][0]["invocations"][0][
        "toolExecutionNotifications"]
    assert note["locations"] == []  # not the current folder


def test_a_linter_bug_on_one_file_is_one_line_and_the_others_are_linted(tmp_path, monkeypatch,
                                                                       capsys):
    """Whatever escapes lint_file on one file (our bug: the `!!bool maybe` KeyError was one)
    must not end a folder's lint with a traceback and no report for the good files."""
    import argparse

    from foundry_fp8.lint import cli

    real = cli.read_yaml

    def buggy(path, text, reader):
        if path.name == "a.yaml":
            raise KeyError("maybe")
        return real(path, text, reader)

    monkeypatch.setattr(cli, "read_yaml", buggy)
    (tmp_path / "a.yaml").write_text("precision: amp_bf16\n")
    (tmp_path / "b.yaml").write_text("precision: amp_bf16\n")
    code = cli.run(argparse.Namespace(paths=[str(tmp_path)], format="text"))
    out, err = capsys.readouterr()
    assert code == 2 and "1 file(s) linted" in out, (out, err)
    assert err.splitlines() == [f"error: {tmp_path / 'a.yaml'}: the linter failed on this file "
                                "(KeyError: 'maybe'); this is a foundry-fp8 bug: please report "
                                "it with the file"], err


def test_a_python_without_int_digit_limits_lints_with_cpythons_default(tmp_path):
    """Python 3.10.0-3.10.6 (python_requires >=3.10) has no sys.get_int_max_str_digits: the
    linter imported and refused a 5000-digit integer with AttributeError at import there."""
    path = tmp_path / "digits.yaml"
    path.write_text("max_seq_len: " + "9" * 5000 + "\n")
    script = ("import sys; del sys.get_int_max_str_digits\n"
              "from foundry_fp8.cli import main\n"
              f"sys.exit(main(['lint', {str(path)!r}]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    # 4300: CPython's default limit (sys.int_info.default_max_str_digits, 3.10.7 and later)
    assert "an integer of 5000 digits" in done.stdout + done.stderr
    assert f"{sys.int_info.default_max_str_digits}" in done.stdout + done.stderr


def test_a_python_without_omegaconf_names_it_not_a_foundry_fp8_bug(tmp_path):
    """QA 17: `python3 -m foundry_fp8.cli lint yamls` with a Python lacking omegaconf said, for
    every file, 'the linter failed on this file (ModuleNotFoundError ...); this is a foundry-fp8
    bug'. It is the CLI's one line naming the module and the interpreter, exit 2."""
    path = tmp_path / "train.yaml"
    path.write_text("precision: amp_fp8\n")
    script = ("import sys; sys.modules['omegaconf'] = None\n"  # import raises ModuleNotFoundError
              "from foundry_fp8.cli import main\n"
              f"sys.exit(main(['lint', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stdout
    assert done.stderr.count("\n") == 1 and "bug" not in done.stderr
    assert done.stderr.startswith(f"foundry-fp8: no module 'omegaconf' in {sys.executable}: ")


@pytest.mark.parametrize(("flags", "advice", "wrong"), [
    ((), "-m pip check", "<checkout>"),  # this venv: foundry-fp8 installed, editable
    (("-S",), "(pip install -e <checkout>)", "pip check"),  # no site-packages: none installed
])
def test_the_missing_dependency_advice_fits_where_foundry_fp8_is_installed(
        tmp_path, flags, advice, wrong):
    """Review (S3): `pip install -e . --no-deps` and a dependency missing was told to run with
    'the Python of the environment foundry-fp8 is installed in ... or install it into this one
    (pip install -e <checkout>)': that very Python. Where this Python has foundry-fp8 installed
    the advice is `pip check`; where it has none (run in the checkout, whose
    foundry_fp8.egg-info is then on sys.path), to use the venv's Python or install it."""
    import sysconfig
    from importlib import metadata

    # the independent fact: this venv has foundry-fp8 installed in its site-packages
    installed = [Path(str(d.locate_file(""))).resolve()
                 for d in metadata.distributions(name="foundry-fp8")]
    assert Path(sysconfig.get_path("purelib")).resolve() in installed
    path = tmp_path / "train.yaml"
    path.write_text("precision: amp_fp8\n")
    script = ("import sys; sys.modules['omegaconf'] = None\n"
              "from foundry_fp8.cli import main\n"
              f"sys.exit(main(['lint', {str(path)!r}]))")
    done = subprocess.run([sys.executable, *flags, "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (2, "", 1), done.stderr
    assert done.stderr.startswith("foundry-fp8: no module '"), done.stderr
    assert advice in done.stderr and wrong not in done.stderr, done.stderr


@pytest.mark.parametrize(("name", "ours"), [
    ("foundry_fp8.te.backend", True), ("tests.fake_te", True), ("benchmarks.x", True),
    ("benchmarks", True), (None, True),  # unnamed: nothing to name, so reported as our bug
    ("omegaconf", False), ("transformer_engine.pytorch", False),
    ("foundry_fp8x", False), ("benchmarks_extra.y", False),  # a prefix is not the package
])
def test_the_cli_and_the_linter_agree_on_which_missing_module_is_ours(monkeypatch, capsys,
                                                                       tmp_path, name, ours):
    """One predicate (review, QA 17): the linter's per-file line counted only `foundry_fp8` as
    ours, the CLI `foundry_fp8`, `tests` and `benchmarks`; `benchmarks.x` missing was a
    dependency to the linter and our bug to the CLI. Ours: a per-file bug line in the linter,
    the traceback from the CLI; any other module: the CLI's one line, exit 2."""
    import argparse

    from foundry_fp8 import cli as main_cli
    from foundry_fp8.lint import cli as lint_cli

    missing = ModuleNotFoundError(f"No module named {name!r}", name=name)

    def fails(*args: object, **kwargs: object) -> None:
        raise missing

    monkeypatch.setattr(lint_cli, "lint_file", fails)
    path = tmp_path / "train.yaml"
    path.write_text("precision: amp_fp8\n")
    try:
        code = lint_cli.run(argparse.Namespace(paths=[str(path)], format="text"))
        linter_says_ours = True
        assert code == 2 and "this is a foundry-fp8 bug" in capsys.readouterr().err
    except ModuleNotFoundError as raised:
        assert raised is missing
        linter_says_ours = False
    try:
        assert main_cli._not_installed(missing) == 2
        cli_says_ours = False
        err = capsys.readouterr().err
        assert err.startswith(f"foundry-fp8: no module {name!r} in {sys.executable}: "), err
        assert err.count("\n") == 1 and err.endswith("\n"), err
    except ModuleNotFoundError as raised:
        assert raised is missing
        cli_says_ours = True
    assert (linter_says_ours, cli_says_ours) == (ours, ours)
