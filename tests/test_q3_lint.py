"""QA s22 (Q3): attention settings LLM-Foundry's MPT refuses when it builds the model (checked
against MPT itself on the meta device), and findings inside a section written as one
interpolation (`model: ${variables.model}`) at the line where the value is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file
from tests.mpt_yaml import finetuning_train, line_of, mpt_refuses, mpt_train


@pytest.mark.parametrize(("attn", "key"), [
    ({"qk_ln": True, "qk_gn": True}, "qk_gn"),  # before: no finding
    ({"kv_dim": 128}, "kv_dim"),  # fused_qkv defaults to true; before: no finding
    ({"kv_dim": 256, "fused_qkv": True}, "kv_dim"),  # before: no finding
    ({"kv_dim": 128, "fused_qkv": False}, "kv_dim"),  # the first forward; before: no finding
    ({"kv_dim": 256, "fused_qkv": False}, None),
    ({"qk_gn": True}, None),
])
def test_attention_pairs_mpt_refuses_are_fp8035_at_their_line(tmp_path, attn, key):
    refused = mpt_refuses(attn)
    assert (refused is None) == (key is None), refused
    text = mpt_train(attn)
    path = tmp_path / "train.yaml"
    path.write_text(text)
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [f for f in entry["findings"] if f["rule"] == "FP8035"]
    if key is None:
        assert hits == []
        return
    assert [(f["key"], f["severity"]) for f in hits] == [(f"model.attn_config.{key}", "error")]
    assert text.splitlines()[hits[0]["line"] - 1].strip().startswith(f"{key}:")
    assert refused.split(" (")[0] in hits[0]["message"]  # torch adds the shapes in brackets


def test_eval_models_get_the_attention_refusals_as_fp8311(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("max_seq_len: 128\ndevice_eval_batch_size: 4\nprecision: amp_bf16\n"
                    "icl_tasks: []\nmodels:\n- model_name: mpt\n  tokenizer:\n"
                    "    name: EleutherAI/gpt-neox-20b\n  model:\n    name: mpt_causal_lm\n"
                    "    d_model: 256\n    n_heads: 4\n    n_layers: 2\n    max_seq_len: 128\n"
                    "    attn_config:\n      attn_impl: torch\n      kv_dim: 128\n")
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [(f["rule"], f["key"], f["line"]) for f in entry["findings"] if f["rule"] == "FP8311"]
    assert hits == [("FP8311", "models.0.model.attn_config.kv_dim", 17)]


# -- findings beneath `model: ${variables.model}` stand where the value is written ----------

VARIABLES = """\
variables:
  max_seq_len: 128
  attn:
    attn_impl: torch
    qk_ln: true
    qk_gn: true
  model:
    name: mpt_causal_lm
    d_model: 2056
    n_heads: 4
    n_layers: 2
    max_seq_len: ${variables.max_seq_len}
    loss_fn: torch_crossentropy
    fc_type: te
    attn_config: ${variables.attn}
max_seq_len: ${variables.max_seq_len}
model: ${variables.model}
"""


@pytest.mark.parametrize("mcli", [False, True])
def test_a_finding_in_an_interpolated_section_is_at_the_line_that_writes_it(tmp_path, mcli):
    """Before: each stood at `model:`'s line (the nearest key the file writes there)."""
    train = mpt_train()
    text = VARIABLES + train[train.index("tokenizer:"):].replace("amp_bf16", "amp_fp8")
    if mcli:  # MCLI resolves `parameters` as its own document: absolute paths start there
        text = ("name: x\nimage: y\ncommand: composer train.py /mnt/config/parameters.yaml\n"
                "parameters:\n" + "".join(f"  {line}\n" for line in text.splitlines()))
    path = tmp_path / "train.yaml"
    path.write_text(text)
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    prefix = "parameters." if mcli else ""
    hits = {f["key"]: f for f in entry["findings"] if f["rule"] in ("FP8005", "FP8035")}
    d_model, qk_gn = hits[f"{prefix}model.d_model"], hits[f"{prefix}model.attn_config.qk_gn"]
    assert d_model["line"] == line_of(text, "d_model: 2056")
    assert qk_gn["line"] == line_of(text, "qk_gn: true")
    assert f"(written at {prefix}variables.model.d_model, through `{prefix}model: " \
           "${variables.model}`)" in d_model["message"]
    # through two interpolations: model -> variables.model -> variables.attn
    assert f"(written at {prefix}variables.attn.qk_gn, through `{prefix}model: " \
           "${variables.model}`)" in qk_gn["message"]


