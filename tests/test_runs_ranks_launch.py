"""The tiny MPT as a user runs it on several GPUs, on 2 CPU ranks: `composer -n 2 llmfoundry
train` with te_swap (emulated), fp8_stats, fp8_state, fp8_guard, the jsonl logger and W&B
offline. An outlier fault in one layer on rank 1 only; later, fp8_guard's own work fails on
rank 1 only. Checked at the sinks against evidence each rank records itself: W&B's history (read
with W&B's reader) holds every fp8 value of the JSONL at the same steps; a layer's pooled amax
is the max of the ranks' own amaxes; both ranks fall back the same layer at the same step; only
rank 0 writes the run's files; the guard's failure on one rank switches it off on both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf as om

from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.wandb_history import read_runs
from tests.tiny_run import tiny_config

LAYER, FAULTY = "blocks.0.attn.Wqkv", "blocks.1.attn.out_proj"
GUARD_FAILS_AT = 12  # a logging step after the fallback

# a `code_paths` file: registers the fault, the per-rank evidence and the guard's failure
CODE = f'''
import json, os
from composer.core import Callback
from composer.utils import dist
from llmfoundry.registry import callbacks
from foundry_fp8.composer import guard
from foundry_fp8.fault import InjectOutlier, find_layer

callbacks.register("inject_outlier", func=InjectOutlier)
_act = guard.FP8Guard._act

def failing_act(self, step, *args):
    if step >= {GUARD_FAILS_AT} and dist.get_global_rank() == 1:
        raise RuntimeError("injected")
    return _act(self, step, *args)

guard.FP8Guard._act = failing_act


class Evidence(Callback):
    def __init__(self, out):
        self.out, self.amax, self.fallbacks = out, {{}}, {{}}

    def fit_start(self, state, logger):
        def pre(module, args):
            if module.training:
                self.amax[int(state.timestamp.batch)] = float(args[0].detach().abs().max())
        find_layer(state.model, "{LAYER}").register_forward_pre_hook(pre)

    def batch_end(self, state, logger):
        g = next(c for c in state.callbacks if isinstance(c, guard.FP8Guard))
        self.fallbacks[int(state.timestamp.batch)] = [sorted(g.core.fallbacks), g.disabled]

    def fit_end(self, state, logger):
        path = os.path.join(self.out, f"rank{{dist.get_global_rank()}}.json")
        with open(path, "w") as f:
            json.dump({{"amax": self.amax, "fallbacks": self.fallbacks}}, f)

callbacks.register("evidence", func=Evidence)
'''


def test_two_ranks_under_composers_launcher(tmp_path, tiny_data):
    (tmp_path / "evidence").mkdir()
    code = tmp_path / "ranks_code.py"
    code.write_text(CODE)
    cfg = tiny_config(tmp_path, tiny_data, {
        "code_paths": [str(code)], "dist_timeout": 60, "max_duration": "16ba",
        "eval_interval": "16ba", "save_interval": "8ba", "device_train_microbatch_size": 4,
        "callbacks": {"fp8_stats": {"interval": "2ba"}, "fp8_guard": {"consecutive": 2},
                      "inject_outlier": {"layer": FAULTY, "start": 4, "ranks": [1]},
                      "evidence": {"out": str(tmp_path / "evidence")}}}, wandb=True)
    folder = tmp_path / cfg.variables.run_name
    folder.mkdir()
    yaml = tmp_path / "run.yaml"
    om.save(cfg, yaml)
    launcher = Path(sys.executable).with_name("composer")
    llmfoundry = Path(sys.executable).with_name("llmfoundry")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run([str(launcher), "-n", "2", "-c", str(llmfoundry), "train", str(yaml)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / "evidence" / f"rank{r}.json").read_text()) for r in (0, 1)]

    # fp8_guard: the same layer at the same step on both ranks, then off on both at one step
    assert ranks[0]["fallbacks"] == ranks[1]["fallbacks"]
    first = min(int(b) for b, (fallen, _) in ranks[0]["fallbacks"].items() if fallen)
    assert 4 < first < GUARD_FAILS_AT and ranks[0]["fallbacks"][str(first)][0] == [FAULTY]
    off = min(int(b) for b, (_, disabled) in ranks[0]["fallbacks"].items() if disabled)
    assert GUARD_FAILS_AT < off <= GUARD_FAILS_AT + 3

    # the JSONL: pooled amax of LAYER's input = the max of the two ranks' own
    steps: dict[int, dict] = {}
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        steps.setdefault(step, {}).update(metrics)
    key = f"fp8_amax/activation/{LAYER}"
    logged = {s: m[key] for s, m in steps.items() if key in m}
    assert sorted(logged) == list(range(0, 16, 2))
    for step, value in logged.items():
        assert value == max(r["amax"][str(step)] for r in ranks)

    # W&B (one run, rank 0's) holds every fp8 value of the JSONL at its step
    [run] = read_runs(folder, wait=30)
    history: dict[int, dict] = {}
    for row in run.rows:
        history.setdefault(row["_step"], {}).update(row)
    fp8 = {(s, k): v for s, m in steps.items() for k, v in m.items() if k.startswith("fp8")}
    assert len(fp8) > 1000
    assert {sk: history.get(sk[0], {}).get(sk[1]) for sk in fp8} == fp8

    # one writer: rank 0's files only
    assert sorted(p.name for p in folder.glob("*.json*")) == ["hparams.json", "metrics.jsonl"]
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        "ep0-ba16-rank0.pt", "ep0-ba8-rank0.pt", "latest-rank0.pt"]
