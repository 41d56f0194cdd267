"""The te_swap `exclude` advised for a flagged fused LN-MLP (`fuse_ln_mlp`: te_swap's
te.LayerNormMLP at `blocks.<i>.ffn`, a layer of the keys) keeps that MLP out of FP8. An exclude
matching `...ffn` exactly only stops the fusion: te_swap then plans the MLP's own linears
(`ffn.up_proj`, `ffn.down_proj`) one by one, and converts them (`swap.plan_swap`)."""

from __future__ import annotations

import torch
import yaml

from foundry_fp8.health.rules import HealthTracker
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import plan_swap


def test_the_advice_for_a_fused_ln_mlp_keeps_its_linears_out_of_fp8(fake_te):
    fake_te()
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=64, n_heads=4, n_layers=4, max_seq_len=16, vocab_size=128,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": {"name": "relu"}}))
    tracker = HealthTracker()
    tracker.update(10, {(f"blocks.{i}.ffn", "fc1_weight"): {"underflow_pct": 0.0}
                        for i in (0, 3)}, whatif=set())  # the model's 4 blocks seen
    [flag] = tracker.update(20, {("blocks.1.ffn", "fc1_weight"): {"underflow_pct": 90.0}},
                            whatif=set())[("blocks.1.ffn", "fc1_weight")]
    [(key, exclude)] = yaml.safe_load(flag.yaml_key).items()
    assert key == f"{SwapConfig.PATH}.exclude", flag.yaml_key
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True, exclude=exclude))
    in_fp8 = {d.name for d in plan.converted if d.kind != "layernorm"}
    assert not {n for n in in_fp8 if n.startswith("transformer.blocks.1.ffn")}, sorted(in_fp8)
    assert "transformer.blocks.2.ffn" in in_fp8  # the other blocks' MLPs stay fused in FP8