def test_written_at_follows_relative_and_list_interpolations():
    from foundry_fp8.lint.load import compose, key_positions, node_interpolations, written_at

    text = ("variables:\n  loaders:\n  - name: text\n    dataset: {split: val}\n"
            "  base: {d_model: 64}\n  model: ${.base}\neval_loader: ${variables.loaders}\n"
            "model: ${..variables.model}\nother:\n  deep: ${variables.loaders[0]}\n"
            "scalar: ${variables.base.d_model}\nmixed: a${variables.base}\n")
    root = compose(Path("x.yaml"), text)
    positions, _ = key_positions(root)
    taken = node_interpolations(root)
    assert taken == {"variables.model": ("variables.base", "${.base}"),
                     "eval_loader": ("variables.loaders", "${variables.loaders}"),
                     "model": ("variables.model", "${..variables.model}"),
                     "other.deep": ("variables.loaders.0", "${variables.loaders[0]}"),
                     "scalar": ("variables.base.d_model", "${variables.base.d_model}")}
    assert written_at("eval_loader.0.dataset.split", positions, taken)[0] == \
        "variables.loaders.0.dataset.split"
    assert written_at("model.d_model", positions, taken)[0] == "variables.base.d_model"
    assert written_at("other.deep.name", positions, taken)[0] == "variables.loaders.0.name"
    assert written_at("model.n_heads", positions, taken) == (
        "variables.base.n_heads", " (through `model: ${..variables.model}`)")  # not written
    assert written_at("scalar", positions, taken) is None  # the key itself is written there
    assert written_at("variables.loaders.0.name", positions, taken) is None


# -- FP8006 and the finetuning collator's shorter batches -----------------------------------

def _collated_lengths(tiny_data, **options: bool) -> list[int]:
    """The sequence lengths LLM-Foundry's own finetuning collator gives batches of examples
    of different lengths (the first batch is never trimmed)."""
    from llmfoundry.data.finetuning.collator import Seq2SeqFinetuningCollator
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_data.tokenizer_dir))
    collate = Seq2SeqFinetuningCollator(tokenizer, max_seq_len=64, decoder_only_format=True,
                                        **options)
    return [collate([{"turns": [{"input_ids": [5] * n, "labels": [6] * 2}]}])["input_ids"]
            .shape[1] for n in (20, 20, 9, 13, 30)]


@pytest.mark.parametrize(("option", "micro"), [
    ("pad_to_longest", 4),  # before: no finding (TE's forward assert on 4 x 23 tokens)
    ("pad_to_longest", 8),  # before: no finding (8 x 23 tokens: not a multiple of 16)
    ("pad_to_longest", 16),
    ("allow_pad_trimming", 1),  # before: no finding (1 x 24 tokens)
    ("allow_pad_trimming", 2),
])
def test_fp8006_judges_the_finetuning_collators_shorter_batches(tmp_path, tiny_data, option,
                                                                micro):
    lengths = _collated_lengths(tiny_data, **{option: True})
    assert lengths != [64] * len(lengths)  # the option does shorten batches
    want = "error" if any(micro * n % 8 for n in lengths) else \
        "warning" if any(micro * n % 16 for n in lengths) else None
    text = finetuning_train(f"    {option}: true\n", micro)
    path = tmp_path / "train.yaml"
    path.write_text(text)
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [(f["key"], f["severity"], f["line"]) for f in entry["findings"]
            if f["rule"] == "FP8006"]
    assert hits == ([] if want is None else
                    [(f"train_loader.dataset.{option}", want, line_of(text, f"{option}:"))])
