"""An MoE block whose experts are weight tensors, not linears (LLM-Foundry's `torch_dmoe`,
transformers' Llama 4), counts its expert GEMMs in the linear FLOPs every share is of, as one
kept plan row: they counted nothing, so a torch_dmoe MPT whose experts run in high precision
read 79% of its linear FLOPs in FP8 (its attention's share of the rest) for 14%.

Reference: torch's FlopCounterMode on a real forward of the models as LLM-Foundry and
transformers build them, per module, divided by the tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from foundry_fp8.composer.guard import layer_flops
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import coverage_table, linear_flops, plan_swap

KEPT = "MoE experts as weight tensors: no nn.Linear to convert, high precision"


def _measured(model: nn.Module, ids: torch.Tensor, prefix: str,
              extra: tuple[str, ...]) -> dict[str, float]:
    """{module name: its GEMM FLOPs per token in a forward}, for the model's nn.Linear modules
    and the `extra` modules (experts, a tied head's embedding), by FlopCounterMode."""
    # grad on: DBRX hands a weight to a submodule, which the module tracker refuses without
    with FlopCounterMode(display=False) as counter:
        model(ids)
    counts = counter.get_flop_counts()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] + list(extra)
    return {n: sum(counts.get(f"{prefix}.{n}", {}).values()) / ids.numel() for n in names}


def _mpt_dmoe(**ffn: object) -> nn.Module:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(
        d_model=64, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "torch_dmoe", "moe_num_experts": 4, "moe_top_k": 2,
                    "moe_jitter_eps": None, "moe_normalize_expert_weights": 1,
                    "uniform_expert_assignment": False, **ffn}))


@pytest.mark.parametrize("mlp_type", ["glu", "mlp"])
def test_torch_dmoe_experts_count_their_routed_flops(mlp_type):
    model = _mpt_dmoe(mlp_type=mlp_type, ffn_act_fn={"name": "silu"}).eval()
    experts = [f"transformer.blocks.{i}.ffn.experts" for i in range(2)]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    measured = _measured(model, ids, "MPTForCausalLM", (*experts, "transformer.wte"))
    total = sum(measured.values())  # the tied head's GEMM runs in wte (F.linear unembed)
    assert all(measured[e] > 8 * measured["transformer.blocks.0.attn.out_proj"]
               for e in experts)  # the experts are most of the model's GEMMs

    plan = plan_swap(model, SwapConfig(backend="te"))
    decisions = {d.name: d for d in plan.decisions}
    assert plan.total_flops == linear_flops(model) == pytest.approx(total, rel=1e-9)
    for name in experts:
        row = decisions[name]
        assert (row.kind, row.convert) == ("moe_experts", False)
        assert row.reason == f"{KEPT}; FLOPs counted for the 2 of 4 experts a token uses"
        assert row.flops_share == pytest.approx(measured[name] / total, rel=1e-9)
        assert row.params == sum(p.numel() for p in model.get_submodule(name).parameters())
    fp8 = [n for n, d in decisions.items() if d.in_fp8]
    assert sorted(fp8) == sorted(f"transformer.blocks.{i}.attn.{p}" for i in range(2)
                                 for p in ("Wqkv", "out_proj"))
    share = sum(measured[n] for n in fp8) / total
    assert plan.fp8_flops_share == pytest.approx(share, rel=1e-9) and share < 0.2
    assert f"{100 * share:.1f}% of linear FLOPs" in coverage_table(plan)
    gemm_params = sum(p.numel() for n, p in model.named_parameters()
                      if "norm" not in n and "wpe" not in n)  # wte: the tied head's weight
    fp8_params = sum(p.numel() for n in fp8 for p in model.get_submodule(n).parameters())
    assert plan.fp8_param_share == pytest.approx(fp8_params / gemm_params, rel=1e-9)
    # fp8_guard without a te_swap plan: the same total
    layers = {n: model.get_submodule(n) for n in fp8}
    assert layer_flops(model, layers, None) == pytest.approx(
        {n: measured[n] / total for n in fp8}, rel=1e-9)


