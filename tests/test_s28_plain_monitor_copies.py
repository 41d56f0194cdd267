"""A plain loop that copies its model while FP8Monitor's hooks are armed (between `start_step` and
`finish_step`): `torch.save(model)` for a checkpoint on a step that also logs, or
`copy.deepcopy(model)` for an EMA or a best-model copy.

fp8_stats never meets this (Composer checkpoints at BATCH_CHECKPOINT, after AFTER_TRAIN_BATCH
removed the hooks; its EMA copies at FIT_START). A plain loop did: the hooks were local
functions, so `torch.save(model)` raised "Can't pickle local object '_weak_hook.<locals>.hook'",
and `deepcopy` (which copies functions by reference) gave the copy hooks that stayed forever and
fed its forwards into the monitor's later logging steps as the watched model's.
"""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

from foundry_fp8.monitor import FP8Monitor
from foundry_fp8.options import MonitorConfig, Schedule


def _armed() -> tuple[nn.Module, FP8Monitor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    monitor = FP8Monitor(model, MonitorConfig(layers=r"^0$", recipe="current"),
                         schedule=Schedule(interval="1ba"))
    monitor.start_step(0)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    (model(x) - x).pow(2).mean().backward()
    return model, monitor, x


def test_torch_save_of_the_model_mid_step_works_and_the_step_still_logs():
    model, monitor, x = _armed()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded(x * 100)  # the loaded copy's forward is not the step's
    metrics = monitor.finish_step()
    assert metrics["fp8_amax/activation/0"] == x.abs().max().item()


def test_a_deepcopy_made_mid_step_does_not_feed_later_steps():
    model, monitor, x = _armed()
    ema = copy.deepcopy(model)
    monitor.finish_step()
    monitor.start_step(1)
    ema(x * 100)  # an EMA evaluation: not the watched model's training forward
    y = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    (model(y) - y).pow(2).mean().backward()
    metrics = monitor.finish_step()
    assert metrics["fp8_amax/activation/0"] == y.abs().max().item()
