"""What our `attn_impl: sdpa` (foundry_fp8/attention.py) refuses, torch-free so that the linter
(FP8041, FP8042) and the runtime read the same facts without importing torch."""

from __future__ import annotations

#: The attention implementation name foundry_fp8.attention registers with MPT.
SDPA = "sdpa"

#: attn_config keys sdpa refuses when MPTConfig is built (any value but null), each with why;
#: attn_impl torch takes them all.
SDPA_REFUSED_ATTN_KEYS: dict[str, str] = {
    "attn_logit_softcapping": "scaled_dot_product_attention cannot cap scores",
}
