"""`attn_impl: sdpa` against LLM-Foundry's `attn_impl: torch` (the reference) where the numerics
are easiest to get silently wrong: a long ALiBi bias in bfloat16, padding rows that see no key,
and forward plus backward of whole MPTs across the attn_config keys MPT accepts."""

from __future__ import annotations

import warnings

import pytest
import torch

from foundry_fp8.attention import sdpa_attention


def reference(*args, **kwargs):
    from llmfoundry.models.layers.attention import scaled_multihead_dot_product_attention

    with warnings.catch_warnings():  # the torch impl warns when given both a mask and a bias
        warnings.simplefilter("ignore")
        return scaled_multihead_dot_product_attention(*args, **kwargs)


def mpt_pair(max_seq_len: int, top: dict | None = None, **attn_config):
    """A tiny MPT with attn_impl torch and one with sdpa, same weights."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    models = []
    for impl in ("torch", "sdpa"):
        torch.manual_seed(0)
        cfg = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2,
                        max_seq_len=max_seq_len, vocab_size=97, **(top or {}),
                        attn_config={"attn_impl": impl, **attn_config})
        models.append(MPTForCausalLM(cfg))
    models[1].load_state_dict(models[0].state_dict())
    return models


def forward_backward(model, bf16: bool, **batch):
    """Logits at the kept positions and every parameter's gradient of their mean square."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(**batch).logits.float()
    keep = batch.get("attention_mask")
    kept = logits[keep] if keep is not None else logits.flatten(0, 1)
    kept.square().mean().backward()
    return kept.detach(), torch.cat([p.grad.flatten() for p in model.parameters()
                                     if p.grad is not None])


@pytest.mark.parametrize("seq", [512, 2048])
def test_long_alibi_bias_in_bfloat16_matches_torch_impl(seq):
    """MPT's ALiBi bias is -(s_k-1-j)*slope (-1023.5 at seq 2048). attn_impl torch adds it to
    bfloat16 scores in float32; cast to bfloat16 as is, its spacing of 4-8 there erased the
    slopes of the early queries (old code: 0.81 and 2.4 from the float32 output, torch: 0.02)."""
    from llmfoundry.models.layers.attention import build_alibi_bias

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, 8 * 32, generator=g) for _ in range(3))
    kw = dict(n_heads=8, kv_n_heads=8, is_causal=True,
              attn_bias=build_alibi_bias(8, seq, alibi_bias_max=8, dtype=torch.float32))
    exact = reference(q, k, v, **kw)[0]
    bf16 = [t.bfloat16() for t in (q, k, v)]
    torch_err = (reference(*bf16, **kw)[0].float() - exact).abs().max()
    sdpa_err = (sdpa_attention(*bf16, **kw)[0].float() - exact).abs().max()
    assert torch_err < 0.03
    assert sdpa_err < 2 * torch_err


def test_whole_mpt_alibi_under_amp_bf16_matches_torch_impl():
    """The same through MPT's own bias (built in float32 by MPTModel._attn_bias) under bfloat16
    autocast, forward and backward, at seq 512: sdpa's distance from the float32 reference
    is that of attn_impl torch in bfloat16 (old code: logits 1.03 off, torch 0.078)."""
    torch_mpt, sdpa_mpt = mpt_pair(512, alibi=True)
    ids = torch.randint(0, 97, (1, 512), generator=torch.Generator().manual_seed(1))
    exact, exact_grad = forward_backward(torch_mpt, False, input_ids=ids)
    ref, ref_grad = forward_backward(torch_mpt, True, input_ids=ids)
    out, grad = forward_backward(sdpa_mpt, True, input_ids=ids)
    assert (out - exact).abs().max() < 1.5 * (ref - exact).abs().max()
    assert (grad - exact_grad).abs().max() < 1.5 * (ref_grad - exact_grad).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_see_no_key_have_torch_impls_gradients(dtype):
    """Left padding under causality (generate's batches) and an all-padding sample leave query
    rows with every key masked: attn_impl torch gives them uniform weights and no gradient into
    q or k. Old code: v's gradient 8x (the fused backward took min as the row's log-sum-exp)
    and q, k gradients from those rows: max differences 9.1, 9.8, 4.5 in float32."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 8, 32, generator=g).to(dtype).requires_grad_() for _ in range(3))
    pad = torch.ones(3, 8, dtype=torch.bool)
    pad[1, :3] = False
    pad[2] = False
    kw = dict(n_heads=4, kv_n_heads=4, is_causal=True, key_padding_mask=pad)
    ref = reference(q, k, v, **kw)[0]
    out = sdpa_attention(q, k, v, **kw)[0]
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(out, ref, **tol)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **tol)


GQA = {"attn_type": "grouped_query_attention"}
NO_WPE = {"learned_pos_emb": False}
CONFIGS = {
    "causal": {}, "alibi": {"alibi": True, "alibi_bias_max": 4},
    "rope_hf": {"rope": True, "rope_impl": "hf", "rope_theta": 500000},
    "gqa": {**GQA, "kv_n_heads": 2}, "mqa": {**GQA, "kv_n_heads": 1},
    "qk_ln": {"qk_ln": True}, "qk_gn": {"qk_gn": True}, "clip_qkv": {"clip_qkv": 0.5},
    "softmax_scale": {"softmax_scale": 0.7}, "window": {"sliding_window_size": 5},
    "sequence_id": {"attn_uses_sequence_id": True},
    "sequence_id_alibi": {"attn_uses_sequence_id": True, "alibi": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_mpt_forward_and_backward_match_torch_impl(name):
    """Right-padded (finetuning) batch, packed sequences where configured, float32 train mode."""
    attn_config = dict(CONFIGS[name])
    top = NO_WPE if attn_config.get("rope") else None
    torch_mpt, sdpa_mpt = mpt_pair(32, top, **attn_config)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 17:] = False
    batch = {"input_ids": ids, "attention_mask": mask}
    if attn_config.get("attn_uses_sequence_id"):
        seq = torch.zeros(2, 24, dtype=torch.long)
        seq[0, 10:], seq[0, 17:], seq[1, 5:] = 1, 2, 1
        batch["sequence_id"] = seq
    ref, ref_grad = forward_backward(torch_mpt.train(), False, **batch)
    out, grad = forward_backward(sdpa_mpt.train(), False, **batch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4)


def test_softcapping_is_refused_when_the_config_is_built():
    """Before any training step, in one line naming the key and the fix."""
    from llmfoundry.models.mpt import MPTConfig

    with pytest.raises(NotImplementedError) as refused:
        MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=32, vocab_size=97,
                  attn_config={"attn_impl": "sdpa", "attn_logit_softcapping": 30.0})
    assert "\n" not in str(refused.value)
    assert "attn_config.attn_logit_softcapping" in str(refused.value)
    assert "use attn_impl: torch" in str(refused.value)


@pytest.mark.parametrize("attn_config", [{"alibi": True}, {**GQA, "kv_n_heads": 1},
                                         {"rope": True, "rope_impl": "hf"}])
def test_generate_with_kv_cache_and_left_padding_matches_torch_impl(attn_config):
    """HF generate on a left-padded batch (KV cache, one token a step): same tokens and
    scores as attn_impl torch."""
    top = NO_WPE if attn_config.get("rope") else None
    torch_mpt, sdpa_mpt = (m.eval() for m in mpt_pair(64, top, **attn_config))
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
              pad_token_id=0, use_cache=True, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref, out = torch_mpt.generate(**kw), sdpa_mpt.generate(**kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores),
                               atol=2e-5, rtol=1e-5)
