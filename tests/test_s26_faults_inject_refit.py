"""`InjectOutlier` hooks its layer once per Trainer: a second fit() hooked it again (the channel
scaled by `factor` twice, compensated once: a wrong output in high precision, not an FP8-only
fault), and the hooks outlived the Trainer."""

from __future__ import annotations

import types

import torch
from torch import nn

from foundry_fp8.fault import InjectOutlier


def test_a_second_fit_keeps_the_fault_fp8_only_and_close_takes_it_off():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    healthy = model(x)
    fault = InjectOutlier("0", start=0)
    state = types.SimpleNamespace(model=model)
    fault.fit_start(state, None)
    fault.fit_start(state, None)  # a second fit() of the same Trainer
    assert torch.allclose(model(x), healthy, rtol=1e-3, atol=1e-2)  # up to the outlier's rounding
    fault.close(state, None)
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
