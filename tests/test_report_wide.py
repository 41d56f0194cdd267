"""`foundry-fp8 report` on a wide run (QA s20: an MPT-1B-sized run, 96 layers x 3 tensors): a
NaN step in every layer was 96 rows of the same words in fp8_report.md and on the terminal, the
terminal printed the 288-row worst-value table before the verdict (scrolled off the screen), and
a sweep's W&B baseline was read again for each run's config check. The expected rows are worked
out here from the values written, never from the report's own output."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import foundry_fp8.wandb_history as wandb_history
from foundry_fp8.cli import main
from foundry_fp8.health.keys import HIGH_PRECISION, LOSS, layer_key
from foundry_fp8.health.rules import NONFINITE_CAUSE, NONFINITE_CHANGE, NOT_CLIPPED
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.report import cli, markdown
from tests.test_report_long_run import attempt

BLOCKS = 8
LAYERS = [f"blocks.{b}.{m}" for b in range(BLOCKS) for m in ("attn.Wqkv", "ffn.down_proj")]
TENSORS = ("activation", "weight", "gradient")
STEPS = range(0, 101, 10)
NAN_STEP, DOWN_STEP, WEIGHT_STEP = 50, 70, 80
#: weight NaN in these layers only (no number pattern names exactly them)
SOME = ["blocks.1.attn.Wqkv", "blocks.2.ffn.down_proj", "blocks.5.attn.Wqkv", "blocks.6.attn.Wqkv"]
UNDER = "blocks.3.ffn.down_proj"  # its gradient's underflow 9 % at step 90: a row of its own
PREFIX = r"^(?:model\.)?(?:transformer\.)?"  # the advice's fronts, te_swap's names


def _nan(step: int, layer: str, tensor: str) -> float:
    if tensor == "gradient" and step == NAN_STEP:
        return 12.0
    if tensor == "activation" and step == DOWN_STEP and layer.endswith("ffn.down_proj"):
        return 3.0 + int(layer.split(".")[1])  # 3 to 10: the layers' counts differ
    if tensor == "weight" and step == WEIGHT_STEP and layer in SOME:
        return 5.0
    return 0.0


def _underflow(step: int, layer: str, tensor: str) -> float:
    if (layer, tensor, step) == (UNDER, "gradient", 90):
        return 9.0
    return 0.01 * (LAYERS.index(layer) * len(TENSORS) + TENSORS.index(tensor))  # all distinct


def _write(folder: Path, nan: Any = _nan, loss: float = 3.0) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in STEPS:
        values = {LOSS: loss}
        for layer in LAYERS:
            for tensor in TENSORS:
                values |= {layer_key("underflow_pct", tensor, layer): _underflow(step, layer, tensor),
                           layer_key("cos_sim", tensor, layer): 0.9995,
                           layer_key("scale_ratio", tensor, layer): 1.0,
                           layer_key("amax", tensor, layer): 2.0,
                           layer_key("nan_count", tensor, layer): nan(step, layer, tensor)}
        sink.write(step, values)
    return folder


DIVERGES = f"Likely cause: {NONFINITE_CAUSE}"
CLIP, LR = f"{NOT_CLIPPED}. Change: {NONFINITE_CHANGE}", f". Change: {NONFINITE_CHANGE}"


def test_layers_flagged_alike_share_one_row_and_each_keeps_its_own_in_the_markdown(tmp_path,
                                                                                    capsys):
    run = _write(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    verdict = out[out.index("flagged"):].splitlines()
    rows = [line.strip() for line in verdict if line.startswith("  ") and "Likely cause" in line
            and not line.startswith("  First flagged")]
    logged = len(STEPS)
    assert rows == [  # flagged at one step each, in the order first flagged
        f"all {len(LAYERS)} layers gradient: nan_count 12 at step {NAN_STEP} (12 NaN and 0 Inf "
        f"elements, before any FP8 cast; 1 of {logged} steps each). {DIVERGES}{CLIP}",
        f"{BLOCKS} layers 'blocks.<n>.ffn.down_proj' (every <n> in the run) activation: "
        f"nan_count 3 to 10 at step "
        f"{DOWN_STEP} (e.g. 10 NaN and 0 Inf elements, before any FP8 cast; 1 of {logged} steps "
        f"each). {DIVERGES}{LR}",
        f"{len(SOME)} layers ('blocks.1.attn.Wqkv', 'blocks.2.ffn.down_proj', "
        f"'blocks.5.attn.Wqkv' and 1 more) weight: nan_count 5 at step {WEIGHT_STEP} (5 NaN and "
        f"0 Inf elements, before any FP8 cast; 1 of {logged} steps each). {DIVERGES}{LR}",
        f"'{UNDER}' gradient: underflow_pct 9 % at step 90 (> 5 %; 1 of {logged} steps). Likely "
        "cause: the tensor's range is wider than FP8 holds at this layer. Change: "
        "algorithms.te_swap.exclude: '" + PREFIX + f"{UNDER.replace('.', chr(92) + '.')}(?:\\..+)?$'"], rows
    flagged = len(LAYERS) + BLOCKS + len(SOME) + 1
    assert f"\n{flagged} flagged\n" in out

    text = (run / "fp8_report.md").read_text()
    head, per_layer = text.split(f"## {markdown.PER_LAYER}\n")
    table = [line for line in head[head.index("## Flagged"):head.index("## Worst layers")]
             .splitlines() if line.startswith("| ") and "| layer |" not in line]
    assert [line.split(" | ")[:2] for line in table] == [
        [f"| all {len(LAYERS)} layers", "gradient"],
        [f"| {BLOCKS} layers `blocks.<n>.ffn.down_proj` (every `<n>` in the run)", "activation"],
        [f"| {len(SOME)} layers (`blocks.1.attn.Wqkv`, `blocks.2.ffn.down_proj`, "
         "`blocks.5.attn.Wqkv` and 1 more)", "weight"],
        [f"| {UNDER}", "gradient"]], table
    assert f"| 3 to 10 (step {DOWN_STEP}) | {DOWN_STEP} | 1 of {logged} each |" in table[1]
    # each layer of the grouped rows has its own row, with its own value
    own = {(cells[0], cells[1]): cells[3] for line in per_layer.splitlines()
           if line.startswith("| ") and "| layer |" not in line
           for cells in [line.strip("| ").split(" | ")]}
    expected = {**{(layer, "gradient"): f"12 (step {NAN_STEP})" for layer in LAYERS},
                **{(layer, "activation"): f"{_nan(DOWN_STEP, layer, 'activation'):g} (step "
                   f"{DOWN_STEP})" for layer in LAYERS if layer.endswith("down_proj")},
                **{(layer, "weight"): f"5 (step {WEIGHT_STEP})" for layer in SOME}}
    assert own == expected


def test_a_grouped_rows_name_says_which_layers_it_holds_where_a_glob_or_regex_would_not(
        tmp_path, capsys):
    """R3-20's repro: `blocks.0..3.ffn.down_proj` flagged, `blocks.0.moe.ffn.down_proj` and
    `blocks.x.ffn.down_proj` not. The row was named `'blocks.*.ffn.down_proj'`, which as a glob,
    or pasted into `--layers` (a regex search), selects the two unflagged layers too."""
    flagged = [f"blocks.{b}.ffn.down_proj" for b in range(4)]
    others = ["blocks.0.moe.ffn.down_proj", "blocks.x.ffn.down_proj"]
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in STEPS:
        sink.write(step, {LOSS: 3.0, **{
            layer_key(stat, "activation", layer): value
            for layer in flagged + others
            for stat, value in (("underflow_pct", 0.0), ("cos_sim", 0.9995), ("scale_ratio", 1.0),
                                ("amax", 2.0), ("nan_count", 4.0 if step == NAN_STEP
                                                and layer in flagged else 0.0))}})
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    md = (tmp_path / "run" / "fp8_report.md").read_text()
    name = "blocks.<n>.ffn.down_proj"
    assert f"  4 layers '{name}' (every <n> in the run) activation: nan_count 4 at step" in out
    assert f"| 4 layers `{name}` (every `<n>` in the run) | activation |" in md
    # the name as its words read: the run's layers with a number (digits) at each <n>
    said = re.compile(re.escape(name).replace(re.escape("<n>"), "[0-9]+"))
    assert [layer for layer in flagged + others if said.fullmatch(layer)] == flagged
    # what `*` selected, read as a glob or as a regex search: the unflagged layers too
    assert fnmatch.filter(others, "blocks.*.ffn.down_proj") == others
    assert [layer for layer in others if re.search("blocks.*.ffn.down_proj", layer)] == others


def test_a_grouped_what_if_row_says_each_of_its_step_count(tmp_path, monkeypatch, capsys):
    """`1 of 11 steps each, 1 of them what-if`, not `..., 1 of them what-if each`: the down_proj
    layers' NaN step marked what-if (as fp8_guard's fallback spans mark rows)."""
    run = _write(tmp_path / "run")

    def marked(metrics: Any, guard: Any) -> None:
        for layer in LAYERS:
            if layer.endswith("down_proj"):
                metrics.add(DOWN_STEP, layer, "activation", HIGH_PRECISION, 1.0)

    monkeypatch.setattr(cli, "mark_high_precision", marked)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    logged = len(STEPS)
    assert (f"at what-if step {DOWN_STEP} (e.g. 10 NaN and 0 Inf elements, before any FP8 cast; "
            f"1 of {logged} steps each, 1 of them what-if).") in out
    md = (run / "fp8_report.md").read_text()
    assert f"| 1 of {logged} each, 1 of them what-if |" in md


def test_a_single_layers_flags_keep_their_own_rows(tmp_path, capsys):
    """No two layers flagged alike: the rows as before, one per layer, no per-layer section."""
    run = _write(tmp_path / "run", nan=lambda step, layer, tensor: 0.0)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\n1 flagged\n" in out and f"  '{UNDER}' gradient: underflow_pct 9 %" in out
    assert markdown.PER_LAYER not in (run / "fp8_report.md").read_text()


def _printed_rows(out: str) -> list[tuple[str, str]]:
    return [(cells[0], cells[1]) for line in out[:out.index("flagged")].splitlines()
            if line.startswith("| ") and "| layer |" not in line
            for cells in [line.strip("| ").split(" | ")]]


def test_the_terminal_shows_the_worst_and_flagged_rows_then_the_verdict(tmp_path, capsys):
    """48 rows: the terminal keeps the 10 worst underflow and the flagged ones (the NaN rows,
    29 of them, reach the cap of 30 with the 10 worst), says how many it left out and where."""
    run = _write(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    every = [(layer, tensor) for layer in LAYERS for tensor in TENSORS]
    worst = {layer: max(_underflow(s, *layer) for s in STEPS) for layer in every}
    ranked = sorted(every, key=lambda key: -worst[key])
    flagged = [key for key in ranked if any(_nan(s, *key) for s in STEPS) or key == (UNDER, "gradient")]
    kept = set(ranked[:10])
    kept |= set([key for key in flagged if key not in kept][:30 - len(kept)])
    assert _printed_rows(out) == [key for key in ranked if key in kept]
    assert (f"... {len(every) - len(kept)} of the {len(every)} rows left out here (the 10 worst "
            f"and the flagged kept, up to 30): all in {run / 'fp8_report.md'}, 'Worst value per "
            "layer and tensor'") in out
    md = (run / "fp8_report.md").read_text()
    full = md[md.index("## Worst value per layer"):md.index(f"## {markdown.PER_LAYER}")]
    assert len(_printed_rows(full + "flagged")) == len(every)


def test_a_short_table_is_printed_whole(tmp_path, capsys):
    """A 2-block MPT's 24 rows (8 layers x 3 tensors): all of them, no note."""
    run = tmp_path / "run"
    sink = JsonlSink(run / "metrics.jsonl")
    layers = [f"blocks.{b}.{m}" for b in range(2) for m in ("Wqkv", "out_proj", "up", "down")]
    for step in STEPS:
        sink.write(step, {layer_key("underflow_pct", t, layer): 0.1 for layer in layers
                          for t in TENSORS})
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert len(_printed_rows(out)) == 24 and "rows left out" not in out


