"""te_swap's plan and conversion on LLM-Foundry's real MPT classes (no training run here)."""

from __future__ import annotations

import math

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.swap import (
    SwapConfig,
    apply_swap,
    coverage_table,
    gelu_tanh_error,
    plan_swap,
    would_run_fp8,
)


def _mpt(d_model: int = 64, ffn_type: str = "mptmlp", no_bias: bool = False, n_layers: int = 3,
         expansion_ratio: float = 4, vocab_size: int = 128, **kwargs):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(
        d_model=d_model, n_heads=4, n_layers=n_layers, expansion_ratio=expansion_ratio,
        max_seq_len=32, vocab_size=vocab_size, no_bias=no_bias,
        attn_config={"attn_impl": "torch"}, ffn_config={"ffn_type": ffn_type}, **kwargs))


def _by_name(plan):
    return {d.name: d for d in plan.decisions}


@pytest.mark.parametrize("ffn_type", ["mptmlp", "mptglu"])
@pytest.mark.parametrize("no_bias", [True, False])
def test_plan_and_exact_conversion_on_real_mpt(ffn_type, no_bias):
    model = _mpt(ffn_type=ffn_type, no_bias=no_bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names_before = [n for n, _ in model.named_parameters()]
    fused = model.transformer.blocks[0].attn.Wqkv._fused
    plan = plan_swap(model, SwapConfig(backend="emulate", keep_last_blocks=1))
    converted = {d.name for d in plan.converted}
    per_block = ["attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj"]
    per_block += ["ffn.gate_proj"] if ffn_type == "mptglu" else []
    assert converted == {f"transformer.blocks.{b}.{p}" for b in (0, 1) for p in per_block}
    assert apply_swap(model, plan) == len(converted)
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is EmulatedFP8Linear for n in converted)
    assert type(modules["transformer.blocks.2.attn.Wqkv"]) is torch.nn.Linear
    # LLM-Foundry's param_init_fns read these (init_device: meta initialises after the swap)
    assert modules["transformer.blocks.0.attn.Wqkv"]._fused == fused
    assert modules["transformer.blocks.1.ffn.down_proj"]._is_residual is True
    assert modules["transformer.blocks.0.attn.out_proj"]._is_residual is True
    assert [n for n, _ in model.named_parameters()] == names_before  # names stable
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key in before:  # bit-exact copy, same dtype
        assert after[key].dtype == before[key].dtype and torch.equal(before[key], after[key])


def test_shares_match_a_hand_count():
    d, h, vocab, blocks = 64, 256, 128, 3
    plan = plan_swap(_mpt(no_bias=True), SwapConfig(backend="emulate", keep_first_blocks=1))
    # per block: Wqkv d->3d, out_proj d->d, up d->h, down h->d; tied LM head d->vocab
    block_macs = d * 3 * d + d * d + d * h + h * d
    total = blocks * block_macs + d * vocab
    assert plan.fp8_flops_share == pytest.approx(2 * block_macs / total)
    assert plan.fp8_param_share == pytest.approx(2 * block_macs / total)  # no bias: same ratio
    head = _by_name(plan)["lm_head (tied to wte)"]
    assert head.kind == "tied_lm_head" and not head.convert
    assert head.flops_share == pytest.approx(d * vocab / total)
    assert _by_name(plan)["transformer.blocks.1.ffn.up_proj"].flops == 2 * d * h
    table = coverage_table(plan)
    assert f"{100 * 2 * block_macs / total:.1f}% of linear FLOPs" in table
    assert "| yes | linear | 8 |" in table and "| no | linear | 4 |" in table


def test_untied_lm_head_follows_keep_lm_head():
    model = _mpt(no_bias=True, tie_word_embeddings=False)
    kept = _by_name(plan_swap(model, SwapConfig(backend="emulate")))["lm_head"]
    assert not kept.convert and "keep_lm_head" in kept.reason
    plan = plan_swap(model, SwapConfig(backend="emulate", keep_lm_head=False))
    assert _by_name(plan)["lm_head"].convert
    assert "lm_head (tied to wte)" not in _by_name(plan)


def test_odd_dims_are_kept_with_the_reason():
    plan = plan_swap(_mpt(d_model=72, n_layers=1), SwapConfig(backend="emulate"))
    assert plan.decisions and not plan.converted  # 72 % 16 != 0 for every block GEMM
    assert all("divisible by 16" in d.reason for d in plan.decisions if d.kind == "linear")
    # d_model 64, expansion 1.25: hidden 80 is fine, 1.375 gives 88 (88 % 16 == 8)
    plan = _by_name(plan_swap(_mpt(n_layers=1, expansion_ratio=1.375),
                              SwapConfig(backend="emulate")))
    assert plan["transformer.blocks.0.attn.Wqkv"].convert
    assert not plan["transformer.blocks.0.ffn.up_proj"].convert
    assert "88x64" in plan["transformer.blocks.0.ffn.up_proj"].reason
    assert "64x88" in plan["transformer.blocks.0.ffn.down_proj"].reason


