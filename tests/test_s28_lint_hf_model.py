"""hf_causal_lm settings ComposerHFCausalLM refuses building the model, after the tokenizer and
the data loaders: a Hub MPT (FP8046, FP8308 in eval; LLM-Foundry's own
finetune/mpt-7b_dolly_sft.yaml and mpt-30b-instruct.yaml), and flash-attention 2 where flash-attn
is not installed (FP8029, in a run: the machine that trains)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

HF = {"name": "hf_causal_lm", "pretrained": True, "pretrained_model_name_or_path": "gpt2"}
MPT_HUB = {
    **HF,
    "pretrained_model_name_or_path": "mosaicml/mpt-7b",
    "config_overrides": {"attn_config": {"attn_impl": "flash"}},
}


def _found(
    model: dict[str, Any], rule: str, scope: str = "file", flash_attn: str | None = None
) -> list[tuple[str, str]]:
    context = LintContext(scope=scope, snapshot=Snapshot(python="3.11", flash_attn=flash_attn))
    return [(f.key, f.severity) for f in lint_config({"model": model}, context) if f.rule == rule]


def test_a_hub_mpt_in_a_train_config_and_its_lines(tmp_path: Path):
    assert _found(MPT_HUB, "FP8046") == [("model.pretrained_model_name_or_path", "error")]
    assert (
        _found({**MPT_HUB, "pretrained_model_name_or_path": "mosaicml/mpt-7b-instruct"}, "FP8046")
        != []
    )
    assert _found(HF, "FP8046") == []
    assert _found({**HF, "pretrained_model_name_or_path": "./mosaicml/mpt-7b"}, "FP8046") == []
    path = tmp_path / "ft.yaml"
    path.write_text(
        "model:\n  name: hf_causal_lm\n  pretrained: true\n"
        "  pretrained_model_name_or_path: mosaicml/mpt-7b\n"
    )
    found = [
        (f["key"], f["line"])
        for f in lint_file(path, 1, Snapshot(python="3.11"))["findings"]
        if f["rule"] == "FP8046"
    ]
    assert found == [("model.pretrained_model_name_or_path", 4)]


def test_a_hub_mpt_in_an_eval_config(tmp_path: Path):
    path = tmp_path / "eval.yaml"
    path.write_text(
        "max_seq_len: 1024\ndevice_eval_batch_size: 4\nmodels:\n- model_name: mpt\n"
        "  model:\n    name: hf_causal_lm\n"
        "    pretrained_model_name_or_path: mosaicml/mpt-7b\n"
        "  tokenizer:\n    name: mosaicml/mpt-7b\n"
    )
    found = [
        (f["rule"], f["key"], f["line"])
        for f in lint_file(path, 1, Snapshot(python="3.11"))["findings"]
    ]
    assert ("FP8308", "models.0.model.pretrained_model_name_or_path", 7) in found


@pytest.mark.parametrize(
    ("model", "installed", "expected"),
    [
        ({**HF, "use_flash_attention_2": True}, None, [("model.use_flash_attention_2", "error")]),
        (
            {**HF, "attn_implementation": "flash_attention_2"},
            "1.0.9",
            [("model.attn_implementation", "error")],
        ),
        ({**HF, "use_flash_attention_2": True}, "2.7.4.post1", []),
        ({**HF, "use_flash_attention_2": False}, None, []),
        ({**HF, "attn_implementation": "sdpa"}, None, []),
    ],
)
def test_flash_attention_2_in_a_run(model, installed, expected):
    assert _found(model, "FP8029", "run", installed) == expected
    assert _found(model, "FP8029", "file", installed) == []  # files: the GPU machine may have it


def test_the_reference_composer_hf_causal_lm_refuses_both(monkeypatch):
    """The installed LLM-Foundry, offline, on this machine without flash-attn: both raise
    ValueError before any download."""
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    from llmfoundry.models.hf import ComposerHFCausalLM

    from foundry_fp8.environment import gather_snapshot

    assert gather_snapshot(probe_te_import=False).flash_attn is None
    with pytest.raises(ValueError, match="MPT series of models on the Hugging Face Hub"):
        ComposerHFCausalLM(
            tokenizer=None, pretrained=False, pretrained_model_name_or_path="mosaicml/mpt-7b"
        )
    with pytest.raises(ValueError, match="flash-attention 2 is not installed"):
        ComposerHFCausalLM(
            tokenizer=None,
            pretrained=False,
            pretrained_model_name_or_path="gpt2",
            use_flash_attention_2=True,
        )
