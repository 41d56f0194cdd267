"""The report's line on steps logged in the older key layout (`_older_said`), on a long run."""

from __future__ import annotations

import time
from pathlib import Path

from foundry_fp8.health import RunMetrics
from foundry_fp8.health.keys import OLDER_LAYOUT_UNTIL
from foundry_fp8.report.read import _older_said

#: Logging steps of each layout: a run an older build logged for N steps, resumed by this one.
N = 20_000


def test_a_long_resumed_run_is_said_in_time_linear_in_its_steps():
    """The older attempt logged steps 0 to N + 99 (its last 100 after the checkpoint the new
    build resumed from, at N); the new layout holds N to 2N - 1. Before, the steps read were
    made a set once per older step: N x N, about 10 s here; now well under a second."""
    run = RunMetrics()
    for step in range(N, 2 * N):
        run.add(step, "blocks.0", "weight", "underflow_pct", 0.0)
    older = {step: "fp8/blocks.0/weight/underflow_pct" for step in range(N + 100)}
    start = time.perf_counter()
    said = _older_said(Path("metrics.jsonl"), older, run)
    assert time.perf_counter() - start < 1.0
    assert said.startswith("metrics.jsonl: FP8 statistics in an older key layout (fp8/<layer>/"
                           "<tensor>/<stat>, e.g. `fp8/blocks.0/weight/underflow_pct`, from "
                           f"foundry-fp8 builds before {OLDER_LAYOUT_UNTIL}) at {N} logging "
                           f"step(s), 0 to {N - 1}, are not read: this report covers the "
                           f"fp8_<stat>/<tensor>/<layer> series only, steps {N} to {2 * N - 1};")
