"""Composer / LLM-Foundry adapters: thin classes over foundry_fp8's framework-neutral core."""
