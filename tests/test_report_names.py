"""`foundry-fp8 report` on what QA found (/tmp/qa-cli): layer names of any length keep the report
fast, its pictures and lines bounded and each layer's label its own; `--layers` is searched with
the time-bounded engine of te_swap's regexes; a FIFO, a device or a folder where the run's file
should be is said to be one (never opened); a layer fp8_guard moved twice is one layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from foundry_fp8.guard import FALLBACK_PREFIX, REPROMOTION_PREFIX, Fallback
from foundry_fp8.health import RunMetrics, Thresholds, layer_key
from foundry_fp8.health.table import LABEL_CHARS, render_table, short_names
from foundry_fp8.jsonl import JsonlSink
from tests.test_options import deadline
from tests.test_report import HEALTHY, L1, write_run

TAIL = ".blocks.11.ffn.down_proj"
MAX_SIDE = 5000  # pixels: no picture of the report is wider or taller


def run_with_layers(folder: Path, layers: list[str], steps: tuple[int, ...] = (0, 10)) -> Path:
    """A metrics.jsonl as the `jsonl` logger writes it: every statistic of every layer, the
    weight's underflow at 9 % (flagged) so the layers are in every table and list."""
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in steps:
        metrics = {layer_key(stat, tensor, layer): value for layer in layers
                   for tensor in ("activation", "weight") for stat, value in HEALTHY.items()}
        metrics.update({layer_key("underflow_pct", "weight", layer): 9.0 for layer in layers})
        sink.write(step, {**metrics, "loss/train/total": 3.0})
    return folder