def test_tokens_per_microbatch_and_min_gemm_size():
    model = _mpt(n_layers=1)
    plan = plan_swap(model, SwapConfig(backend="emulate", tokens_per_microbatch=4 * 30 + 2))
    assert not plan.converted
    assert all("divisible by 8" in d.reason for d in plan.decisions if d.kind == "linear")
    assert len(plan_swap(model, SwapConfig(backend="emulate",
                                           tokens_per_microbatch=4 * 32)).converted) == 4
    plan = _by_name(plan_swap(model, SwapConfig(backend="emulate", min_gemm_size=128)))
    assert not plan["transformer.blocks.0.attn.out_proj"].convert  # 64x64
    assert not plan["transformer.blocks.0.ffn.up_proj"].convert  # min(64, 256) < 128


def test_regex_filters_and_module_filter_fn():
    model = _mpt(n_layers=2)
    plan = plan_swap(model, SwapConfig(backend="emulate", include=r"\.ffn\.",
                                       exclude=r"blocks\.1\."))
    assert {d.name for d in plan.converted} == {"transformer.blocks.0.ffn.up_proj",
                                                "transformer.blocks.0.ffn.down_proj"}
    assert _by_name(plan)["transformer.blocks.1.ffn.up_proj"].reason == "matched by exclude"
    plan = plan_swap(model, SwapConfig(backend="emulate",
                                       module_filter_fn=lambda m, n: m.out_features != 192))
    assert len(plan.converted) == 6
    assert _by_name(plan)["transformer.blocks.0.attn.Wqkv"].reason == "rejected by module_filter_fn"
    with pytest.raises(ValueError, match="te_swap.include"):
        SwapConfig(include="(")
    with pytest.raises(ValueError, match="te_swap.keep_first_blocks"):
        SwapConfig(keep_first_blocks=-1)


def test_te_only_options_are_reported_on_emulate():
    plan = plan_swap(_mpt(n_layers=2, ffn_type="mptglu"),
                     SwapConfig(backend="emulate", convert_layernorm=True, fuse_ln_mlp=True))
    notes = _by_name(plan)
    assert "mptglu is not fused" in notes["transformer.blocks.0.ffn"].reason
    assert not notes["transformer.blocks.0.norm_1"].convert
    assert "needs backend te" in notes["transformer.blocks.0.norm_1"].reason
    assert len(plan.converted) == 10  # the GLU's linears are still converted one by one


def test_gelu_difference_matches_float64_math():
    """TE's LayerNormMLP gelu is the tanh form; MPT's is exact: an independent float64 check."""
    def exact(x):
        return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))

    def tanh_form(x):
        return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    xs = [-8 + 16 * i / 16000 for i in range(16001)]
    diffs = [abs(tanh_form(x) - exact(x)) for x in xs]
    rel = [dd / abs(exact(x)) for dd, x in zip(diffs, xs, strict=True) if abs(exact(x)) > 1e-2]
    max_abs, max_rel = gelu_tanh_error()
    assert max_abs == pytest.approx(max(diffs), rel=1e-6)
    assert max_rel == pytest.approx(max(rel), rel=1e-6)
    assert 1e-4 < max_abs < 1e-3  # small, but not zero: fusing changes the function
    # on typical activations (unit normal pre-activations) the difference is far smaller
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    typical = (torch.nn.functional.gelu(x, approximate="tanh")
               - torch.nn.functional.gelu(x)).abs().mean().item()
    assert typical < max_abs


def test_converted_model_runs_fp8_numerics():
    model = _mpt(n_layers=2, no_bias=True).eval()
    batch = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(batch).logits
        apply_swap(model, plan_swap(model, SwapConfig(backend="emulate")))
        assert torch.equal(model(batch).logits, reference)  # outside fp8_autocast: unchanged
        for _ in range(2):  # the first forward casts with scale 1 (no history yet), as TE
            with fp8_autocast():
                fp8 = model(batch).logits
    assert not torch.equal(fp8, reference)
    error = (fp8 - reference).norm() / reference.norm()
    # E4M3 keeps 3 mantissa bits; through two random-init blocks the logits move by ~10%,
    # still pointing the same way (a sanity bound; numerics are tested in test_emulate)
    assert 1e-3 < error < 0.2
    assert torch.nn.functional.cosine_similarity(fp8.flatten(), reference.flatten(), 0) > 0.98


