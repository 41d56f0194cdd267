"""FP8029 in a run: MPT's attn_impl flash (its default) without flash-attn 2 builds, and the
first forward dies (NameError 'bert_padding'); fp8_lint, on the machine that trains, stops the
run before the tokenizer, loaders and model are built. Files stay quiet: the linter may run
elsewhere, and every MPT config without attn_impl would warn."""

from __future__ import annotations

from typing import Any

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

MPT = {
    "name": "mpt_causal_lm",
    "d_model": 64,
    "n_heads": 4,
    "n_layers": 1,
    "max_seq_len": 16,
    "vocab_size": 64,
    "loss_fn": "torch_crossentropy",
}


def _fp8029(model: dict[str, Any], flash_attn: str | None, scope: str = "run") -> list[tuple]:
    snapshot = Snapshot(python="3.11", flash_attn=flash_attn, flash_attn_cross_entropy=True)
    context = LintContext(scope=scope, snapshot=snapshot)  # type: ignore[arg-type]
    return [
        (f.key, f.severity) for f in lint_config({"model": model}, context) if f.rule == "FP8029"
    ]


@pytest.mark.parametrize(
    ("attn", "installed", "expected"),
    [
        ({}, None, [("model", "error")]),
        ({"attn_config": {"attn_impl": "flash"}}, None, [("model.attn_config.attn_impl", "error")]),
        ({}, "1.0.9", [("model", "error")]),  # v1: is_flash_v2_installed() is False
        ({}, "2.0.0", []),
        ({}, "2.7.4.post1", []),
        ({"attn_config": {"attn_impl": "torch"}}, None, []),
        ({"attn_config": {"attn_impl": "sdpa"}}, None, []),
    ],
)
def test_attn_impl_flash_in_a_run(attn, installed, expected):
    assert _fp8029({**MPT, **attn}, installed) == expected


def test_files_are_not_judged():
    assert _fp8029(MPT, None, scope="file") == []


def test_the_reference_llmfoundry_builds_and_the_first_forward_fails():
    """The installed LLM-Foundry, on this machine without flash-attn: MPT's default attn_impl
    builds, its first forward raises NameError; attn_impl torch trains."""
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from foundry_fp8.environment import gather_snapshot

    snapshot = gather_snapshot(probe_te_import=False)
    assert snapshot.flash_attn is None
    model = {k: v for k, v in MPT.items() if k != "name"}
    tokens = torch.zeros(1, 16, dtype=torch.long)
    default = MPTForCausalLM(MPTConfig(**model))
    with pytest.raises(NameError, match="bert_padding"):
        default(tokens)
    MPTForCausalLM(MPTConfig(**model, attn_config={"attn_impl": "torch"}))(tokens)
    context = LintContext(scope="run", snapshot=snapshot)
    assert [f.rule for f in lint_config({"model": MPT}, context)] == ["FP8029"]


def test_a_setting_mptconfig_refuses_first_is_said_alone():
    """alibi with attn_impl flash: MPTConfig raises building the model, before any forward."""
    assert _fp8029({**MPT, "attn_config": {"alibi": True}}, None) == [
        ("model.attn_config.alibi", "error")
    ]
