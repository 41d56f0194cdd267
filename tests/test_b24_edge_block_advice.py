"""The keep-in-BF16 advice (`underflow`, `underflow_rising`, `cos_low`) names te_swap's edge
blocks as te_swap counts them, the model's, not the edges of the layers fp8_stats watches (QA B
s24). A 3-block MPT watched with `layers: 'blocks\\.[01]\\.'` and an outlier in block 1 was told
`keep_last_blocks: 1`: followed, te_swap kept block 2 and block 1's 17 flagged steps of 19-20 %
underflow stayed; its `exclude` cleared them. Following is checked with te_swap's own decision
(`filters.filter_reason`), on the full module names te_swap sees."""

from __future__ import annotations

import json

import yaml

from foundry_fp8.cli import main
from foundry_fp8.filters import filter_reason
from foundry_fp8.health import HealthTracker, layer_key
from foundry_fp8.health.keys import layer_order_params
from foundry_fp8.health.rules import model_blocks
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.options import SwapConfig

KINDS = ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")
PREFIX = "model.transformer."  # the names te_swap's plan sees (HuggingFaceModel > MPTForCausalLM)


def model_layers(n_blocks: int) -> list[str]:
    return [f"blocks.{b}.{kind}" for b in range(n_blocks) for kind in KINDS]


def advice(tracker: HealthTracker, layer: str, watched: list[str]) -> str:
    """The change flagged for `layer`'s activation underflowing 20 % (the others healthy)."""
    table = {(name, "activation"): {"underflow_pct": 20.0 if name == layer else 0.0}
             for name in watched}
    [flag] = tracker.update(5, table)[(layer, "activation")]
    assert flag.rule == "underflow"
    return flag.yaml_key


def keeps(change: str, layer: str, n_blocks: int) -> bool:
    """Whether te_swap, given the change as a user types it, keeps `layer` in high precision."""
    [(path, value)] = yaml.safe_load(change).items()
    section, _, key = path.rpartition(".")
    assert section == SwapConfig.PATH
    return filter_reason(PREFIX + layer, SwapConfig(**{key: value}), n_blocks) is not None


def test_the_models_last_block_not_the_last_watched_one():
    watched = model_layers(2)  # fp8_stats `layers: 'blocks\.[01]\.'` on a 3-block model
    change = advice(HealthTracker(blocks=model_blocks(model_layers(3))), "blocks.1.attn.out_proj",
                    watched)
    assert change == r"algorithms.te_swap.exclude: '^(?:model\.)?(?:transformer\.)?blocks\.1\.attn\.out_proj(?:\..+)?$'"
    assert keeps(change, "blocks.1.attn.out_proj", 3)
    assert not keeps("algorithms.te_swap.keep_last_blocks: 1", "blocks.1.attn.out_proj", 3)
    last = advice(HealthTracker(blocks=model_blocks(model_layers(3))), "blocks.2.ffn.up_proj",
                  model_layers(3))
    assert last == "algorithms.te_swap.keep_last_blocks: 1" and keeps(last, "blocks.2.ffn.up_proj", 3)


def test_first_block_advice_only_for_block_0_whatever_is_watched():
    """keep_first_blocks: 1 keeps block 0 alone: a run watching blocks 2 and 3 of 4 (no model
    blocks given, the seen ones only) was told it for block 2."""
    watched = [name for name in model_layers(4) if name.startswith(("blocks.2.", "blocks.3."))]
    change = advice(HealthTracker(), "blocks.2.attn.Wqkv", watched)
    assert keeps(change, "blocks.2.attn.Wqkv", 4), change
    first = advice(HealthTracker(), "blocks.0.attn.Wqkv", model_layers(4))
    assert first == "algorithms.te_swap.keep_first_blocks: 1" and keeps(first, "blocks.0.attn.Wqkv", 4)


def test_a_resume_keeps_the_models_blocks():
    """fp8_stats restores its tracker from the checkpoint, restricted to the watched layers."""
    old = HealthTracker(blocks=model_blocks(model_layers(3)))
    old.update(1, {(name, "activation"): {"underflow_pct": 0.0} for name in model_layers(2)})
    new = HealthTracker(blocks=model_blocks(model_layers(3)))
    new.load_state_dict(old.state_dict(), keys={(n, "activation") for n in model_layers(2)})
    assert advice(new, "blocks.1.ffn.up_proj", model_layers(2)).startswith("algorithms.te_swap.exclude")


def test_report_names_the_models_edge_from_fp8_stats_layer_record(tmp_path, capsys):
    """`foundry-fp8 report` seeds its replay with `fp8/layers` (every layer fp8_stats could
    watch), the terminal's change line being the one a user copies."""
    watched, flagged = model_layers(2), "blocks.1.attn.out_proj"
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (10, 20):
        sink.write(step, {layer_key(stat, "activation", name): value for name in watched
                          for stat, value in (("underflow_pct", 20.0 if name == flagged else 0.0),
                                              ("cos_sim", 0.9995), ("scale_ratio", 1.0))})
    hparams = {"callbacks": {"fp8_stats": {"layers": r"blocks\.[01]\."}},
               **layer_order_params(model_layers(3), 10_000)}
    (tmp_path / "hparams.json").write_text(json.dumps(hparams))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    [line] = [s for s in capsys.readouterr().out.splitlines() if f"'{flagged}' activation:" in s]
    change = line.split("Change: ")[1]
    assert change == r"algorithms.te_swap.exclude: '^(?:model\.)?(?:transformer\.)?blocks\.1\.attn\.out_proj(?:\..+)?$'", line
    assert keeps(change, flagged, 3)


def test_report_joins_the_exclude_changes_and_the_runs_own_exclude(tmp_path, capsys):
    """Two middle layers flagged: each row's `exclude: '<layer>$'`, typed in turn, kept the last
    only (te_swap reads one regex) and dropped the run's own `exclude`; the report's one line
    keeps all three out."""
    layers, flagged = model_layers(4), ("blocks.1.attn.Wqkv", "blocks.2.ffn.up_proj")
    own = r"blocks\.0\.ffn\.down_proj"
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (10, 20):
        sink.write(step, {layer_key("underflow_pct", "activation", name):
                          20.0 if name in flagged else 0.0 for name in layers})
    (tmp_path / "hparams.json").write_text(json.dumps({
        "algorithms": {"te_swap": {"exclude": own}}, **layer_order_params(layers, 10_000)}))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    rows = [s.split("Change: ")[1] for s in out.splitlines() if "Change: " in s]
    assert len(rows) == 2 and all(r.startswith("algorithms.te_swap.exclude: ") for r in rows)
    assert not keeps(rows[-1], flagged[0], 4)  # the rows one after the other: the first stays in FP8
    [together] = [s for s in out.splitlines() if "exclude changes at once" in s]
    config = yaml.safe_load(together.split(": ", 1)[1])["algorithms"]["te_swap"]
    for name in (*flagged, "blocks.0.ffn.down_proj"):
        assert filter_reason(PREFIX + name, SwapConfig(**config), 4) is not None, name
    assert filter_reason(PREFIX + "blocks.2.attn.Wqkv", SwapConfig(**config), 4) is None
    markdown = (tmp_path / "out" / "fp8_report.md").read_text()
    assert f"`{together.split(': ', 1)[1]}`" in markdown
