"""`attn_impl: sdpa` against LLM-Foundry's own `attn_impl: torch`, function by function and as a
whole MPT built from LLM-Foundry's classes."""

from __future__ import annotations

import math

import pytest
import torch

from foundry_fp8.attention import sdpa_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}


def reference(*args, **kwargs):
    from llmfoundry.models.layers.attention import scaled_multihead_dot_product_attention

    return scaled_multihead_dot_product_attention(*args, **kwargs)


def qkv(b=2, s=12, n_heads=4, kv_n_heads=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, n_heads * d, generator=g)
    k = torch.randn(b, s, kv_n_heads * d, generator=g)
    v = torch.randn(b, s, kv_n_heads * d, generator=g)
    return q, k, v


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("kv_n_heads", [4, 2, 1])
def test_matches_torch_impl_causal_and_gqa(is_causal, kv_n_heads):
    q, k, v = qkv(kv_n_heads=kv_n_heads)
    kw = dict(n_heads=4, kv_n_heads=kv_n_heads, is_causal=is_causal, softmax_scale=0.3)
    out, weights, cache = sdpa_attention(q, k, v, **kw)
    ref, _, _ = reference(q, k, v, **kw)
    assert weights is None and cache is None
    torch.testing.assert_close(out, ref, **TOL)


def test_causal_masks_the_future():
    """Changing the last token's key/value must not change any earlier position's output."""
    q, k, v = qkv()
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 5.0
    v2[:, -1] -= 5.0
    a, _, _ = sdpa_attention(q, k, v, n_heads=4, kv_n_heads=4, is_causal=True)
    b, _, _ = sdpa_attention(q, k2, v2, n_heads=4, kv_n_heads=4, is_causal=True)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=0, rtol=0)
    assert (a[:, -1] - b[:, -1]).abs().max() > 0.1


def test_key_padding_mask_and_bias_match_torch_impl():
    q, k, v = qkv(s=10)
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :3] = False  # left padding: the first rows see no key at all under causality
    pad[1, 7:] = False
    bias = torch.randn(1, 4, 1, 10, generator=torch.Generator().manual_seed(3))  # ALiBi shape
    kw = dict(n_heads=4, kv_n_heads=4, is_causal=True, key_padding_mask=pad,
              attn_bias=bias)
    out, _, _ = sdpa_attention(q, k, v, **kw)
    with pytest.warns(UserWarning):  # the torch impl warns when given both mask and bias
        ref, _, _ = reference(q, k, v, **kw)
    torch.testing.assert_close(out, ref, **TOL)


def test_sliding_window_matches_torch_impl():
    q, k, v = qkv(s=9)
    kw = dict(n_heads=4, kv_n_heads=4, is_causal=True, sliding_window_size=3)
    torch.testing.assert_close(sdpa_attention(q, k, v, **kw)[0], reference(q, k, v, **kw)[0],
                               **TOL)


def test_kv_cache_decoding_matches_full_causal_pass():
    """Prefill 7 tokens, then decode 1 and 3 at a time: each matches the full pass's rows."""
    q, k, v = qkv(s=11, kv_n_heads=2)
    kw = dict(n_heads=4, kv_n_heads=2, is_causal=True)
    full, _, _ = sdpa_attention(q, k, v, **kw)
    out, _, cache = sdpa_attention(q[:, :7], k[:, :7], v[:, :7], past_key_value=(), **kw)
    torch.testing.assert_close(out, full[:, :7], **TOL)
    out, _, cache = sdpa_attention(q[:, 7:8], k[:, 7:8], v[:, 7:8], past_key_value=cache, **kw)
    torch.testing.assert_close(out, full[:, 7:8], **TOL)
    out, _, cache = sdpa_attention(q[:, 8:], k[:, 8:], v[:, 8:], past_key_value=cache, **kw)
    torch.testing.assert_close(out, full[:, 8:], **TOL)
    assert cache[0].shape == (2, 11, 16)  # [b, s, kv_heads*d], the layout MPT expects


def test_unsupported_features_raise_clearly():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="attention weights"):
        sdpa_attention(q, k, v, n_heads=4, kv_n_heads=4, needs_weights=True)
    with pytest.raises(NotImplementedError, match="softcapping"):
        sdpa_attention(q, k, v, n_heads=4, kv_n_heads=4, attn_logit_softcapping=30.0)


