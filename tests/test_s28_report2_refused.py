"""fp8_guard's budget refusing several layers (QA s28): the report gave each its own te_swap
`exclude` YAML, and te_swap reads one, so pasting them in turn kept the last layer's alone.
Now each layer's line says why, and one exclude holds them all (`health.rules.layers_regex`)."""

from __future__ import annotations

import json

import pytest
import regex

from foundry_fp8.cli import main
from foundry_fp8.fault import InjectOutlier
from tests.tiny_run import run_folder, run_tiny

LAYERS = ("blocks.0.ffn.down_proj", "blocks.1.ffn.down_proj")
END = 10


@pytest.mark.slow
def test_two_refused_layers_get_one_exclude_for_both(tmp_path, tiny_data, capsys):
    """Outliers in both down_proj (1/6 of the blocks' FP8 FLOPs each, over the default 10 %
    budget): two `fp8/guard/refused/` records; the report's one YAML matches both layers (under
    te_swap's module names too) and no other layer of the run."""
    from llmfoundry.registry import callbacks

    for n in range(2):
        callbacks.register(f"s28r2_outlier{n}", func=InjectOutlier)
    run_tiny(tmp_path, tiny_data, {
        "max_duration": f"{END}ba", "eval_interval": f"{END}ba", "save_interval": f"{END}ba",
        "callbacks": {"fp8_stats": {"interval": 2, "image_interval": None},
                      "fp8_guard": {"consecutive": 2},
                      **{f"s28r2_outlier{n}": {"layer": layer, "start": 2}
                         for n, layer in enumerate(LAYERS)}}})
    folder = run_folder(tmp_path)
    hparams = json.loads((folder / "hparams.json").read_text())
    assert sorted(k for k in hparams if k.startswith("fp8/guard/")) == [
        f"fp8/guard/refused/{layer}" for layer in LAYERS]
    logged = {k.rpartition("/")[2] for record in map(json.loads, (folder / "metrics.jsonl").open())
              for k in record["metrics"] if k.startswith("fp8_cos_sim/")}
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    # as markdown renders it: CommonMark's backslash escapes (`\|`, `\\.`) undone
    for text in (out, regex.sub(r"\\(.)", r"\1", section)):
        lines = [line for line in text.splitlines() if "the budget refused it" in line]
        assert len(lines) == 2 and all(layer in line for line, layer in zip(lines, LAYERS, strict=True))
        assert "{te_swap" not in "".join(lines)  # no YAML of one layer to paste in turn
        [yaml] = [line for line in text.splitlines() if line.startswith("To exclude them in")]
        pattern = regex.search(r"exclude: '(.+)'\}\}", yaml)[1]
        matched = {name for name in logged if regex.search(pattern, name)}
        assert matched == set(LAYERS)
        for layer in LAYERS:  # te_swap's own names of the modules
            assert regex.search(pattern, f"model.transformer.{layer}")


@pytest.mark.slow
def test_a_refused_layer_s_exclude_keeps_the_layers_in_fallback(tmp_path, tiny_data, capsys):
    """Outliers in blocks.0.attn.out_proj (1/24 of the blocks' FP8 FLOPs: fp8_guard moves it)
    and blocks.1.ffn.down_proj (1/6: over the 10 % budget, refused). The refusal's YAML, pasted
    after the fp8_guard section's static YAML, replaced it: out_proj was back in FP8. Its YAML
    now matches both layers, and no other layer."""
    from llmfoundry.registry import callbacks

    moved, refused = "blocks.0.attn.out_proj", "blocks.1.ffn.down_proj"
    for n in range(2):
        callbacks.register(f"s28r2_outlier{n}", func=InjectOutlier)
    run_tiny(tmp_path, tiny_data, {
        "max_duration": f"{END}ba", "eval_interval": f"{END}ba", "save_interval": f"{END}ba",
        "callbacks": {"fp8_stats": {"interval": 2, "image_interval": None},
                      "fp8_guard": {"consecutive": 2},
                      **{f"s28r2_outlier{n}": {"layer": layer, "start": 2}
                         for n, layer in enumerate((moved, refused))}}})
    folder = run_folder(tmp_path)
    hparams = json.loads((folder / "hparams.json").read_text())
    assert sorted(k for k in hparams if k.startswith(("fp8/guard/fallback/", "fp8/guard/refused/"))
                  ) == [f"fp8/guard/fallback/{moved}", f"fp8/guard/refused/{refused}"]
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "the budget refused it" in line]
    assert f"move {refused} at step" in line
    assert "exclude it in te_swap (with the layers fp8_guard held in high precision at the end, " \
           "whose YAML it replaces): " in line
    pattern = regex.search(r"exclude: '(.+)'\}\}", line)[1]
    logged = {k.rpartition("/")[2] for record in map(json.loads, (folder / "metrics.jsonl").open())
              for k in record["metrics"] if k.startswith("fp8_cos_sim/")}
    assert {name for name in logged if regex.search(pattern, name)} == {moved, refused}
