"""docs/cpu_try.md, followed to the letter: its `bash cpu-try` block run line by line in an empty
folder with its `# cpu-try.yaml` YAML saved there, as a user would. Both are read from the docs
file, so the docs cannot drift from what works."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "cpu_try.md"
STATS_DOC = DOC.with_name("fp8_stats.md")
TENSORS = ("activation", "weight", "gradient")  # fp8_stats' default `tensors`, as the try runs


def _without_parentheses(text: str) -> str:
    while (shorter := re.sub(r"\([^()]*\)", "", text)) != text:
        text = shorter
    return text


def documented_keys(doc: str) -> tuple[set[str], set[tuple[str, str]]]:
    """(summary keys, per-layer (`fp8_<stat>`, tensor) families) that docs/fp8_stats.md says
    fp8_stats logs under delayed scaling with the default tensors: the statistics listed in its
    first paragraph, the summary series and `fp8_initial_scale` of its "What reaches W&B" table."""
    first = doc.split("\n\n")[1]
    stats = re.findall(r"`(\w+)`", _without_parentheses(first.split("gradients):", 1)[1]))
    [summary] = [r for r in doc.splitlines() if r.startswith("| summary series |")]
    names = re.findall(r"`(?:fp8/<tensor>|\.\.\.)/(\w+)`", summary)
    [per_layer] = [r for r in doc.splitlines() if r.startswith("| per-layer series |")]
    # Markers of rows not cast in FP8, never in the try (delayed scaling, every layer converted):
    # `fp8_uncast` (NVTE_BACKWARD_OVERRIDE's dY), `fp8_high_precision` (a layer not in FP8)
    stats += [s for s in re.findall(r"`fp8_(\w+)/<tensor>/<layer>`", per_layer)
              if s not in ("uncast", "high_precision")]
    summaries = {f"fp8/{t}/{n}" for t in TENSORS for n in names}
    summaries |= set(re.findall(r"`(fp8/\w+)`", summary))
    return summaries, {(f"fp8_{s}", t) for s in stats for t in TENSORS}


def test_the_documented_key_lists_are_read_whole() -> None:
    """The parser above reads what the doc lists (a rewording must be read here, not skipped)."""
    summaries, families = documented_keys(STATS_DOC.read_text())
    assert len(summaries) == 16 and len(families) == 13 * 3  # 12 statistics + initial_scale
    shorter = STATS_DOC.read_text().replace("`nan_count`, ", "", 1)
    assert len(documented_keys(shorter)[1]) == 12 * 3


def _block(info: str) -> str:
    """The one fenced block whose info string is `info`."""
    [body] = re.findall(rf"^```{re.escape(info)}\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    return body


def _commands() -> list[str]:
    return [line.split("#")[0].strip() for line in _block("bash cpu-try").splitlines()
            if line.split("#")[0].strip()]


def _yaml() -> tuple[str, str]:
    """(file name, text) of the YAML block that starts with `# <name>.yaml`."""
    for body in re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), flags=re.M | re.S):
        first = body.splitlines()[0]
        if re.fullmatch(r"# [\w-]+\.yaml", first):
            return first[2:], body
    raise AssertionError(f"{DOC}: no ```yaml block starting with '# <name>.yaml'")


def test_the_docs_name_the_files_their_commands_use() -> None:
    name, _ = _yaml()
    commands = _commands()
    assert [c.split()[:2] for c in commands] == [["foundry-fp8", "tiny-data"],
                                                 ["foundry-fp8", "lint"],
                                                 ["llmfoundry", "train"],
                                                 ["foundry-fp8", "report"]]
    assert commands[2] == f"llmfoundry train {name}"


@pytest.mark.slow
def test_cpu_try_from_the_docs_alone(tmp_path: Path) -> None:
    name, text = _yaml()
    (tmp_path / name).write_text(text)
    # the venv's console scripts, as an activated venv has them; nothing else set
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("WANDB_MODE", None)  # the YAML says offline itself
    seconds = {}
    for command in _commands():
        start = time.perf_counter()
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        seconds[command] = round(time.perf_counter() - start, 1)
        assert done.returncode == 0, f"$ {command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if command.startswith("llmfoundry train"):
            train_log = done.stdout + done.stderr
    print("docs CPU try timings (s):", seconds)

    run = tmp_path / "runs" / "cpu-try"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["metrics"]["loss/train/total"] for r in records
              if "loss/train/total" in r["metrics"]}
    assert sorted(losses) == list(range(30))  # max_duration: 30ba
    first, last = losses[0], losses[29]
    print(f"loss {first:.3f} -> {last:.3f}")
    assert first > math.log(512)  # untrained: no better than a uniform guess over 512 tokens
    assert last < 3.5  # the docs' "falls below 3.5": the generated text is learnable
    keys = {k for r in records for k in r["metrics"]}
    summaries, families = documented_keys(STATS_DOC.read_text())
    # what docs/fp8_stats.md says fp8_stats logs, against what reached metrics.jsonl
    assert {k for k in keys if k.startswith("fp8/")} == summaries
    assert {tuple(k.split("/")[:2]) for k in keys if k.startswith("fp8_")} == families
    assert any(k.startswith("fp8_underflow_pct/activation/blocks.0.") for k in keys)  # per layer
    assert "te_swap coverage (emulate)" in train_log  # te_swap ran, emulated
    assert (run / "fp8_report.md").is_file() and list(run.glob("fp8_*.png"))
    # W&B, read back with its own reader: the same series, the heatmaps and the per-layer
    # table, which the YAML's allow_offline_artifacts: false lets in (fp8_stats warned before)
    from foundry_fp8.wandb_history import read_runs

    [wandb_run] = read_runs(tmp_path / "wandb")
    assert {k for k in keys if k.startswith("fp8")} <= wandb_run.keys()
    assert "fp8_table" in wandb_run.media("table-file")
    assert len(wandb_run.media("images/separated")) == 4  # fp8_heatmap/<stat>
    assert "per-layer table is not sent to W&B" not in train_log
    assert not (tmp_path / "runs" / "{run_name}").exists()
