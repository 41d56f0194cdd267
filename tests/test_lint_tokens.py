"""FP8039 and FP8040 (foundry_fp8/lint/rules/tokens.py) against what Composer's Generate callback
and LLM-Foundry's MPT really hand TE's layers, run on CPU: the batches Generate passes to
model.generate and the precision context it enters, and the rows MPTBlock.apply_ffn gives the FFN
with use_pad_tok_in_ffn false. TE's multiple-of-8 assert itself is TE's
(transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec, foundry_fp8/shapes.py)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from foundry_fp8.lint.rules import LintContext, lint_config
from foundry_fp8.shapes import tokens_fit_fp8

FP8_TE = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "fc_type": "te",
                                            "loss_fn": "torch_crossentropy"}}
PROMPTS = ["The capital of France is", "Here is a quick story:", "Once upon a time",
           "The best way to learn is", "In the beginning", "My favourite food is",
           "The weather today is", "A long time ago", "Dear diary,", "To be or not to be"]


def _with(*edits: dict) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(e) for e in edits)))


def _rules(config: dict) -> dict[str, tuple[str, str]]:
    return {f.rule: (f.key, f.severity) for f in lint_config(config, LintContext())}


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p in PROMPTS for w in p.split()})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", eos_token="[EOS]")


def _generate_batches(monkeypatch: pytest.MonkeyPatch, prompts: int,
                      batch_size: int | None) -> tuple[list[int], list[tuple]]:
    """The batch sizes Composer's Generate hands model.generate for a tiny MPT, and the
    arguments of each precision context it enters (run under amp_fp8)."""
    from composer.callbacks import generate
    from composer.core import Precision
    from composer.devices import DeviceCPU
    from composer.models import HuggingFaceModel
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    contexts: list[tuple] = []

    @contextlib.contextmanager
    def precision_context(*args: Any, **kwargs: Any):
        contexts.append((args, kwargs))
        yield

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mpt = MPTForCausalLM(MPTConfig(d_model=32, n_heads=2, n_layers=1, max_seq_len=32,
                                       vocab_size=64, attn_config={"attn_impl": "torch"}))
        model = HuggingFaceModel(mpt, tokenizer=_tokenizer(), use_logits=True)
    rows: list[int] = []

    def fake_generate(input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        rows.append(input_ids.shape[0])
        return input_ids

    monkeypatch.setattr(generate, "get_precision_context", precision_context)
    monkeypatch.setattr(model, "generate", fake_generate)
    callback = generate.Generate(PROMPTS[:prompts], interval="1ba", batch_size=batch_size)
    state = SimpleNamespace(model=model, is_model_ddp=False, precision=Precision.AMP_FP8,
                            device=DeviceCPU(), timestamp=SimpleNamespace(batch=1))
    callback.generate(state, SimpleNamespace(log_table=lambda **_: None))
    return rows, contexts


@pytest.mark.parametrize(("prompts", "batch_size"), [
    (2, None),  # QA's repro: before, no finding; TE asserts on the first decode step
    (8, None), (8, 4), (10, 8), (8, 8), (10, 5), (1, None),
])
def test_fp8039_fires_iff_a_generate_batch_is_not_a_multiple_of_8(monkeypatch, prompts,
                                                                    batch_size):
    from composer.core import Precision, get_precision_context

    rows, contexts = _generate_batches(monkeypatch, prompts, batch_size)
    # Generate enters amp_fp8's context with FP8 autocast at its default, enabled
    assert len(contexts) == len(rows)
    assert all(args == (Precision.AMP_FP8,) and kwargs == {} for args, kwargs in contexts)
    assert inspect.signature(get_precision_context).parameters[
        "fp8_autocast_enabled"].default is True
    callback = {"prompts": PROMPTS[:prompts], "interval": "500ba", "max_new_tokens": 16,
                **({"batch_size": batch_size} if batch_size else {})}
    found = _rules(_with(FP8_TE, {"callbacks": {"generate_callback": callback}}))
    crashes = not all(tokens_fit_fp8(r) for r in rows)
    assert ("FP8039" in found) == crashes, (rows, found)
    if crashes:
        assert found["FP8039"] == ("callbacks.generate_callback." + (
            "batch_size" if batch_size else "prompts"), "error")


def test_fp8039_counts_beams_and_judges_only_te():
    eight = {"prompts": PROMPTS[:8], "interval": "500ba"}
    two_beams = {"prompts": PROMPTS[:4], "interval": "500ba", "num_beams": 2}  # 8 rows
    assert "FP8039" not in _rules(_with(FP8_TE, {"callbacks": {"generate_callback": two_beams}}))
    three = {**two_beams, "num_beams": 3}
    assert "FP8039" in _rules(_with(FP8_TE, {"callbacks": {"generate_callback": three}}))
    odd = {"prompts": PROMPTS[:3], "interval": "500ba"}
    te_swap = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm"},
               "callbacks": {"generate_callback": odd}}
    assert "FP8039" in _rules(_with(te_swap, {"algorithms": {"te_swap": {}}}))
    # te_swap's emulated backend is not TE, and amp_bf16 enters no FP8 autocast
    assert "FP8039" not in _rules(_with(te_swap, {"algorithms": {"te_swap": {"backend":
                                                                              "emulate"}}}))
    assert "FP8039" not in _rules(_with(FP8_TE, {"precision": "amp_bf16", "callbacks": {
        "generate_callback": odd}}))
    # MPT dropping the left padding before its FFN: no batch size is safe
    unpadded = _with(FP8_TE, {"model": {"use_pad_tok_in_ffn": False},
                              "callbacks": {"generate_callback": eight}})
    assert _rules(unpadded)["FP8039"] == ("callbacks.generate_callback", "error")


TE_SWAP = {"algorithms": {"te_swap": {}}}  # backend te, its default
ODD = {"callbacks": {"generate_callback": {"prompts": PROMPTS[:3], "interval": "500ba"}}}
MPT = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "loss_fn": "torch_crossentropy"}}


@pytest.mark.parametrize(("edits", "severity"), [
    ((TE_SWAP,), "info"),  # te_swap's converted layers only
    (({"model": {"fc_type": "te"}}, TE_SWAP), "info"),  # the model's own, kept in te_swap's plan
    (({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}}, TE_SWAP), "info"),
    (({"model": {"fc_type": "te", "use_pad_tok_in_ffn": False}}, TE_SWAP), "info"),
    (({"model": {"fc_type": "te"}},), "error"),  # nothing takes generate out of FP8
    (({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}},), "error"),
    (({"model": {"fc_type": "te"}}, {"algorithms": {"te_swap": {"backend": "emulate"}}}),
     "error"),  # emulate hooks none of TE's layers
])
def test_fp8039_is_an_info_when_te_swap_runs_generate_in_high_precision(edits, severity):
    """te_swap's te backend keeps every TE FP8 module of its plan (converted, or the model's own
    as `already_fp8`) in TE's disabled region for an eval-mode no-grad forward, HF generate's
    (the next test): before, FP8039 was an error for all of these."""
    key, found = _rules(_with(MPT, ODD, *edits))["FP8039"]
    assert found == severity
    assert key.startswith("callbacks.generate_callback")


def test_te_swap_runs_the_model_s_own_te_layers_in_high_precision_in_generate(fake_te,
                                                                              monkeypatch):
    """What FP8039's info rests on, against the TE stand-in with TE's switch modelled (a TE
    module runs FP8 iff the innermost autocast is enabled): in a generate inside an enabled
    autocast (the Generate callback's), the model's own te.Linear runs FP8 in every forward
    without te_swap, and in none once te_swap (backend te) ran INIT, nor do the layers it
    converts."""
    import sys

    import transformers
    from composer.core import Event, Precision, State
    from composer.devices import DeviceCPU
    from composer.loggers import Logger

    from foundry_fp8.composer import te_swap
    from foundry_fp8.te import probe

    fake_te()
    te = sys.modules["transformer_engine.pytorch"]
    stack: list[bool] = []

    @contextlib.contextmanager
    def autocast(enabled: bool = True, recipe: Any = None):
        del recipe
        stack.append(enabled)
        try:
            yield
        finally:
            stack.pop()

    te.autocast = autocast
    monkeypatch.setattr(probe, "active_recipe", lambda: "on" if stack and stack[-1] else None)
    seen: dict[str, list[bool]] = {"own": [], "converted": []}
    forward = te.Linear.forward

    def recording(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen["own" if getattr(self, "own", False) else "converted"].append(
            bool(stack) and stack[-1])
        return forward(self, x)

    monkeypatch.setattr(te.Linear, "forward", recording)
    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)  # no GPU here
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    for layer in model.model.layers:  # the model's own TE layer, as fc_type te builds them
        layer.mlp.down_proj = te.Linear(128, 64, bias=False, device="cpu")
        layer.mlp.down_proj.own = True
    ids = torch.randint(0, 256, (1, 5))

    def generate() -> None:  # as composer/callbacks/generate.py does: eval(), then the context
        model.eval()
        with autocast(enabled=True):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)

    generate()
    assert seen["own"] == [True] * 2 * 3 and seen["converted"] == []  # 2 layers x 3 steps
    state = State(model=model, rank_zero_seed=0, run_name="gen", device=DeviceCPU(),
                  precision=Precision.AMP_FP8)
    te_swap.TESwap(backend="te").apply(Event.INIT, state, Logger(state))
    seen["own"].clear()
    generate()
    assert seen["own"] == [False] * 2 * 3
    assert len(seen["converted"]) == 6 * 2 * 3 and not any(seen["converted"])


def _unpad(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn.bert_padding.unpad_input's contract for what apply_ffn uses: the real
    tokens, flattened, and their indices."""
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    return hidden.flatten(0, 1)[indices], indices


def _pad(hidden: torch.Tensor, indices: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    out = hidden.new_zeros(batch * seq, *hidden.shape[1:])
    out[indices] = hidden
    return out.view(batch, seq, *hidden.shape[1:])


@pytest.mark.parametrize("pad_tokens", [True, False])
def test_mpt_hands_its_ffn_only_the_real_tokens_without_pad_tokens_in_ffn(monkeypatch,
                                                                          pad_tokens):
    """LLM-Foundry's MPTBlock.apply_ffn (flash-attn's unpad/pad, not installed here, replaced
    by their contract): with use_pad_tok_in_ffn false the FFN's rows are the batch's real
    tokens, 8 x 16 - 3 here, which TE's FP8 GEMMs refuse."""
    from llmfoundry.models.layers import blocks

    monkeypatch.setattr(blocks, "unpad_input", _unpad, raising=False)
    monkeypatch.setattr(blocks, "pad_input", _pad, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = blocks.MPTBlock(d_model=32, n_heads=2, expansion_ratio=2,
                                attn_config={"attn_type": "multihead_attention",
                                             "attn_impl": "torch"},
                                ffn_config={"ffn_type": "mptmlp"},
                                use_pad_tok_in_ffn=pad_tokens)
    rows: list[int] = []
    block.ffn.register_forward_pre_hook(lambda _, args: rows.append(
        args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    mask = torch.ones(8, 16, dtype=torch.bool)
    mask[0, -3:] = False  # one sample padded by 3 tokens
    block.apply_ffn(mask, torch.randn(8, 16, 32))
    assert rows == [128 if pad_tokens else 125]
    config = _with(FP8_TE, {"model": {"use_pad_tok_in_ffn": pad_tokens},
                            "train_loader": {"name": "finetuning"}})
    assert ("FP8040" in _rules(config)) == (not tokens_fit_fp8(rows[0]))


def test_llmfoundrys_finetuning_collator_pads_every_batch():
    """Why FP8040 is an error with the finetuning loader: its collator pads examples of
    different lengths (attention mask 0 on the padding)."""
    from llmfoundry.data.finetuning.collator import Seq2SeqFinetuningCollator

    tokenizer = _tokenizer()
    collate = Seq2SeqFinetuningCollator(tokenizer, max_seq_len=16, decoder_only_format=True)
    batch = collate([{"turns": [{"input_ids": [5, 6, 7], "labels": [8, 2]}]},
                     {"turns": [{"input_ids": [5, 6, 7, 9, 10], "labels": [11, 12, 2]}]}])
    assert int(batch["attention_mask"].sum()) == 13 < batch["attention_mask"].numel()
    unpadded = _with(FP8_TE, {"model": {"use_pad_tok_in_ffn": False},
                              "train_loader": {"name": "finetuning"}})
    assert _rules(unpadded)["FP8040"][1] == "error"


def test_fp8040_judges_the_ffns_te_layers_and_the_loader():
    unpadded = {"model": {"use_pad_tok_in_ffn": False}}
    finetuning, text = {"train_loader": {"name": "finetuning"}}, {"train_loader": {"name": "text"}}
    assert _rules(_with(FP8_TE, unpadded, finetuning))["FP8040"] == (
        "model.use_pad_tok_in_ffn", "error")
    assert _rules(_with(FP8_TE, unpadded, text))["FP8040"] == (
        "model.use_pad_tok_in_ffn", "warning")  # only samples shorter than max_seq_len pad
    swap = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "d_model": 256,
                                              "n_heads": 4, "n_layers": 2}}
    assert "FP8040" in _rules(_with(swap, unpadded, finetuning, {"algorithms": {"te_swap": {}}}))
    # te_swap keeping every FFN layer out of FP8, or emulating: nothing TE in the FFN
    attention_only = {"algorithms": {"te_swap": {"include": r"\.attn\."}}}
    assert "FP8040" not in _rules(_with(swap, unpadded, finetuning, attention_only))
    emulated = {"algorithms": {"te_swap": {"backend": "emulate"}}}
    assert "FP8040" not in _rules(_with(swap, unpadded, finetuning, emulated))
    te_ln_mlp = {"model": {"name": "mpt_causal_lm", "ffn_config": {"ffn_type": "te_ln_mlp"}}}
    assert _rules(_with({"precision": "amp_fp8"}, te_ln_mlp, unpadded, finetuning))[
        "FP8040"][1] == "error"
    assert "FP8040" not in _rules(_with(FP8_TE, finetuning))  # the default keeps padding
