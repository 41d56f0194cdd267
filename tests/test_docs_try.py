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
    assert "fp8/activation/worst_underflow_pct" in keys  # fp8_stats' summary series
    assert any(k.startswith("fp8_underflow_pct/activation/blocks.0.") for k in keys)  # per layer
    assert "te_swap coverage (emulate)" in train_log  # te_swap ran, emulated
    assert (run / "fp8_report.md").is_file() and list(run.glob("fp8_*.png"))
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not (tmp_path / "runs" / "{run_name}").exists()
