"""An `exclude` anchored at the names a user sees in the model's own code
(`^transformer\\.blocks\\.0\\.`) matches nothing in a Composer run: te_swap searches the names of
Composer's wrapper (`model.transformer.blocks.0...`, LLM-Foundry's ComposerMPTCausalLM). The
warning said only "matches no module name ... (a typo?)", and block 0 trained in FP8; it now
shows a name as the regex sees it, so the `model.` prefix is in plain sight."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8 import SwapConfig, convert_to_fp8


def tiny_mpt() -> torch.nn.Module:
    """LLM-Foundry's Composer MPT, two blocks, torch attention (no flash-attn here)."""
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    torch.manual_seed(0)
    return ComposerMPTCausalLM(
        tokenizer=None,
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=16,
        vocab_size=128,
        loss_fn="torch_crossentropy",
        attn_config={"attn_impl": "torch"},
    )


def test_an_anchored_exclude_that_misses_the_wrapper_prefix_is_shown_a_real_name():
    with pytest.warns(
        UserWarning,
        match=r"matches none of the \d+ layers te_swap decides on \(nearest: "
        r"'model\.transformer\.blocks\.0\.attn\.Wqkv'\), so it keeps nothing in high precision: "
        r"those layers train in FP8 \(fix: write `\^model\\\.transformer\\\.blocks\\\.0\\\.`, "
        r"searched in the full names\)",
    ):
        plan = convert_to_fp8(
            tiny_mpt(),
            SwapConfig(backend="emulate", exclude=r"^transformer\.blocks\.0\."),
            precision="fp32",
        )
    assert "model.transformer.blocks.0.attn.Wqkv" in {d.name for d in plan.converted}
    # the name shown, anchored, keeps block 0
    fixed = convert_to_fp8(
        tiny_mpt(),
        SwapConfig(backend="emulate", exclude=r"^model\.transformer\.blocks\.0\."),
        precision="fp32",
    )
    kept = sorted(d.name for d in fixed.decisions if d.reason == "matched by exclude")
    assert kept == [
        f"model.transformer.blocks.0.{n}"
        for n in ("attn.Wqkv", "attn.out_proj", "ffn.down_proj", "ffn.up_proj")
    ]
