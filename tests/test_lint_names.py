"""Sections LLM-Foundry builds by their `name` (the loaders, model, tokenizer, optimizer,
scheduler) written without one in a whole train config (FP8053), and the label every item of an
`eval_loader` list needs whatever its loader (FP8047). The reference is LLM-Foundry's own train
path: omegaconf's load, make_dataclass_and_log_config and validate_config on the same file
(`tests.foundry_train`), and `train()` itself for the names only it reads."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.train import NAME_READS
from tests.foundry_train import train_refusal

pytest.importorskip("llmfoundry")

_TEXT_LOADER = """
  name: text
  dataset:
    local: /data/c4
    split: {split}
    shuffle: {shuffle}
    max_seq_len: 2048
    eos_token_id: 0
  drop_last: {shuffle}
  num_workers: 8
"""

#: Train configs in the shapes of LLM-Foundry's scripts/train/yamls (pretrain/mpt-125m.yaml,
#: finetune/mpt-7b_dolly_sft.yaml, a multi-eval pretraining run, an HF model with ICL tasks),
#: written here: each passes LLM-Foundry's config loader (the finetune one's Hub `mosaicml/mpt-7b`
#: is refused later, building the model: FP8046).
CONFIGS = {
    "mpt-pretrain": f"""
variables:
  global_seed: 17
max_seq_len: 2048
run_name: mpt-125m
model:
  name: mpt_causal_lm
  init_device: meta
  d_model: 768
  n_heads: 12
  n_layers: 12
  expansion_ratio: 4
  max_seq_len: 2048
  vocab_size: 50368
  attn_config:
    attn_impl: flash
tokenizer:
  name: EleutherAI/gpt-neox-20b
  kwargs:
    model_max_length: 2048
train_loader:{_TEXT_LOADER.format(split="train", shuffle="true")}
eval_loader:{_TEXT_LOADER.format(split="val", shuffle="false")}
scheduler:
  name: cosine_with_warmup
  t_warmup: 100ba
  alpha_f: 0.1
optimizer:
  name: decoupled_adamw
  lr: 6.0e-4
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.0
algorithms:
  gradient_clipping:
    clipping_type: norm
    clipping_threshold: 1.0
max_duration: 4800ba
eval_interval: 500ba
eval_first: false
eval_subset_num_batches: -1
global_train_batch_size: 256
seed: ${{variables.global_seed}}
device_eval_batch_size: 16
device_train_microbatch_size: 16
precision: amp_bf16
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: PURE
  activation_checkpointing: false
  limit_all_gathers: true
progress_bar: false
log_to_console: true
console_log_interval: 1ba
callbacks:
  speed_monitor:
    window_size: 10
  lr_monitor: {{}}
  memory_monitor: {{}}
  runtime_estimator: {{}}
""",
    "mpt-finetune": """
variables:
  max_seq_len: 2048
max_seq_len: ${variables.max_seq_len}
model:
  name: hf_causal_lm
  pretrained: true
  pretrained_model_name_or_path: mosaicml/mpt-7b
  config_overrides:
    attn_config:
      attn_impl: flash
tokenizer:
  name: mosaicml/mpt-7b
  kwargs:
    model_max_length: ${variables.max_seq_len}
train_loader:
  name: finetuning
  dataset:
    hf_name: mosaicml/dolly_hhrlhf
    split: train
    max_seq_len: ${variables.max_seq_len}
    allow_pad_trimming: false
    decoder_only_format: true
    shuffle: true
  drop_last: true
  num_workers: 8
  pin_memory: false
  prefetch_factor: 2
  persistent_workers: true
  timeout: 0
eval_loader:
  name: finetuning
  dataset:
    hf_name: mosaicml/dolly_hhrlhf
    split: test
    max_seq_len: ${variables.max_seq_len}
    decoder_only_format: true
    shuffle: false
  drop_last: true
  num_workers: 8
scheduler:
  name: linear_decay_with_warmup
  t_warmup: 50ba
  alpha_f: 0