@pytest.mark.parametrize(("precision", "te", "emulated", "expected"), [
    ("amp_fp8", 0, 0, False),  # Composer's amp_fp8 leaves torch layers in high precision
    ("amp_fp8", 4, 0, True),
    ("amp_bf16", 4, 0, False),  # TE layers without amp_fp8 run in BF16
    ("fp32", 0, 4, True),  # emulated FP8 at any precision
])
def test_would_run_fp8(precision, te, emulated, expected):
    assert would_run_fp8(precision, te, emulated) is expected


def _materialize_like_fsdp(model, seed: int) -> None:
    """What Composer's FSDP1 does with `init_device: meta` (dist_strategy.py, _param_init_fn):
    each module with meta parameters or buffers gets `to_empty`, then the model's
    param_init_fn (LLM-Foundry's, which reads `_fused` and `_is_residual`)."""
    torch.manual_seed(seed)
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in tensors):
            module.to_empty(device="cpu", recurse=False)
            model.param_init_fn(module)


def test_meta_init_after_swap_equals_meta_init_without_it():
    """te_swap runs at INIT, before FSDP materialises a meta model: the converted layers must
    get exactly the init LLM-Foundry gives the original ones, and usable FP8 scales."""
    reference = _mpt(init_device="meta")
    _materialize_like_fsdp(reference, seed=3)
    swapped = _mpt(init_device="meta")
    plan = plan_swap(swapped, SwapConfig(backend="emulate"))
    assert apply_swap(swapped, plan) == 12
    _materialize_like_fsdp(swapped, seed=3)
    want, got = reference.state_dict(), swapped.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    layer = swapped.transformer.blocks[0].attn.out_proj
    assert type(layer) is EmulatedFP8Linear
    assert torch.equal(layer.fp8_meta["scaling_fwd"].scale, torch.ones(3))  # not to_empty garbage
    assert layer.fp8_meta["scaling_bwd"].amax_history.shape == (0, 2)
    # the residual init really depends on the kept attribute: without it the init differs
    stripped = _mpt(init_device="meta")
    apply_swap(stripped, plan_swap(stripped, SwapConfig(backend="emulate")))
    for block in stripped.transformer.blocks:
        del block.attn.out_proj._is_residual
    _materialize_like_fsdp(stripped, seed=3)
    out_proj = "transformer.blocks.0.attn.out_proj.weight"
    assert not torch.equal(stripped.state_dict()[out_proj], want[out_proj])


@pytest.mark.parametrize("init_name", ["kaiming_normal_", "default_"])
def test_fusion_on_meta_weights_only_where_llm_foundrys_init_survives_it(init_name, monkeypatch):
    """On the meta device the fused te.LayerNormMLP would be initialised later by LLM-Foundry's
    param_init_fn, which raises NameError in the installed LLM-Foundry (te.facts; reproduced in
    test_lint_known) unless the scheme is `default_`; real weights are copied, so they fuse."""
    from importlib import metadata

    from foundry_fp8.te.facts import te_ln_mlp_init_fails

    assert te_ln_mlp_init_fails(metadata.version("llm-foundry"))
    config = SwapConfig(backend="te", fuse_ln_mlp=True)
    init = {"name": init_name, "init_std": 0.02}
    meta = _mpt(n_layers=2, init_config=init, init_device="meta")
    assert meta.transformer.blocks[0].ffn.up_proj.weight.is_meta
    fused = _by_name(plan_swap(meta, config))["transformer.blocks.0.ffn"]
    if init_name == "default_":
        assert fused.convert
    else:
        assert not fused.convert
        assert "init_device meta" in fused.reason and "NameError" in fused.reason
        assert "param_init_fns.py:466" in fused.reason
        # the block's linears are still planned one by one
        assert _by_name(plan_swap(meta, config))["transformer.blocks.0.ffn.up_proj"].convert
    assert _by_name(plan_swap(_mpt(n_layers=2, init_config=init), config))[
        "transformer.blocks.0.ffn"].convert
    monkeypatch.setattr(metadata, "version", lambda name: "0.7.0")  # before the bug
    assert _by_name(plan_swap(meta, config))["transformer.blocks.0.ffn"].convert


# -- the linter's static MPT (FP8005, FP8034) against LLM-Foundry's built one ----------------

#: MPT sections as a train YAML gives them (tiny dims), each a way MPT builds its modules.
MPT_SECTIONS = {
    "defaults": {},
    "untied head": {"tie_word_embeddings": False},
    "mptglu": {"ffn_config": {"ffn_type": "mptglu"}},
    "no bias": {"no_bias": True},
    "gqa": {"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}},
    "mqa": {"attn_config": {"attn_type": "multiquery_attention"}},
    "head_dim": {"head_dim": 18},  # attention 72 wide: off TE's rule
    "split qkv": {"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2,
                                  "fused_qkv": False, "kv_dim": 48}},
    "qk_ln": {"attn_config": {"qk_ln": True}},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "layernorm": {"norm_type": "layernorm"},
    "relu": {"ffn_config": {"ffn_act_fn": {"name": "relu"}}},  # fused with TE's relu
    "silu": {"ffn_config": {"ffn_act_fn": {"name": "silu"}}},  # not fused
    "ffn_hidden_size": {"ffn_config": {"ffn_hidden_size": 96}, "expansion_ratio": 3},
}


