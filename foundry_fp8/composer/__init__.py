"""Composer / LLM-Foundry adapters: thin classes over foundry_fp8's framework-neutral core.

LLM-Foundry imports this package when it builds any of our entries by name, which `train()` does
before it builds the model; importing `foundry_fp8.attention` then is what makes MPTConfig
accept `attn_impl: sdpa` (the `sdpa` entry point alone is loaded only after the model's config
was validated). Only where LLM-Foundry is already loaded: a plain Composer loop importing our
callbacks does not pay for importing it (about 2 s).
"""

import sys

if "llmfoundry" in sys.modules:
    import foundry_fp8.attention  # noqa: F401  (registers 'sdpa' with MPT on import)