def test_dropout_only_in_training():
    q, k, v = qkv()
    kw = dict(n_heads=4, kv_n_heads=4, is_causal=True, dropout_p=0.5)
    evald, _, _ = sdpa_attention(q, k, v, training=False, **kw)
    torch.testing.assert_close(evald, reference(q, k, v, **{**kw, "dropout_p": 0.0})[0], **TOL)
    trained, _, _ = sdpa_attention(q, k, v, training=True, **kw)
    assert (trained - evald).abs().max() > 1e-3


def build_mpt(attn_impl: str, **attn_config):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    cfg = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=32,
                    vocab_size=128, attn_config={"attn_impl": attn_impl, **attn_config})
    return MPTForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn_config", [{}, {"alibi": True}, {"kv_n_heads": 2,
                                                                "attn_type": "grouped_query_attention"}])
def test_whole_mpt_forward_sdpa_equals_torch(attn_config):
    """LLM-Foundry's MPT with attn_impl sdpa (our registration) vs attn_impl torch: same weights,
    same logits, with a padded batch so the attention mask path runs too."""
    from llmfoundry.layers_registry import attention_implementations

    assert attention_implementations.get("sdpa") is sdpa_attention
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    torch_model = build_mpt("torch", **attn_config)
    sdpa_model = build_mpt("sdpa", **attn_config)
    sdpa_model.load_state_dict(torch_model.state_dict())
    assert sdpa_model.transformer.blocks[0].attn.attn_fn is sdpa_attention
    with torch.no_grad():
        for attention_mask in (None, mask):
            ref = torch_model(input_ids=ids, attention_mask=attention_mask).logits
            out = sdpa_model(input_ids=ids, attention_mask=attention_mask).logits
            keep = mask if attention_mask is not None else torch.ones_like(mask)
            torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-5)


def test_mpt_config_still_rejects_unknown_impl():
    from llmfoundry.models.mpt import MPTConfig

    with pytest.raises(ValueError, match="attn_impl=nope"):
        MPTConfig(d_model=64, n_heads=4, n_layers=1, attn_config={"attn_impl": "nope"})


def test_llm_foundry_train_runs_with_attn_impl_sdpa(tmp_path, tiny_data):
    """`attn_config: {attn_impl: sdpa}` through LLM-Foundry's real `train(cfg)` (text loader with
    attention masks, Composer Trainer), once this module has been imported."""
    from tests.tiny_run import run_tiny

    trainer = run_tiny(tmp_path, tiny_data, {
        "model": {"attn_config": {"attn_impl": "sdpa"}}, "max_duration": "4ba",
        "eval_interval": "4ba", "save_interval": "4ba", "callbacks": {}, "algorithms": {}})
    blocks = trainer.state.model.model.transformer.blocks
    assert all(block.attn.attn_fn is sdpa_attention for block in blocks)
    assert int(trainer.state.timestamp.batch) == 4
    assert math.isfinite(float(trainer.state.loss))


def test_any_of_our_entries_built_by_name_makes_mpt_accept_sdpa():
    """In a fresh interpreter (no foundry_fp8 imported), LLM-Foundry's `train()` builds the
    callbacks it names before the model: building one of ours by name is what lets MPTConfig
    accept `attn_impl: sdpa` (without it, LLM-Foundry refuses: `Unknown attn_impl=sdpa`)."""
    import subprocess
    import sys

    script = """
import sys
from llmfoundry.models.mpt import MPTConfig
config = dict(d_model=64, n_heads=4, n_layers=1, max_seq_len=32, vocab_size=64,
              attn_config={"attn_impl": "sdpa"})
try:
    MPTConfig(**config)
except ValueError as error:
    print("before:", error)
assert "foundry_fp8" not in sys.modules
from llmfoundry.utils.builders import build_callback
build_callback("fp8_state", {})
print("after:", MPTConfig(**config).attn_config["attn_impl"])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["before: Unknown attn_impl=sdpa", "after: sdpa"]


def test_unpadded_batch_keeps_the_mask_free_kernel_path():
    """An all-ones attention_mask is dropped for sdpa, so the blocks get neither a bias nor a
    padding mask (sdpa's flash path); a real padding mask still reaches them."""
    model = build_mpt("sdpa")
    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs["attn_bias"], kwargs["key_padding_mask"]))
        return sdpa_attention(*args, **kwargs)

    for block in model.transformer.blocks:
        block.attn.attn_fn = spy
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 16, dtype=torch.bool)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        assert seen == [(None, None)] * 2
        seen.clear()
        mask[0, 12:] = False
        model(input_ids=ids, attention_mask=mask)
    assert all(bias is not None and pad is not None for bias, pad in seen) and len(seen) == 2