def _section(name: str) -> dict:
    base = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 3,
            "max_seq_len": 16, "vocab_size": 128, "loss_fn": "torch_crossentropy"}
    extra = MPT_SECTIONS[name]
    attn = {"attn_impl": "torch", **extra.get("attn_config", {})}
    return {**base, **extra, "attn_config": attn}


def _composer_mpt(section: dict, device: str):
    """Composer's model as LLM-Foundry's train builds it (build_composer_model)."""
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    torch.manual_seed(0)
    kwargs = {k: v for k, v in section.items() if k != "name"}
    return ComposerMPTCausalLM(tokenizer=None, init_device=device, **kwargs)


@pytest.mark.parametrize("name", sorted(MPT_SECTIONS))
def test_the_linters_mpt_modules_are_those_llmfoundry_builds(name):
    """Names (as te_swap sees them), kinds, weight dims and LayerNorm biases."""
    from foundry_fp8.lint.rules.model import mpt_modules

    section = _section(name)
    built = []
    for module_name, module in _composer_mpt(section, "meta").named_modules():
        if isinstance(module, torch.nn.Linear):
            built.append((module_name, "linear", module.in_features, module.out_features, True))
        elif isinstance(module, torch.nn.LayerNorm):
            built.append((module_name, "layernorm", 0, 0, module.bias is not None))
    static = [(m.name, m.kind, m.in_features, m.out_features, m.bias if m.kind == "layernorm"
               else True) for m in mpt_modules(section) if m.kind != "ln_mlp"]
    assert static == built


#: te_swap options, each with a model it is tried on (the untied-head model where it matters).
SWAP_CASES = [
    ({}, "defaults"), ({"keep_first_blocks": 3}, "defaults"),
    ({"keep_first_blocks": 1, "keep_last_blocks": 2}, "defaults"),
    ({"keep_first_blocks": 2, "keep_last_blocks": 0}, "defaults"),
    ({"include": "^lm_head$"}, "untied head"),
    ({"include": "lm_head", "keep_lm_head": False}, "untied head"),
    ({"include": "lm_head", "keep_lm_head": False}, "defaults"),
    ({"exclude": "attn|ffn"}, "mptglu"), ({"exclude": "attn|up_proj|down_proj"}, "mptglu"),
    ({"min_gemm_size": 65}, "defaults"), ({"min_gemm_size": 64}, "defaults"),
    ({"min_gemm_size": 65, "keep_lm_head": False}, "untied head"),
    ({"tokens_per_microbatch": 6}, "defaults"), ({"tokens_per_microbatch": 8}, "defaults"),
    ({"include": "norm_f", "convert_layernorm": True}, "defaults"),
    ({"include": "norm_f", "convert_layernorm": True, "backend": "emulate"}, "defaults"),
    ({"include": "norm", "convert_layernorm": True}, "no bias"),
    ({"include": "ffn$", "fuse_ln_mlp": True}, "defaults"),
    ({"include": "ffn$", "fuse_ln_mlp": True}, "rmsnorm"),
    ({"include": "ffn$", "fuse_ln_mlp": True}, "relu"),
    ({"include": "ffn$", "fuse_ln_mlp": True}, "silu"),
    ({"include": "ffn$", "fuse_ln_mlp": True, "backend": "emulate"}, "defaults"),
    ({"include": "Wq$|Wk$"}, "split qkv"), ({"include": "Wqkv"}, "split qkv"),
    ({}, "head_dim"), ({"include": "out_proj|Wqkv"}, "head_dim"),
]


@pytest.mark.parametrize(("options", "name"), SWAP_CASES)
def test_the_linters_te_swap_prediction_is_plan_swaps(options, name):
    """FP8034's prediction (from the YAML) equals te_swap's plan on the model LLM-Foundry
    builds (initialised weights: te_swap declines LayerNorms and fusions on the meta device,
    which the linter counts as converting)."""
    from foundry_fp8.lint.rules.model import mpt_modules
    from foundry_fp8.lint.rules.ours import converts_any

    section = _section(name)
    config = SwapConfig(**options)
    planned = bool(plan_swap(_composer_mpt(section, "cpu"), config).converted)
    assert converts_any(mpt_modules(section), config, section["n_layers"]) is planned
