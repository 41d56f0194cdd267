"""fp8_stats on a model that adds to a watched layer's output in place: Falcon's parallel
attention block does `mlp_output += attention_output` on `mlp.dense_4h_to_h`'s output
(transformers 4.51 modeling_falcon.py:647). The monitor's module full backward pre-hooks wrap
each watched output in torch's BackwardHookFunction, whose outputs are views that autograd
forbids modifying in place: an `hf_causal_lm` Falcon with `fp8_stats` (te_swap emulate or not)
stopped at its first forward with "Output 0 of BackwardHookFunctionBackward is a view and is
being modified inplace". The gradient is now read by a hook on the output tensor, which sees
the gradient of the value the layer returned (torch's hooks on a tensor modified in place)."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.monitor import FP8Monitor

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("swap", [False, True])
def test_falcon_parallel_attention_trains_under_the_monitor(swap: bool):
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        parallel_attn=True, new_decoder_architecture=False, bias=False))
    if swap:
        convert_to_fp8(model, SwapConfig(backend="emulate"), precision="fp32")
    # the reference: the decoder layer's output is `mlp_output + residual` (dropout 0), so its
    # gradient is the gradient of what dense_4h_to_h returned
    block_out: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, out: tuple) -> None:
        out[0].retain_grad()
        block_out.append(out[0])

    model.transformer.h[0].register_forward_hook(keep)
    monitor = FP8Monitor(model)
    monitor.start_step()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with fp8_autocast(enabled=swap, recipe=FP8Recipe()):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    metrics = monitor.finish_step()
    want = block_out[0].grad.abs().max().item()
    assert want > 0
    assert metrics["fp8_amax/gradient/h.0.mlp.dense_4h_to_h"] == pytest.approx(want, rel=1e-6)
    # the attention's dense output is added into the same sum: the same gradient
    assert metrics["fp8_amax/gradient/h.0.self_attention.dense"] == pytest.approx(want, rel=1e-6)
