"""Composer / LLM-Foundry adapters: thin classes over foundry_fp8's framework-neutral core.

LLM-Foundry imports this package when it builds any of our entries by name, which `train()` does
before it builds the model; importing `foundry_fp8.attention` here is what makes MPTConfig
accept `attn_impl: sdpa` then (the `sdpa` entry point alone is loaded only after the model's
config was validated).
"""

import foundry_fp8.attention  # noqa: F401  (registers 'sdpa' with MPT on import)