def test_llama4_experts_count_every_expert_as_its_forward_runs_them():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip("transformers without Llama 4")
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
        attn_implementation="eager")
    # bf16: 4.51's float32 eager attention multiplies a float32 query by bf16 keys
    model = transformers.Llama4ForCausalLM(config).to(torch.bfloat16).eval()
    name = "model.layers.0.feed_forward.experts"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    measured = _measured(model, ids, "Llama4ForCausalLM", (name,))
    total = sum(measured.values())

    plan = plan_swap(model, SwapConfig(backend="te"))
    row = next(d for d in plan.decisions if d.name == name)
    assert plan.total_flops == pytest.approx(total, rel=1e-9)
    assert row.reason == (f"{KEPT}; FLOPs counted for all 4 experts: Llama4TextExperts runs "
                          "every token through every expert")
    assert row.flops_share == pytest.approx(measured[name] / total, rel=1e-9)
    assert row.flops_share > 0.5
    fp8 = [d.name for d in plan.decisions if d.in_fp8]
    assert plan.fp8_flops_share == pytest.approx(sum(measured[n] for n in fp8) / total,
                                                 rel=1e-9)


def test_fsdp1_flattened_experts_count_their_original_shapes(one_rank_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = _mpt_dmoe(mlp_type="glu", ffn_act_fn={"name": "silu"})
    # by hand, 2 FLOPs per multiply-add: per block Wqkv 64x192, out_proj and router 64x4, and
    # glu's w1, v1, w2 (64 x ffn 256 each) for the 2 of 4 experts a token uses; a tied head
    d, ffn = 64, 4 * 64
    block = 2 * (d * 3 * d + d * d + d * 4) + 2 * 3 * d * ffn * 2
    before = linear_flops(model)
    assert before == 2 * block + 2 * d * 64
    wrapped = FullyShardedDataParallel(model, use_orig_params=False,
                                       device_id=torch.device("cpu"))
    mlp = model.transformer.blocks[0].ffn.experts.mlp
    assert "w1" not in dict(mlp.named_parameters(recurse=False))  # gone into the flat param
    assert linear_flops(wrapped) == before


def test_dbrx_experts_count_their_routed_flops():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DbrxConfig(
        d_model=32, n_heads=2, n_layers=1, max_seq_len=16, vocab_size=64,
        attn_config={"kv_n_heads": 1, "clip_qkv": 8.0}, attn_implementation="eager",
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    model = transformers.DbrxForCausalLM(config).eval()
    name = "transformer.blocks.0.ffn.experts"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    measured = _measured(model, ids, "DbrxForCausalLM", (name,))
    total = sum(measured.values())

    plan = plan_swap(model, SwapConfig(backend="te"))
    row = next(d for d in plan.decisions if d.name == name)
    assert plan.total_flops == pytest.approx(total, rel=1e-9)
    assert row.reason == f"{KEPT}; FLOPs counted for the 2 of 4 experts a token uses"
    assert row.flops_share == pytest.approx(measured[name] / total, rel=1e-9)


def test_te_swap_logs_the_measured_share_for_a_torch_dmoe_mpt():
    """What the user reads: the `fp8/linear_flops_share` te_swap logs at INIT through Composer's
    Trainer (no fit), against the forward's own FLOPs."""
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    from foundry_fp8.composer.te_swap import TESwap

    torch.manual_seed(0)
    model = ComposerMPTCausalLM(
        loss_fn="torch_crossentropy", d_model=64, n_heads=2, n_layers=1, max_seq_len=16,
        vocab_size=64, attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "torch_dmoe", "moe_num_experts": 4, "moe_top_k": 2,
                    "mlp_type": "glu", "ffn_act_fn": {"name": "silu"}, "moe_jitter_eps": None,
                    "moe_normalize_expert_weights": 1, "uniform_expert_assignment": False})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    measured = _measured(model.model.eval(), ids, "MPTForCausalLM",
                         ("transformer.blocks.0.ffn.experts", "transformer.wte"))
    fp8 = sum(measured[f"transformer.blocks.0.attn.{n}"] for n in ("Wqkv", "out_proj"))
    logger = InMemoryLogger()
    trainer = Trainer(model=model, algorithms=[TESwap(backend="emulate")], device="cpu",
                      loggers=[logger], progress_bar=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        logged = logger.hyperparameters
        assert logged["fp8/linear_flops_share"] == pytest.approx(
            fp8 / sum(measured.values()), rel=1e-9)
        assert "| no | moe_experts | 1 |" in logged["fp8/coverage"]
    finally:
        trainer.close()
