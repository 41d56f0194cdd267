"""FP8Monitor on GPT-2, whose linear layers are transformers `Conv1D`s (weight stored [in, out],
`torch.addmm(bias, x, weight)`): with the default `layers`, the monitor watched only the tied
`lm_head` and said nothing of the 4 GEMMs per block it left out, so a user judging whether GPT-2
would train in FP8 read one layer's statistics as the model's. Per-tensor statistics do not
depend on the weight's layout, so watching them, or a warning naming them, both tell the truth.
"""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.monitor import FP8Monitor
from foundry_fp8.options import MonitorConfig

transformers = pytest.importorskip("transformers")


def test_gpt2s_conv1d_layers_are_watched_or_named():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
    conv = model.transformer.h[0].attn.c_attn
    seen: list[torch.Tensor] = []
    conv.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warned.append)
    monitor.start_step()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    metrics = monitor.finish_step()
    if any("Conv1D" in message for message in warned):
        return
    assert "transformer.h.0.attn.c_attn" in monitor.layers, sorted(monitor.layers)
    assert metrics["fp8_amax/activation/h.0.attn.c_attn"] == seen[0].abs().max().item()
