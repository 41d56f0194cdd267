"""te_swap's `backend: te` where TE is installed but torch sees no CUDA device (a GPU-less login
node, a CPU CI job with the `te` extra): one line naming the cause and the emulated backend,
before any layer changes, instead of TE's own refusal from deep inside the swap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

NO_CUDA = r"^algorithms\.te_swap\.backend: 'te' needs a CUDA GPU, and torch sees none here .*backend: emulate\}$"


def _blocks() -> nn.Module:
    net = nn.Module()
    net.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
                               for _ in range(2))
    return net


def test_te_backend_without_cuda_is_one_line_and_changes_no_layer(fake_te, monkeypatch):
    """The stand-in builds its layers on the CPU; told to answer as every real TE does
    (`probe.te_builds_without_cuda`), the swap stops before its first layer."""
    from foundry_fp8.swap import SwapConfig, convert_to_fp8
    from foundry_fp8.te import probe

    fake_te()
    monkeypatch.setattr(probe, "te_builds_without_cuda", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    net = _blocks()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(RuntimeError, match=NO_CUDA) as refused:
        convert_to_fp8(net, SwapConfig(backend="te", keep_first_blocks=0, keep_last_blocks=0,
                                          convert_layernorm=True))
    assert "\n" not in str(refused.value)
    assert [type(m).__name__ for m in net.blocks[0]] == ["Linear", "LayerNorm", "Linear"]
    assert all(type(m).__module__.startswith("torch.nn") for m in net.modules())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_the_stand_in_builds_on_the_cpu_where_a_gpu_is_absent(fake_te):
    """The CPU suite's te-backend tests keep running: the stand-in says it needs no CUDA."""
    from foundry_fp8.swap import SwapConfig, convert_to_fp8

    fake_te()
    net = _blocks()
    plan = convert_to_fp8(net, SwapConfig(backend="te", keep_first_blocks=0, keep_last_blocks=0,
                                          convert_layernorm=True))
    assert len(plan.converted) == 6
    assert type(net.blocks[1][0]).__module__ == "transformer_engine.pytorch.module"


def test_real_te_refuses_to_build_a_layer_without_cuda():
    """The fact `probe.te_builds_without_cuda` states, on the installed TE (TE 2.20.2
    pytorch/module/base.py:895-896: RuntimeError; an AssertionError with the same text before
    2.14). Runs only where real TE imports and no GPU is seen (the GPU kit on a CPU machine)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is seen: TE builds its layers here")
    te = pytest.importorskip("transformer_engine.pytorch")
    from foundry_fp8.te import probe

    assert not probe.te_builds_without_cuda()
    with pytest.raises((RuntimeError, AssertionError), match="TransformerEngine needs CUDA"):
        te.Linear(16, 16)


def test_te_swap_without_cuda_refuses_at_construction(fake_te, monkeypatch):
    """The Composer algorithm says it when built (LLM-Foundry builds algorithms before the
    model), not at INIT after the model was built."""
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.te import probe

    fake_te()
    monkeypatch.setattr(probe, "te_builds_without_cuda", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=NO_CUDA):
        TESwap(backend="te")
    assert TESwap(backend="emulate").plan is None
