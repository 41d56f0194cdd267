"""FP8042: an ffn_act_fn keyword its torch function does not take. resolve_ffn_act_fn binds the
keys beside `name` with functools.partial, so the model builds (after the tokenizer and the
loaders) and its first forward fails. Each case is run through the installed LLM-Foundry's
MPT on CPU, the reference."""

from __future__ import annotations

from typing import Any

import pytest

from foundry_fp8.lint.known import GELU_APPROXIMATIONS, TORCH_ACT_FN_KEYWORDS
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

MPT = {
    "name": "mpt_causal_lm",
    "d_model": 32,
    "n_heads": 2,
    "n_layers": 1,
    "max_seq_len": 8,
    "vocab_size": 32,
    "loss_fn": "torch_crossentropy",
    "attn_config": {"attn_impl": "torch"},
}


def _found(act: dict[str, Any]) -> list[tuple[str, str]]:
    model = {**MPT, "ffn_config": {"ffn_type": "mptmlp", "ffn_act_fn": act}}
    return [
        (f.key, f.severity)
        for f in lint_config({"model": model}, LintContext())
        if f.rule == "FP8042"
    ]


def _first_forward(act: dict[str, Any]) -> str | None:
    """What the installed LLM-Foundry's MPT raises at its first forward with `act`."""
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    config = {k: v for k, v in MPT.items() if k != "name"}
    model = MPTForCausalLM(
        MPTConfig(**config, ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": dict(act)})
    )
    try:
        model(torch.zeros(1, 8, dtype=torch.long))
    except (TypeError, RuntimeError) as error:
        return type(error).__name__
    return None


KEY = "model.ffn_config.ffn_act_fn"


@pytest.mark.parametrize(
    ("act", "expected", "raises"),
    [
        ({"name": "gelu", "approximat": "tanh"}, [(f"{KEY}.approximat", "error")], "TypeError"),
        (
            {"name": "gelu", "approximate": "tanh_"},
            [(f"{KEY}.approximate", "error")],
            "RuntimeError",
        ),
        ({"name": "silu", "approximate": "tanh"}, [(f"{KEY}.approximate", "error")], "TypeError"),
        ({"name": "gelu", "approximate": "tanh"}, [], None),
        ({"name": "leaky_relu", "negative_slope": 0.1}, [], None),
        ({"name": "relu", "inplace": True}, [], None),
        ({"name": "quick_gelu", "approximate": "tanh"}, [(f"{KEY}.approximate", "warning")], None),
    ],
)
def test_keywords_as_the_first_forward_takes_them(act, expected, raises):
    assert _found(act) == expected
    assert _first_forward(act) == raises


@pytest.mark.parametrize("name", sorted(TORCH_ACT_FN_KEYWORDS))
def test_the_table_is_the_installed_torchs(name):
    """Each keyword of the table is taken, a made-up one is refused, by the installed torch."""
    import torch
    import torch.nn.functional as F

    values = {
        "approximate": GELU_APPROXIMATIONS[1],
        "inplace": False,
        "negative_slope": 0.1,
        "alpha": 1.0,
        "beta": 1.0,
        "threshold": 20.0,
    }
    function, x = getattr(F, name), torch.ones(2)
    function(x, **{k: values[k] for k in TORCH_ACT_FN_KEYWORDS[name]})
    with pytest.raises(TypeError):
        function(x, not_a_keyword=1)