def report(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own: a hang fails the test instead of stopping the suite."""
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", *args],
                          capture_output=True, text=True, timeout=timeout)


def png_sizes(folder: Path) -> list[tuple[int, int]]:
    from PIL import Image

    sizes = []
    for png in sorted(folder.glob("*.png")):
        with Image.open(png) as image:
            sizes.append(image.size)
    return sizes


# -- labels ----------------------------------------------------------------------------------

def test_labels_are_bounded_keep_the_end_and_never_coincide():
    huge = "x" * 1_000_000 + TAIL
    twins = ["a" * 200 + "1" + "b" * 200 + TAIL, "a" * 200 + "2" + "b" * 200 + TAIL]
    joined = ["two\nlines", "two\\nlines"]  # one line each: the same text
    names = [huge, *twins, *joined, "blocks.0.attn.Wqkv"]
    labels = short_names(names)
    assert len(set(labels.values())) == len(names)
    assert all(len(label) <= LABEL_CHARS for label in labels.values())
    assert labels[huge].endswith(TAIL) and labels[huge].startswith("x")
    assert all(labels[t].endswith(TAIL) for t in twins)
    assert labels["blocks.0.attn.Wqkv"] == "blocks.0.attn.Wqkv"  # short names stay whole
    assert "\n" not in "".join(labels.values())
    # a name that is literally another's disambiguated label keeps it; the other gets another
    tagged = short_names(joined)["two\\nlines"]
    again = short_names([*joined, tagged])
    assert again[tagged] == tagged and len(set(again.values())) == 3


def test_the_worst_value_table_bounds_names_of_layers_tensors_and_statistics():
    table = {("L" * 100_000, "T" * 100_000): {"underflow_pct": 1.0, "S" * 100_000: 2.0}}
    text = render_table(table)
    assert max(map(len, text.splitlines())) < 400


# -- long layer names ----------------------------------------------------------------------

def test_a_1mb_layer_name_is_reported_in_seconds_with_bounded_pictures_and_lines(tmp_path):
    """QA: a 1 MB layer name ran past 60 s (a 30k one made a 214885 x 286 px heatmap). Two more
    layers differ from each other only in the middle of 30k characters: each keeps a label of
    its own, with the distinctive end, in every table and picture."""
    twins = ["a" * 15_000 + f"{k}" + "b" * 15_000 + TAIL for k in (1, 2)]
    folder = run_with_layers(tmp_path, ["m" * 1_000_000 + TAIL, *twins, "blocks.0.attn.Wqkv"])
    done = report(str(folder), "--layers", "down_proj$")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not done.stderr
    sizes = png_sizes(folder)
    assert len(sizes) >= 5 and all(w <= MAX_SIDE and h <= MAX_SIDE for w, h in sizes), sizes
    md = (folder / "fp8_report.md").read_text()
    assert len(md) < 100_000 and max(map(len, md.splitlines())) < 2000
    assert max(map(len, done.stdout.splitlines())) < 2000
    rows = [r for r in md.split("## Worst value per layer and tensor")[1].splitlines()
            if r.startswith("| ") and "layer |" not in r]
    labels = [r.split(" | ")[0] for r in rows]
    assert len(set(labels)) == 4 and all(label.endswith(TAIL) or "Wqkv" in label
                                          for label in labels), [label[-60:] for label in labels]


def test_the_heatmap_fp8_stats_logs_is_bounded_too():
    """The same labels in the W&B images fp8_stats draws during training."""
    from foundry_fp8.health.raster import render_heatmap

    run = RunMetrics()
    for step in (0, 10):
        run.add_table(step, {("q" * 20_000 + TAIL, "weight"): {"underflow_pct": 1.0},
                             ("blocks.0.attn.Wqkv", "t" * 20_000): {"underflow_pct": 2.0}})
    image = render_heatmap(run, "underflow_pct", Thresholds())
    assert image.shape[0] <= MAX_SIDE and image.shape[1] <= MAX_SIDE, image.shape


def test_a_statistic_no_file_name_holds_gets_a_heatmap_file_of_its_own(tmp_path, capsys):
    """An unknown statistic gets a heatmap named after it: 300 characters, or a NUL, make no
    file name; each gets one, distinct, and its title draws the NUL as `\\x00` (no font has a
    glyph for it: matplotlib warned)."""
    write_run(tmp_path, extra={layer_key("s" * 300, "gradient", L1): 1.0,
                               layer_key("s" * 299 + "t", "gradient", L1): 1.0,
                               layer_key("nul\0x", "gradient", L1): 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["report", str(tmp_path)]) == 0
    assert [str(w.message) for w in caught] == []
    out = capsys.readouterr()
    assert not out.err
    names = [p.name for p in tmp_path.glob("fp8_heatmap_*.png")]
    assert len(names) == 4 + 3 and all(len(n) < 120 and "\0" not in n for n in names), names
    md = (tmp_path / "fp8_report.md").read_text()
    assert all(f"]({n})" in md for n in names)


# -- --layers ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("pattern", "said"), [
    ("(a*)*b", "--layers '(a*)*b' matches none of the 1 layer"),  # QA's: re never returns
    (r"^(a|aa)+(?<!a)b", r"--layers '^(a|aa)+(?<!a)b': takes more than 0.05 s on layer "
                          f"'{'a' * 40}' (catastrophic backtracking"),  # regex backtracks too
])
def test_a_catastrophic_layers_regex_is_one_line_not_a_hang(tmp_path, pattern, said):
    run_with_layers(tmp_path, ["a" * 40])
    done = report(str(tmp_path), "--layers", pattern, timeout=30)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.startswith(f"error: {said}") and done.stderr.count("\n") == 1, done.stderr


def test_layers_regexes_run_out_of_time_in_all_too(tmp_path, capsys, monkeypatch):
    """Each search is bounded; so are all of them together (thousands of layer names)."""
    from foundry_fp8.report import cli

    write_run(tmp_path)
    monkeypatch.setattr(cli, "MATCH_BUDGET_S", 0.0)
    assert main(["report", str(tmp_path), "--layers", "ffn"]) == 2
    assert capsys.readouterr().err == (
        "error: --layers 'ffn': takes more than 0 s on 1 of the 3 layer names (simplify it: no "
        "nested repetition such as (a*)*)\n")


def test_layers_matching_many_draws_the_first_20_and_says_so(tmp_path):
    folder = run_with_layers(tmp_path, [f"blocks.{b}.fc" for b in range(30)])
    assert main(["report", str(folder), "--layers", "fc"]) == 0
    md = (folder / "fp8_report.md").read_text()
    assert "`blocks.19.fc`, `blocks.20.fc`" not in md
    assert "`blocks.19.fc` (the first 20 of the 30 layers `--layers` matches)." in md


# -- what stands where the run's file should be -----------------------------------------------

def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("make", "said"), [
    (lambda t: _fifo(t / "pipe"), "pipe: a FIFO (named pipe), not a run folder or a metrics file"),
    (lambda t: _fifo(t / "metrics.jsonl") and t,
     "metrics.jsonl: a FIFO (named pipe), not the run's metrics file"),
    (lambda t: (t / "metrics.jsonl").mkdir() or t,
     "metrics.jsonl: a folder, not the run's metrics file"),
    (lambda t: Path("/dev/zero"), "/dev/zero: a character device, not a run folder or a metrics "
                                  "file"),
    (lambda t: (t / "metrics.jsonl").symlink_to(t / "gone.jsonl") or t,
     f"metrics.jsonl: a symbolic link to '{'{tmp}'}/gone.jsonl', which does not exist"),
    (lambda t: t / "nothing", "nothing: not found (no run folder or metrics file there)"),
    (lambda t: t, "metrics.jsonl: not found (was the `jsonl` logger in the YAML?)"),
], ids=["fifo-run", "fifo-metrics", "folder-metrics", "dev-zero", "broken-link", "no-folder",
        "no-metrics"])
def test_what_stands_in_place_of_the_run_s_file_is_said_in_one_line(tmp_path, capsys, make, said):
    """QA: all of these said `<path>/metrics.jsonl: not found`; nothing here is opened (a read
    of a FIFO blocks until a writer comes)."""
    target = make(tmp_path)
    with deadline(20):
        assert main(["report", str(target)]) == 2
    out = capsys.readouterr()
    assert not out.out and out.err.count("\n") == 1
    assert out.err.startswith("error: ") and said.replace("{tmp}", str(tmp_path)) in out.err, \
        out.err


# -- fp8_guard ----------------------------------------------------------------------------------

def test_a_layer_that_fell_back_twice_is_one_layer_in_two_fallbacks(tmp_path, capsys):
    """QA (run s5d): fell back at step 4, back in FP8 from step 8, fell back again at step 11:
    the report said "fp8_guard moved 2 layer(s)"."""
    write_run(tmp_path)
    first = Fallback(L1, 4, 0.25, ("message",), {})
    second = Fallback(L1, 11, 0.25, ("message",), {})
    back = {"layer": L1, "step": 7, "fallen_at": 4, "healthy_steps": 2, "numbers": {}}
    (tmp_path / "hparams.json").write_text(json.dumps({
        "callbacks": {"fp8_stats": {}, "fp8_guard": {}}, FALLBACK_PREFIX + L1: first.record(),
        f"{FALLBACK_PREFIX}{L1}@11": second.record(), REPROMOTION_PREFIX + L1: back}))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    moved = ("fp8_guard moved 1 layer(s) to high precision{} in 2 fallbacks (1 layer(s) fell "
             "back again after going back to FP8)")
    assert f"{moved.format('')}: {L1} from step 5 to 7, from step 12." in out
    md = (tmp_path / "fp8_report.md").read_text()
    assert moved.format(" during the run") in md and "moved 2 layer(s)" not in md + out
    assert f"| {L1} | 5 | step 8 (back in FP8) | 25.0 % | message |" in md
    assert f"| {L1} | 12 | the end | 25.0 % | message |" in md


def test_bidi_and_other_format_characters_in_a_layer_name_are_escaped(tmp_path, capsys):
    """U+202E (right-to-left override) would make the rest of a line read backwards, on the
    terminal, in the markdown and in the suggested `exclude` regex: Unicode's format characters
    (category Cf) are shown escaped, as control characters are."""
    layer = "blocks.0.attn.\u202eWqkv\u200b"
    run_with_layers(tmp_path, [layer])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    md = (tmp_path / "fp8_report.md").read_text()
    for text in (out, md):
        assert "\u202e" not in text and "\u200b" not in text
    # the suggested regex shows them escaped, and still matches the name (`\\u202e` is U+202E)
    assert r"exclude: '^(?:model\.)?(?:transformer\.)?blocks\.0\.attn\.\u202eWqkv\u200b(?:\..+)?$'" in out
