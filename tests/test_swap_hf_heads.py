"""te_swap finds a Hugging Face model's LM head by asking the model (`get_output_embeddings()`),
not by the name `lm_head`: GPT-NeoX's (Pythia's) is `embed_out`. Before, it was "outside the
transformer blocks", so `keep_lm_head: false` never converted it and the coverage table gave
the wrong reason for keeping it."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.emulate import EmulatedFP8Linear


def _pythia() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4))


def test_gpt_neox_embed_out_is_kept_as_the_lm_head():
    model = _pythia()
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"))
    assert model.get_output_embeddings() is model.embed_out  # transformers' own answer
    reasons = {d.name: d.reason for d in plan.decisions}
    assert reasons["embed_out"] == "LM head kept in high precision (keep_lm_head)"


def test_keep_lm_head_false_converts_embed_out_and_the_model_still_saves(tmp_path):
    reference = _pythia()
    model = copy.deepcopy(reference)
    plan = convert_to_fp8(model, SwapConfig(backend="emulate", keep_lm_head=False))
    assert isinstance(model.embed_out, EmulatedFP8Linear)
    assert plan.fp8_flops_share == pytest.approx(1.0)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = reference(ids, labels=ids)
        assert torch.equal(model(ids).logits, expected.logits)  # outside the autocast: plain
        with fp8_autocast(recipe=FP8Recipe()):
            fp8 = model(ids, labels=ids)
    assert not torch.equal(fp8.logits, expected.logits)
    assert abs(fp8.loss.item() - expected.loss.item()) < 0.02
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, expected.logits)
