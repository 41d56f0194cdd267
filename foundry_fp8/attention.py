"""`attn_impl: sdpa` for LLM-Foundry's MPT: PyTorch's fused attention without flash-attn.

flash-attn is a common install failure, and `attn_impl: torch` materialises the whole score
matrix. `torch.nn.functional.scaled_dot_product_attention` picks the flash kernel on H100 when
no explicit mask is needed, so `sdpa_attention` hands it `is_causal` and passes a mask only for
what the fused kernels cannot express (padding, ALiBi/sequence-id bias, KV-cache offsets).

Registering the function (entry point `llmfoundry_attention_implementations`) is not enough:
MPTConfig._validate_config accepts only 'torch' and 'flash', and MPTModel's attention-bias
helpers raise for other names. `enable_sdpa_for_mpt()` registers the function and teaches them
that 'sdpa' builds its bias like 'torch'. It runs when this module is imported; LLM-Foundry loads
the entry point only after it has built the model, so code that builds MPT with sdpa must import
this module first (`foundry-fp8 bench` does; so does `foundry_fp8.composer`, which LLM-Foundry
imports when `train()` builds any of our entries, before the model).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from foundry_fp8.sdpa_facts import SDPA, SDPA_REFUSED_ATTN_KEYS


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s, n*d] -> [b, n, s, d]."""
    b, s, _ = x.shape
    return x.view(b, s, n, -1).transpose(1, 2)


