"""FP8313, FP8061 for eval configs: `evaluate_model` hands the top-level max_seq_len to ICL
(icl_seq_len=max_seq_len) and never to the model, so an eval `models:` entry's MPT without its
own max_seq_len is MPTConfig's 2048 long, and a longer ICL length or eval loader stops the eval
at that model's first evaluation (MPTModel.forward's assert), after its checkpoint is loaded.
Before, nothing judged eval configs so (and FP8061 left out a task's own max_seq_len in train
configs). The reference is LLM-Foundry's own: its EvalConfig loader takes the file, its ICL
builder pads a task to the length the linter reads, and its MPT refuses a batch that long."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.lint.cli import lint_file
from tests.foundry_train import eval_refusal

_MPT = {"name": "mpt_causal_lm", "init_device": "cpu", "d_model": 64, "n_heads": 4,
        "n_layers": 1, "expansion_ratio": 4, "vocab_size": 512,
        "attn_config": {"attn_impl": "torch"}, "loss_fn": "torch_crossentropy"}


def _eval_config(tiny_data, tasks: Path, max_seq_len: int, **extra: Any) -> dict:
    """An eval config in the layout of LLM-Foundry's scripts/eval/yamls/mpt_eval.yaml."""
    return {"seed": 1, "precision": "fp32", "max_seq_len": max_seq_len,
            "device_eval_batch_size": 2,
            "models": [{"model_name": "mpt_tiny",
                        "tokenizer": {"name": str(tiny_data.root / "tokenizer-v512")},
                        "model": dict(_MPT), "load_path": "./ckpt/latest-rank0.pt"}],
            "icl_tasks": [{"label": "lm", "dataset_uri": str(tasks), "num_fewshot": [0],
                           "icl_task_type": "language_modeling"}], **extra}


def _tasks(tmp_path: Path) -> Path:
    path = tmp_path / "lm.jsonl"
    path.write_text("".join(json.dumps({"context": f"the number {i} is",
                                        "continuation": f" {i}"}) + "\n" for i in range(4)))
    return path


def _found(tmp_path: Path, config: dict, rule: str = "FP8313") -> list[tuple[str, str]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    if rule == "FP8313":
        assert eval_refusal(path) is None  # LLM-Foundry's loader takes the file
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [(f["key"], f["message"].split(" is ")[0]) for f in entry["findings"]
            if f["rule"] == rule]


def test_llm_foundry_pads_icl_to_the_eval_length_and_the_mpt_refuses_it(tmp_path, tiny_data,
                                                                        monkeypatch):
    from llmfoundry.models.mpt import ComposerMPTCausalLM
    from llmfoundry.utils.builders import build_icl_evaluators, build_tokenizer

    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer(str(tiny_data.root / "tokenizer-v512"), {})
    config = _eval_config(tiny_data, _tasks(tmp_path), 2304)
    evaluators, _ = build_icl_evaluators(config["icl_tasks"], tokenizer, config["max_seq_len"],
                                         2, destination_dir=str(tmp_path))
    batch = next(iter(evaluators[0].dataloader.dataloader))
    assert batch["input_ids"].shape[1] == 2304  # evaluate_model's icl_seq_len=max_seq_len
    model = ComposerMPTCausalLM(**{k: v for k, v in _MPT.items() if k != "name"})
    assert model.config.max_seq_len == 2048  # the model section gives none
    with pytest.raises(AssertionError, match="seq_len=2304, this model only supports "
                       "seq_len<=2048"):
        model.model(input_ids=batch["input_ids"])


def test_an_eval_mpt_shorter_than_icl(tmp_path, tiny_data):
    tasks = _tasks(tmp_path)
    assert _found(tmp_path, _eval_config(tiny_data, tasks, 2048)) == []
    config = _eval_config(tiny_data, tasks, 2304)
    assert _found(tmp_path, config) == [("models.0.model", "max_seq_len")]
    config["models"][0]["model"]["max_seq_len"] = 2304  # the fix
    assert _found(tmp_path, config) == []
    # a second model, shorter: named at its own entry
    second = copy.deepcopy(config["models"][0])
    second["model"]["max_seq_len"] = 1024
    second["model_name"] = "mpt_short"
    config["models"].append(second)
    assert _found(tmp_path, config) == [("models.1.model.max_seq_len", "max_seq_len")]


def test_a_task_s_own_length_and_an_eval_loader(tmp_path, tiny_data):
    config = _eval_config(tiny_data, _tasks(tmp_path), 1024)
    config["icl_tasks"][0]["max_seq_len"] = 4096  # build_icl_evaluators: the task's own first
    assert _found(tmp_path, config) == [("models.0.model", "icl_tasks.0.max_seq_len")]
    config = _eval_config(tiny_data, _tasks(tmp_path), 1024, eval_loader={
        "name": "text", "dataset": {"local": str(tiny_data.root / "text-2048"), "split": "val",
                                    "max_seq_len": 3072}})
    assert _found(tmp_path, config) == [("models.0.model", "eval_loader.dataset.max_seq_len")]


def test_train_py_shape(tmp_path, tiny_data):
    """The train.py shape allow_toplevel_keys moves into `models:`."""
    config = _eval_config(tiny_data, _tasks(tmp_path), 4096)
    entry = config.pop("models")[0]
    config.update(entry)
    assert _found(tmp_path, config) == [("model", "max_seq_len")]


def test_a_train_config_s_task_with_its_own_length(tmp_path):
    """FP8061 on a train config: build_icl_evaluators pads a task to its own max_seq_len."""
    config = yaml.safe_load((Path(__file__).parent / "lint_corpus" / "train" /
                             "mpt-125m-te-swap.yaml").read_text())
    config["icl_tasks"] = [{"label": "piqa", "dataset_uri": "eval/local_data/piqa.jsonl",
                            "num_fewshot": [0], "icl_task_type": "multiple_choice",
                            "max_seq_len": 4096}]
    assert _found(tmp_path, config, "FP8061") == [("model.max_seq_len", "icl_tasks.0.max_seq_len")]
    config["icl_tasks"][0]["max_seq_len"] = 2048
    assert _found(tmp_path, config, "FP8061") == []
