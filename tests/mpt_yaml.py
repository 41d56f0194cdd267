"""The small MPT train config the lint tests write in the shapes users do, and LLM-Foundry's
own MPT as the reference for what it refuses (tests/test_q2_lint_configs.py, test_q3_lint.py)."""

from __future__ import annotations

import warnings
from typing import Any

_TRAIN = """\
variables:
  max_seq_len: 128
max_seq_len: ${{variables.max_seq_len}}
model:
  name: mpt_causal_lm
  init_device: meta
  d_model: 256
  n_heads: {n_heads}
  n_layers: 2
  max_seq_len: ${{variables.max_seq_len}}
  vocab_size: 50368
  loss_fn: torch_crossentropy
{model}  attn_config:
    attn_impl: torch
{attn}tokenizer:
  name: EleutherAI/gpt-neox-20b
train_loader:
  name: text
  dataset:
    local: ./c4
    split: train
    max_seq_len: ${{variables.max_seq_len}}
  drop_last: true
  num_workers: 8
scheduler:
  name: cosine_with_warmup
  t_warmup: 10ba
optimizer:
  name: decoupled_adamw
  lr: 6.0e-4
max_duration: 10ba
global_train_batch_size: 64
device_train_microbatch_size: 8
precision: {precision}
fsdp_config:
  sharding_strategy: FULL_SHARD
"""


def mpt_train(attn: dict[str, Any] | None = None, n_heads: int = 4, fc_type: str | None = None,
              precision: str = "amp_bf16") -> str:
    """The train YAML with these attn_config keys written after `attn_impl: torch`."""
    return _TRAIN.format(
        n_heads=n_heads, precision=precision,
        model=f"  fc_type: {fc_type}\n" if fc_type else "",
        attn="".join(f"    {k}: {str(v).lower()}\n" for k, v in (attn or {}).items()))


def mpt_refuses(attn: dict[str, Any], n_heads: int = 4) -> str | None:
    """What LLM-Foundry's own MPT raises building a tiny model with this attn_config, or in its
    first forward (on CPU, fc_type torch: TE is not installed here)."""
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = MPTForCausalLM(MPTConfig(d_model=256, n_heads=n_heads, n_layers=1,
                                             max_seq_len=16, vocab_size=64,
                                             loss_fn="torch_crossentropy",
                                             attn_config={"attn_impl": "torch", **attn}))
            model(input_ids=torch.ones(1, 8, dtype=torch.long))
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def line_of(text: str, written: str) -> int:
    """The line of the one line that holds `written`."""
    (line,) = [i for i, text_line in enumerate(text.splitlines(), 1) if written in text_line]
    return line


def finetuning_train(dataset: str, micro: int, seq: int = 2048) -> str:
    """`mpt_train` for TE in FP8 with LLM-Foundry's finetuning loader: `dataset` the loader's
    extra dataset lines (each indented four spaces), `micro` the micro-batch size."""
    train = mpt_train(fc_type="te", precision="amp_fp8")
    loader = ("train_loader:\n  name: finetuning\n  dataset:\n    hf_name: tatsu-lab/alpaca\n"
              f"    split: train\n    max_seq_len: {seq}\n    decoder_only_format: true\n"
              f"{dataset}  drop_last: true\n  num_workers: 8\n")
    start, end = train.index("train_loader:"), train.index("scheduler:")
    return (train[:start] + loader + train[end:]).replace(
        "device_train_microbatch_size: 8", f"device_train_microbatch_size: {micro}")


#: The 2-block MPT the layer-name lint tests write as `model:` and build as the reference.
TINY_MPT = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2,
            "max_seq_len": 16, "vocab_size": 64, "loss_fn": "torch_crossentropy",
            "attn_config": {"attn_impl": "torch"}}


def build_tiny_mpt(**extra: Any) -> Any:
    """LLM-Foundry's own model for TINY_MPT (with `extra` model keys), as train builds it."""
    from llmfoundry.utils.builders import build_composer_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_composer_model(name="mpt_causal_lm", tokenizer=None, cfg={
            **{k: v for k, v in TINY_MPT.items() if k != "name"}, **extra})