optimizer:
  name: decoupled_lionw
  lr: 5.0e-7
  betas: [0.9, 0.99]
  weight_decay: 0
algorithms:
  gradient_clipping:
    clipping_type: norm
    clipping_threshold: 1.0
max_duration: 2ep
eval_interval: 1ep
eval_first: false
global_train_batch_size: 64
seed: 17
device_eval_batch_size: 8
device_train_microbatch_size: auto
precision: amp_bf16
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: PURE
  activation_checkpointing: true
  activation_checkpointing_reentrant: false
  activation_cpu_offload: false
  limit_all_gathers: true
""",
    "multi-eval": f"""
max_seq_len: 1024
model:
  name: mpt_causal_lm
  d_model: 1024
  n_heads: 16
  n_layers: 24
  max_seq_len: 1024
  vocab_size: 50368
  fc_type: te
tokenizer:
  name: EleutherAI/gpt-neox-20b
train_loader:{_TEXT_LOADER.format(split="train", shuffle="true")}
eval_loader:
- label: c4
{_TEXT_LOADER.format(split="val", shuffle="false")}
- label: arxiv
  name: text
  dataset:
    local: /data/arxiv
    split: val
    max_seq_len: 1024
  drop_last: false
  num_workers: 4
scheduler:
  name: constant_with_warmup
  t_warmup: 10ba
optimizer:
  name: decoupled_adamw
  lr: 2.0e-4
max_duration: 1000ba
eval_interval: 100ba
global_train_batch_size: 512
device_eval_batch_size: 8
device_train_microbatch_size: 8
precision: amp_fp8
""",
    "hf-icl": """
max_seq_len: 4096
model:
  name: hf_causal_lm
  pretrained_model_name_or_path: meta-llama/Llama-3.1-8B
  pretrained: true
  use_flash_attention_2: true
tokenizer:
  name: meta-llama/Llama-3.1-8B
train_loader:
  name: finetuning
  dataset:
    hf_name: tatsu-lab/alpaca
    split: train
    max_seq_len: 4096
    shuffle: true
  drop_last: true
  num_workers: 8
eval_loaders:
- label: alpaca
  name: finetuning
  dataset:
    hf_name: tatsu-lab/alpaca
    split: train
    max_seq_len: 4096
    shuffle: false
  drop_last: false
  num_workers: 8
icl_tasks:
- label: hellaswag
  dataset_uri: eval/local_data/language_understanding/hellaswag.jsonl
  num_fewshot: [0]
  icl_task_type: multiple_choice
scheduler:
  name: cosine_with_warmup
  t_warmup: 0.05dur
optimizer:
  name: decoupled_adamw
  lr: 1.0e-5
max_duration: 1ep
global_train_batch_size: 32
device_eval_batch_size: 4
device_train_microbatch_size: 2
precision: amp_bf16
loggers:
  wandb: {}
""",
}


def _sections(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted key, section) for every section built by name: each loader (each item of a
    loader list) and NAME_READS' sections."""
    for key in ("train_loader", "eval_loader", "eval_loaders", *NAME_READS):
        value = config.get(key)
        if isinstance(value, dict):
            yield key, value
        elif isinstance(value, list):
            yield from ((f"{key}.{i}", item) for i, item in enumerate(value))


def _at(config: dict[str, Any], key: str) -> dict[str, Any]:
    head, _, index = key.partition(".")
    return config[head][int(index)] if index else config[head]