def _mask(attn_bias: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
          causal: bool, window: int, b: int, s_q: int, s_k: int,
          like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Additive mask with LLM-Foundry's torch semantics (bias added, masked scores set to the
    dtype's min, not -inf), and with padding, the query rows that see no key.

    The bias is summed in float32 and shifted per query row so its largest allowed entry is 0
    before the cast to the query's dtype. MPT's ALiBi bias is -(s_k-1-j)*slope: -1023.5 at
    seq 2048, where bfloat16's spacing is 8, so casting it unshifted rounds away the slopes
    (attn_impl torch adds it in float32: layers/attention.py scaled_multihead_dot_product_attention).
    Softmax is unchanged by a per-row constant; near keys, which carry the weight, keep it exact."""
    dev = like.device
    blocked = torch.zeros(1, 1, s_q, s_k, dtype=torch.bool, device=dev)
    if key_padding_mask is not None:
        blocked = blocked | ~key_padding_mask.view(b, 1, 1, s_k).bool()
    rows = torch.arange(s_q, device=dev).view(-1, 1) + (s_k - s_q)
    cols = torch.arange(s_k, device=dev).view(1, -1)
    if causal:  # bottom-right aligned, as attn_impl torch does with a KV cache
        blocked = blocked | (cols > rows)
    if window != -1:
        blocked = blocked | ((rows - cols).abs() > window if s_q > 1 else cols < s_k - 1 - window)
    bias = None
    if attn_bias is not None:
        bias = attn_bias[:, :, max(0, attn_bias.size(2) - s_q):, max(0, attn_bias.size(3) - s_k):]
    # built in place at its final shape: one float32 [b, h, s_q, s_k] buffer at the peak
    shape = torch.broadcast_shapes(blocked.shape, bias.shape if bias is not None else ())
    mask = torch.zeros(shape, dtype=torch.promote_types(like.dtype, torch.float32), device=dev)
    mask.masked_fill_(blocked, float("-inf"))
    if bias is not None:
        mask.add_(bias)
        top = mask.amax(dim=-1, keepdim=True)
        mask.sub_(torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    mask = mask.clamp_(min=torch.finfo(like.dtype).min).to(like.dtype)  # -inf -> min
    if key_padding_mask is None:  # causal and window rows always keep their own key
        return mask, None
    # A padding row with no visible key: attn_impl torch fills it with min, so uniform weights
    # and no gradient into q or k. As a bias, min makes the fused backward take the row's
    # log-sum-exp as min (weights 1, not 1/s_k): a zero row and a zeroed query give torch's.
    dead = blocked.all(dim=-1, keepdim=True)
    return mask.masked_fill_(dead, 0), dead


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_heads: int,
    kv_n_heads: int,
    past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
    softmax_scale: float | None = None,
    attn_bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
    needs_weights: bool = False,
    attn_logit_softcapping: float | None = None,
    sliding_window_size: int = -1,
) -> tuple[torch.Tensor, None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Drop-in for LLM-Foundry's `scaled_multihead_dot_product_attention` (same arguments and
    return values). The KV cache is kept as [b, s, h*d] (flash's layout), which MPT's
    past-position logic assumes for every attn_impl except 'torch'."""
    if needs_weights:
        raise NotImplementedError("attn_impl sdpa cannot return attention weights "
                                  "(output_attentions); use attn_impl: torch")
    if attn_logit_softcapping is not None:
        raise NotImplementedError("attn_impl sdpa does not support attn_logit_softcapping; "
                                  "use attn_impl: torch")
    if past_key_value is not None:
        if len(past_key_value) != 0:
            key = torch.cat([past_key_value[0], key], dim=1)
            value = torch.cat([past_key_value[1], value], dim=1)
        past_key_value = (key, value)

    q, k, v = _heads(query, n_heads), _heads(key, kv_n_heads), _heads(value, kv_n_heads)
    if kv_n_heads != n_heads:  # GQA/MQA: each kv head serves n_heads // kv_n_heads query heads
        k = k.repeat_interleave(n_heads // kv_n_heads, dim=1)
        v = v.repeat_interleave(n_heads // kv_n_heads, dim=1)
    b, _, s_q, d = q.shape
    s_k = k.size(2)
    causal = is_causal and s_q > 1
    if sliding_window_size != -1 and s_q > 1 and s_q != s_k:
        raise ValueError("Number of queries should be equal to the number of keys.")
    fused_causal = causal and s_q == s_k and attn_bias is None and key_padding_mask is None \
        and sliding_window_size == -1
    mask = None
    if not fused_causal and (causal or attn_bias is not None or key_padding_mask is not None
                             or sliding_window_size != -1):
        mask, dead = _mask(attn_bias, key_padding_mask, causal, sliding_window_size, b, s_q, s_k, q)
        if dead is not None:
            q = q.masked_fill(dead, 0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0,
        is_causal=fused_causal, scale=softmax_scale if softmax_scale is not None else 1 / math.sqrt(d))
    return out.transpose(1, 2).reshape(b, s_q, n_heads * d), None, past_key_value


def enable_sdpa_for_mpt() -> None:
    """Register `sdpa_attention` as 'sdpa' and make MPTConfig and MPTModel accept it (bias
    built as for 'torch').

    Idempotent. Wraps the three places in llmfoundry 0.22 that switch on the attn_impl name:
    MPTConfig._validate_config, modeling_mpt.attn_bias_shape and modeling_mpt.build_attn_bias.
    MPTModel._attn_bias additionally drops an all-ones attention_mask for sdpa, so unpadded
    training batches keep the mask-free flash kernel instead of an all-zero float mask.
    """
    from llmfoundry.layers_registry import attention_implementations
    from llmfoundry.models.mpt import configuration_mpt, modeling_mpt

    attention_implementations.register(SDPA, func=sdpa_attention)
    config_cls, model_cls = configuration_mpt.MPTConfig, modeling_mpt.MPTModel
    if getattr(config_cls._validate_config, "_foundry_fp8_sdpa", False):
        return

    def as_torch(fn):
        @functools.wraps(fn)
        def wrapper(attn_impl, *args, **kwargs):
            return fn("torch" if attn_impl == SDPA else attn_impl, *args, **kwargs)
        return wrapper

    validate = config_cls._validate_config

    @functools.wraps(validate)
    def validate_sdpa(self):
        if self.attn_config.get("attn_impl") != SDPA:
            return validate(self)
        for key, why in SDPA_REFUSED_ATTN_KEYS.items():
            if self.attn_config.get(key) is not None:
                raise NotImplementedError(f"attn_config.{key} is not supported by attn_impl: "
                                          f"sdpa ({why}); use attn_impl: torch")
        self.attn_config["attn_impl"] = "torch"  # every other rule is the same as for torch
        try:
            return validate(self)
        finally:
            self.attn_config["attn_impl"] = SDPA

    attn_bias = model_cls._attn_bias

    @functools.wraps(attn_bias)
    def attn_bias_sdpa(self, device, dtype, attention_mask=None, sequence_id=None):
        if self.attn_impl == SDPA and attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        return attn_bias(self, device, dtype, attention_mask=attention_mask,
                         sequence_id=sequence_id)

    validate_sdpa._foundry_fp8_sdpa = True
    config_cls._validate_config = validate_sdpa
    model_cls._attn_bias = attn_bias_sdpa
    modeling_mpt.attn_bias_shape = as_torch(modeling_mpt.attn_bias_shape)
    modeling_mpt.build_attn_bias = as_torch(modeling_mpt.build_attn_bias)


enable_sdpa_for_mpt()
