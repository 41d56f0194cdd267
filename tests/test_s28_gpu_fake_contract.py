"""tests/fake_te.py against TE's own sources, where the stand-in had drifted from real TE: the CPU
tests then pass on behaviour the GPU never shows. Each fact names the TE lines it was read in."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foundry_fp8.te.backend import make_te_linear


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_bias_free_te_gemm_keeps_an_empty_plain_tensor_as_bias(fake_te, device):
    """TE 1.12-2.20 keep a bias-free GEMM's bias as `torch.Tensor().to(dtype=params_dtype,
    device=device)`, neither None nor a parameter (module/linear.py:877 at v1.12, 1721 at
    v2.18; layernorm_mlp.py:1382 at v1.12, 2120 and 2138 at v2.18; the 2.20.2 wheel alike), and
    skip it in the forward (`use_bias`); the stand-in had None, so a check `bias is None` passed
    on the CPU only."""
    fake_te()
    te = sys.modules["transformer_engine.pytorch"]
    linear = te.Linear(16, 32, bias=False, params_dtype=torch.bfloat16, device=device)
    mlp = te.LayerNormMLP(16, 64, bias=False, params_dtype=torch.bfloat16, device=device)
    for module, name in ((linear, "bias"), (mlp, "fc1_bias"), (mlp, "fc2_bias")):
        bias = getattr(module, name)
        assert type(bias) is torch.Tensor and bias.numel() == 0, name
        assert bias.dtype == torch.bfloat16 and bias.device.type == device, name
        assert name not in module.state_dict() and not module.use_bias
    if device == "cpu":
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, linear.weight))
        assert mlp(x).shape == (4, 16)


def test_te_swap_of_a_bias_free_linear_saves_the_plain_keys(fake_te):
    """What te_swap builds from a bias-free nn.Linear (Llama's, MPT's `no_bias`) saves only the
    weight, as the plain layer does, and computes the plain layer's function."""
    fake_te()
    src = nn.Linear(16, 32, bias=False)
    new = make_te_linear(src)
    assert new.state_dict().keys() - {"_extra_state"} == src.state_dict().keys() == {"weight"}
    x = torch.randn(4, 16)
    assert torch.equal(new(x), src(x))


def test_te_s_gemm_modules_are_found_as_fp8_modules_before_any_fp8_forward(fake_te):
    """TE's GEMM modules hold `fp8_meta` and `fp8` from their constructor (module/base.py:
    899-904 in 2.20.2) and `init_fp8_metadata` builds no scaling state outside TE's autocast
    (l. 1528-1552): te_swap's layers count as TE FP8 modules at once (fp8_state, fp8_guard and
    the FP8 census find them by that); the stand-in had neither, so on the CPU they counted as
    plain layers."""
    from foundry_fp8.fp8_meta import read_fp8_meta
    from foundry_fp8.swap import SwapConfig, convert_to_fp8, fp8_module_counts
    from foundry_fp8.te.backend import init_fp8_state
    from foundry_fp8.te.probe import is_te_fp8_module

    fake_te()
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))])
    convert_to_fp8(model, SwapConfig(backend="te"))
    assert fp8_module_counts(model) == (2, 0)
    layer = model.blocks[0][0]
    assert is_te_fp8_module(layer) and not layer.fp8
    assert init_fp8_state(layer, num_gemms=1) is False  # FP8 off: no state built
    assert read_fp8_meta(layer) == {}
