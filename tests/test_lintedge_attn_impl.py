"""attn_impl and rope_impl values MPTConfig refuses: `attn_impl: triton` (older LLM-Foundry's,
still in configs written for it), `Torch`, or a rope_impl other than dail/hf with rope on raise
ValueError when LLM-Foundry builds the model; the linter said nothing.

Reference: LLM-Foundry 0.22's MPTConfig (its _validate_config), with foundry_fp8.attention
loaded as in a run with our plugin (it adds `sdpa`)."""

from __future__ import annotations

import pytest

from foundry_fp8.lint.rules import lint_config

MODEL = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 1,
         "max_seq_len": 16, "vocab_size": 128, "loss_fn": "torch_crossentropy"}
CASES = [
    {"attn_impl": "triton"}, {"attn_impl": "Torch"}, {"attn_impl": "torch"},
    {"attn_impl": "sdpa"}, {"attn_impl": None},
    {"attn_impl": "torch", "rope": True, "rope_impl": "hf"},
    {"attn_impl": "torch", "rope": True, "rope_impl": "HF"},
    {"attn_impl": "torch", "rope": True, "rope_impl": "llama"},
    {"attn_impl": "torch", "rope": False, "rope_impl": "llama"},
]


def _refused(attn: dict) -> str | None:
    from llmfoundry.models.mpt import MPTConfig

    import foundry_fp8.attention  # noqa: F401  (registers sdpa, as our plugin does in a run)

    try:
        MPTConfig(**{k: v for k, v in MODEL.items() if k != "name"}, attn_config=dict(attn))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("attn", CASES, ids=str)
def test_fp8042_errs_where_mptconfig_refuses(attn):
    refused = _refused(attn)
    config = {"model": {**MODEL, "attn_config": attn},
              "algorithms": {"te_swap": {}}}  # ours: foundry_fp8.attention is loaded (FP8041)
    found = [f.key for f in lint_config(config)
             if f.rule == "FP8042" and f.key.split(".")[-1] in ("attn_impl", "rope_impl")]
    expected = "attn_impl" if refused and "attn_impl" in refused else "rope_impl"
    assert found == ([f"model.attn_config.{expected}"] if refused else []), refused