def _mutants(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The config with one section's `name` dropped, misspelt or emptied, and each list item's
    `label` dropped or nulled (with and without its name)."""
    for key, _ in _sections(config):
        for how in ("drop", "typo", "empty"):
            mutant = copy.deepcopy(config)
            section = _at(mutant, key)
            if how == "drop":
                del section["name"]
            elif how == "typo":
                section["Name"] = section.pop("name")
            else:
                section.clear()
            yield f"{key} {how}", mutant
        if "label" in _at(config, key):
            for how in ("drop label", "null label", "drop label and name"):
                mutant = copy.deepcopy(config)
                section = _at(mutant, key)
                section.pop("label") if how != "null label" else section.update(label=None)
                if how.endswith("name"):
                    del section["name"]
                yield f"{key} {how}", mutant


def _line(text: str, key: str) -> int:
    """The 1-based line of `key` (a top-level key, or `key.<i>`: a list's item) as PyYAML's
    composer places it: the line a user is sent to."""
    root = yaml.compose(text)
    head, _, index = key.partition(".")
    node = next((k, v) for k, v in root.value if k.value == head)
    return (node[1].value[int(index)].start_mark.line if index else node[0].start_mark.line) + 1


def _lint(path: Path, rules: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(rule, key, line) of `rules`' findings at a section, a list item or the top level (not
    FP8047's findings about a key inside a loader, which are not this file's subject)."""
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return sorted((f["rule"], f["key"], f["line"]) for f in entry["findings"]
                  if f["rule"] in rules and re.fullmatch(r"[a-z_]+(\.\d+)?", f["key"]))


def _foundry_refusal(path: Path) -> str | None:
    """What LLM-Foundry's train path (load, make_dataclass_and_log_config, validate_config)
    raises on the file: "name" for KeyError 'name', "label" for validate_config's ValueError on
    an eval_loader item without a label, None when it takes the file; anything else is raised."""
    error = train_refusal(path)
    if isinstance(error, KeyError) and error.args == ("name",):
        return "name"
    if isinstance(error, ValueError) and "`label` attribute" in str(error):
        return "label"
    if error is not None:
        raise error
    return None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_loader_or_label_llmfoundry_refuses_is_flagged_and_nothing_else(tmp_path, name):
    """Each mutant validate_config refuses for a missing name (a loader's; the model's next to
    a text loader or icl_tasks) or an eval_loader item's label is flagged at that section's
    line; a section without name it takes is one of those only train() reads (NAME_READS, the
    next test's); nothing else is flagged."""
    base = yaml.safe_load(CONFIGS[name])
    path = tmp_path / "train.yaml"
    path.write_text(CONFIGS[name])
    assert _foundry_refusal(path) is None and _lint(path, ("FP8047", "FP8053")) == []
    wrong, refusals = [], {"name": 0, "label": 0, None: 0}
    for label, mutant in _mutants(base):
        text = yaml.safe_dump(mutant, sort_keys=False)
        path.write_text(text)
        refusal = _foundry_refusal(path)
        refusals[refusal] += 1
        key = label.split()[0]
        section = _at(mutant, key)
        # train() skips an empty tokenizer section (`if train_cfg.tokenizer:`)
        named = "name" not in section and (bool(section) or key != "tokenizer")
        assert named or refusal != "name"
        if named and refusal is None:  # a name validate_config does not read
            assert key in NAME_READS
        want = [("FP8053", key, _line(text, key))] if named else []
        if refusal == "label":
            want.append(("FP8047", key, _line(text, key)))
        if _lint(path, ("FP8047", "FP8053")) != sorted(want):
            wrong.append((label, refusal, _lint(path, ("FP8047", "FP8053")), want))
    assert not wrong
    assert refusals["name"] >= 6 and refusals[None] >= 3


def _fragments(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Parts of a config merged into a base one (an override file): each built-by-name section
    alone without its name, and those an eval config or a model file also holds (not
    `train_loader`, `optimizer`, `scheduler`: next to a setting they make a file a train config,
    FP8038) next to settings."""
    for key, _ in _sections(config):
        head = key.partition(".")[0]
        part = copy.deepcopy({k: config[k] for k in ("variables", head) if k in config})
        _at(part, key).pop("name", None)
        yield part
        if head not in ("train_loader", "optimizer", "scheduler"):
            yield {**part, "precision": "amp_bf16"}
            yield {**part, "seed": 3, "device_eval_batch_size": 4}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_fragment_without_names_is_not_flagged(tmp_path, name):
    path = tmp_path / "part.yaml"
    found = []
    for fragment in _fragments(yaml.safe_load(CONFIGS[name])):
        path.write_text(yaml.safe_dump(fragment, sort_keys=False))
        found += _lint(path, ("FP8053",))
    assert found == []


def test_train_raises_keyerror_name_where_fp8053_says(tmp_path):
    """The names only train() reads before the model: tokenizer (a section that is not empty)
    and scheduler, at the lines NAME_READS gives; an empty tokenizer is skipped there."""
    from llmfoundry.command_utils.train import train
    from omegaconf import OmegaConf

    base = yaml.safe_load(CONFIGS["mpt-finetune"])
    base["model"] = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2,
                     "max_seq_len": 64, "vocab_size": 512}
    base.pop("fsdp_config")
    base.update(precision="fp32", max_seq_len=64, variables={"max_seq_len": 64})
    for key, tokenizer in (("tokenizer", {"kwargs": {}}), ("scheduler", {})):
        config = copy.deepcopy(base)
        config["tokenizer"] = tokenizer
        config[key].pop("name", None)
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        assert [k for _, k, _ in _lint(path, ("FP8053",))] == [key]
        with warnings.catch_warnings(), pytest.raises(KeyError) as raised:
            warnings.simplefilter("ignore")
            train(OmegaConf.create(config))
        assert raised.value.args == ("name",)
        frame = raised.traceback[-1]
        assert (Path(str(frame.path)).name, frame.lineno + 1) == ("train.py", NAME_READS[key][0])



class _FitStarted(Exception):
    """Raised in place of Trainer.fit: train() built everything and was about to train."""


def _name_line(text: str, key: str) -> int:
    """The 1-based line of the `name:` key of the section at `key` (as `_line` finds it)."""
    root = yaml.compose(text)
    head, _, index = key.partition(".")
    node = next(v for k, v in root.value if k.value == head)
    node = node.value[int(index)] if index else node
    return next(k for k, _ in node.value if k.value == "name").start_mark.line + 1


@pytest.mark.parametrize("how", [None, ""])
def test_a_null_or_empty_name_fails_train_before_training_where_fp8053_says(
        tmp_path, tiny_data, monkeypatch, how):
    """validate_config takes a null or empty name; train() looks it up when it builds the
    section and fails (RegistryError, AssertionError, transformers' OSError or
    HFValidationError) before it trains. The unchanged run gets to Trainer.fit and has no
    FP8053."""
    from composer import Trainer
    from llmfoundry.command_utils.train import train
    from omegaconf import OmegaConf

    from tests.tiny_run import tiny_config

    def fit(self: Any, *args: Any, **kwargs: Any) -> None:
        self.close()
        raise _FitStarted

    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.chdir(tmp_path)  # no save_folder: the jsonl logger's run folder is ./runs/<name>
    base = OmegaConf.to_container(tiny_config(tmp_path, tiny_data), resolve=True)
    for section, key in (("algorithms", "te_swap"), ("callbacks", "fp8_stats"),
                         ("callbacks", "fp8_state"), ("callbacks", "fp8_lint")):
        del base[section][key]
    del base["save_folder"]
    loader = base.pop("eval_loader")
    base["eval_loaders"] = [{"label": "a", **loader}, {"label": "b", **copy.deepcopy(loader)}]
    wrong = []
    for key in (None, "train_loader", "eval_loaders.1", *NAME_READS):
        config = copy.deepcopy(base)
        if key is not None:
            _at(config, key)["name"] = how
        text = yaml.safe_dump(config, sort_keys=False)
        path = tmp_path / "train.yaml"
        path.write_text(text)
        found = sorted((f["rule"], f["key"], f["line"]) for f in lint_file(
            path, 1, Snapshot(python="3.11"))["findings"] if f["rule"] == "FP8053")
        with warnings.catch_warnings(), pytest.raises(Exception) as raised:
            warnings.simplefilter("ignore")
            train(OmegaConf.create(config))
        want = [] if key is None else [("FP8053", f"{key}.name", _name_line(text, key))]
        if (raised.type is _FitStarted) != (key is None) or found != want:
            wrong.append((key, raised.type.__name__, str(raised.value)[:80], found, want))
    assert not wrong
