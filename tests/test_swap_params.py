"""te_swap's new parameters take the old ones' place in real LLM-Foundry runs: frozen stays frozen
(`optimizer.disable_grad`) and each keeps its own param group (`optimizer.param_groups`)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_run import run_folder, run_plain, run_tiny, tiny_config

FROZEN = "ffn"
SHORT = {"max_duration": "3ba", "eval_interval": "3ba", "save_interval": "3ba"}


def _ffn_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.state.model.named_parameters()
            if f".{FROZEN}." in n}


@pytest.mark.filterwarnings("ignore")
def test_layers_frozen_by_disable_grad_stay_frozen(tmp_path, tiny_data):
    """LLM-Foundry freezes by name before any algorithm runs; the converted layers used to come
    back trainable. The plain run's frozen weights are the init both runs share (seed 17)."""
    frozen = {**SHORT, "optimizer": {"disable_grad": FROZEN}}
    swapped = run_tiny(tmp_path / "swap", tiny_data, frozen)
    plain = run_plain(tmp_path / "plain", tiny_data, frozen)
    assert _ffn_weights(swapped).keys() == _ffn_weights(plain).keys()
    assert all(not p.requires_grad for n, p in swapped.state.model.named_parameters()
               if f".{FROZEN}." in n)
    for name, value in _ffn_weights(swapped).items():
        assert torch.equal(value, _ffn_weights(plain)[name]), name
    trained = [n for n, p in swapped.state.model.named_parameters() if p.requires_grad]
    assert trained and all(f".{FROZEN}." not in n for n in trained)


@pytest.mark.filterwarnings("ignore")
def test_biases_keep_their_own_param_group(tmp_path, tiny_data):
    """LLM-Foundry's `param_str_match: bias` puts every bias in a group of its own (no weight
    decay), a layer's weight in another: Composer's module surgery refused that at INIT."""
    trainer = run_tiny(tmp_path, tiny_data, {**SHORT, "optimizer": {
        "weight_decay": 0.1, "param_groups": [{"param_str_match": "bias", "weight_decay": 0.0}]}})
    groups = trainer.state.optimizers[0].param_groups
    named = dict(trainer.state.model.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sorted(by_id[id(p)] for p in groups[1]["params"]) == sorted(
        n for n in named if "bias" in n)
    assert sorted(by_id[id(p)] for g in groups for p in g["params"]) == sorted(named)
    converted = dict(trainer.state.model.named_modules())["model.transformer.blocks.0.attn.Wqkv"]
    assert type(converted).__name__ == "EmulatedFP8Linear"
    assert any(p is converted.bias for p in groups[1]["params"])


@pytest.mark.filterwarnings("ignore")
def test_a_hugging_face_llama_converts_its_decoder_layers(tmp_path, tiny_data):
    """LLM-Foundry's `hf_causal_lm` builds Hugging Face decoders whose blocks are
    `model.layers.<n>`; te_swap refused them ("outside the transformer blocks") and, told to
    keep nothing, converted only the LM head. Now every decoder linear converts, keep_first_blocks
    counts those layers, the LM head stays (keep_lm_head), and the run trains in FP8."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                tie_word_embeddings=False).save_pretrained(tmp_path / "llama")
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {**SHORT,
                                            "algorithms": {"te_swap": {"keep_first_blocks": 1}}})
    cfg.model = {"name": "hf_causal_lm", "pretrained": False, "use_flash_attention_2": False,
                 "pretrained_model_name_or_path": str(tmp_path / "llama")}
    run_folder(tmp_path).mkdir(parents=True)
    trainer = train(cfg)
    kinds = {n.removeprefix("model.model."): type(m).__name__
             for n, m in trainer.state.model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    for layer in range(3):
        for projection in projections:
            want = "Linear" if layer == 0 else "EmulatedFP8Linear"
            assert kinds[f"layers.{layer}.{projection}"] == want, (layer, projection)
    assert kinds["model.lm_head"] == "Linear"
    assert torch.isfinite(trainer.state.loss)


def test_a_tied_lm_head_stays_tied_and_trained():
    """A Hugging Face LM head tied to the input embedding is a Linear sharing the embedding's
    weight: converting it (keep_lm_head: false) made an untied copy and took the embedding's
    weight out of the optimizer. It is kept, with the reason."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
    optimizer = torch.optim.AdamW(model.parameters())
    plan = plan_swap(model, SwapConfig(backend="emulate", keep_lm_head=False))
    [head] = [d for d in plan.decisions if d.name == "lm_head"]
    assert not head.convert and "tied to model.embed_tokens" in head.reason
    assert not any("tied to wte" in d.name for d in plan.decisions)
    apply_swap(model, plan, optimizers=optimizer)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters()}
    assert type(model.model.layers[1].mlp.up_proj).__name__ == "EmulatedFP8Linear"
