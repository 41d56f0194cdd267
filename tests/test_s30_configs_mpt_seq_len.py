"""FP8061: an MPT whose max_seq_len (MPTConfig's default 2048 where the model section gives none)
is below the length a loader or ICL feeds it crashes at the first batch in MPTModel.forward's
assert. The reference is LLM-Foundry's own MPT, run forward on CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from foundry_fp8.lint.cli import lint_file

CORPUS = Path(__file__).parent / "lint_corpus"
#: A clean te_swap run of the corpus (variables.max_seq_len 2048 everywhere).
BASE = yaml.safe_load((CORPUS / "train" / "mpt-125m-te-swap.yaml").read_text())


def test_llm_foundry_s_mpt_refuses_a_sequence_past_its_max_seq_len():
    import torch
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    model = ComposerMPTCausalLM(d_model=64, n_heads=4, n_layers=1, expansion_ratio=4,
                                max_seq_len=8, vocab_size=64, init_device="cpu",
                                attn_config={"attn_impl": "torch"},
                                loss_fn="torch_crossentropy")
    model.model(input_ids=torch.zeros(1, 8, dtype=torch.long))  # at its length: runs
    with pytest.raises(AssertionError, match="Cannot forward input with seq_len=16, this model "
                       "only supports seq_len<=8"):
        model.model(input_ids=torch.zeros(1, 16, dtype=torch.long))


def _found(tmp_path: Path, config: dict) -> list[tuple[str, str]]:
    path = tmp_path / "mpt.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None
    return [(f["key"], f["message"].split(" is ")[0]) for f in entry["findings"]
            if f["rule"] == "FP8061"]


def test_a_model_shorter_than_the_train_loader(tmp_path):
    assert _found(tmp_path, BASE) == []
    config = copy.deepcopy(BASE)
    config["model"]["max_seq_len"] = 1024
    assert _found(tmp_path, config) == [("model.max_seq_len", "train_loader.dataset.max_seq_len")]


def test_a_model_section_without_max_seq_len_gets_mpt_s_default(tmp_path):
    config = copy.deepcopy(BASE)
    del config["model"]["max_seq_len"]
    assert _found(tmp_path, config) == []  # 2048, the default
    config["variables"]["max_seq_len"] = 4096
    assert _found(tmp_path, config) == [("model", "train_loader.dataset.max_seq_len")]


def test_an_eval_loader_and_icl_tasks(tmp_path):
    config = copy.deepcopy(BASE)
    config["eval_loader"] = copy.deepcopy(config["train_loader"])
    config["eval_loader"]["dataset"]["max_seq_len"] = 4096
    assert _found(tmp_path, config) == [("model.max_seq_len", "eval_loader.dataset.max_seq_len")]
    config = copy.deepcopy(BASE)
    config["model"]["max_seq_len"] = 1024
    config["train_loader"]["dataset"]["max_seq_len"] = 1024
    config["icl_tasks"] = [{"label": "piqa", "dataset_uri": "eval/local_data/piqa.jsonl",
                            "num_fewshot": [0], "icl_task_type": "multiple_choice"}]
    assert _found(tmp_path, config) == [("model.max_seq_len", "max_seq_len")]  # ICL pads to 2048
    config["icl_seq_len"] = 1024  # train.py: icl_seq_len, else max_seq_len
    assert _found(tmp_path, config) == []
    del config["icl_seq_len"]
    config["icl_tasks"][0]["max_seq_len"] = 1024  # build_icl_evaluators: the task's own first
    assert _found(tmp_path, config) == []
