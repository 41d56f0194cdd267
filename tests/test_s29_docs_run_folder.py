"""Where the README says a run's `metrics.jsonl` lands is where the `jsonl` logger writes it: the
README named `runs/<run_name>/metrics.jsonl` whatever the config, while a local `save_folder`
moves the run folder to its parent (LLM-Foundry's usual `./{run_name}/checkpoints` writes
`./<run_name>/metrics.jsonl`), so `foundry-fp8 report runs/<run_name>` found nothing there.
The README's example and its no-`save_folder` case are computed as the logger computes them
(`jsonl_logger.state_run_folder`: Composer's own `format_name_with_dist`, then `paths.run_folder`)."""

from __future__ import annotations

import re
import types
from pathlib import Path

from composer.callbacks import CheckpointSaver

from foundry_fp8.composer.jsonl_logger import state_run_folder

README = Path(__file__).resolve().parents[1] / "README.md"
RUN = "my-run"


def _folder(save_folder: str | None) -> Path:
    callbacks = [CheckpointSaver(folder=save_folder)] if save_folder else []
    return state_run_folder(types.SimpleNamespace(callbacks=callbacks, run_name=RUN))


def test_the_readme_says_where_metrics_jsonl_lands() -> None:
    text = README.read_text()
    [bullet] = re.findall(r"^- \*\*`metrics\.jsonl` in the run folder\*\*.*?(?=^- )", text,
                          flags=re.M | re.S)
    [(save_folder, given)] = re.findall(r"`save_folder: ([^`]+)` gives\s+`([^`]+)`", bullet)
    assert _folder(save_folder) == Path(given.replace("<run_name>", RUN))
    [default] = re.findall(r"else `([^`]+)`", bullet)
    assert _folder(None) == Path(default.replace("<run_name>", RUN))