def test_the_worst_table_is_made_once_a_report(tmp_path, monkeypatch, capsys):
    made: list[int] = []
    for module in (cli, markdown):  # the old code made it in both
        if (worst_values := getattr(module, "worst_values", None)) is not None:
            monkeypatch.setattr(module, "worst_values",
                                lambda run, f=worst_values: made.append(1) or f(run))
    assert main(["report", str(_write(tmp_path / "run"))]) == 0
    capsys.readouterr()
    assert made == [1]


def test_a_sweeps_wandb_baseline_is_read_once(tmp_path, monkeypatch, capsys):
    """`report A B --baseline W`: W's file read for its loss, and its config from that same
    read; before, once more per run for the config check."""
    base = attempt(tmp_path / "bf16" / "wandb", "offline-run-20261101_120000-long", range(0, 101, 10),
                   {"seed": 17}, finished=True)
    runs = []
    for name in ("a", "b"):
        run = _write(tmp_path / name, nan=lambda step, layer, tensor: 0.0, loss=3.01)
        (run / "hparams.json").write_text(json.dumps({"seed": 18}))
        runs.append(str(run))
    opened: list[Path] = []
    records = wandb_history._records
    monkeypatch.setattr(wandb_history, "_records",
                        lambda run: opened.append(Path(run.path)) or records(run))
    assert main(["report", *runs, "--baseline", str(tmp_path / "bf16")]) == 0
    out = capsys.readouterr().out
    assert opened == [base]
    # the config check still made for each run, with the baseline's seed
    assert out.count("trained on other batches: seed 18 vs 17") == 2, out
