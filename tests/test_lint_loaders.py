"""Loader sections (FP8047, and FP8018 in eval configs): LLM-Foundry's own loader builders
(build_eval_loaders, build_dataloader) and train's validate_config take each section or refuse
it, and the linter says the same."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import LOADER_BUILDER_KEYS

#: A train config's other sections, enough for the linter to read it as one.
TRAIN = {"max_seq_len": 32, "model": {"name": "hf_causal_lm",
                                      "pretrained_model_name_or_path": "x"}}
EVAL = {"max_seq_len": 32, "device_eval_batch_size": 2,
        "models": [{"model_name": "m", "model": {"name": "hf_causal_lm",
                                                   "pretrained_model_name_or_path": "x"},
                    "tokenizer": {"name": "t"}}]}


def _loader(tiny_data: Any, **extra: Any) -> dict[str, Any]:
    return {"name": "text", "dataset": {"local": str(tiny_data.data_dir), "split": "val",
                                        "max_seq_len": 32, "shuffle": False},
            "drop_last": False, "num_workers": 0, "prefetch_factor": None,
            "persistent_workers": False, **extra}


def _lint(tmp_path: Path, config: dict[str, Any]) -> list[tuple[str, str]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [(f["rule"], f["key"]) for f in entry["findings"] if f["rule"] in ("FP8018", "FP8047")]


def _foundry_builds(eval_loader: Any, tiny_data: Any) -> bool:
    """LLM-Foundry's train path for an eval loader: validate_config's label check on a list,
    then build_eval_loaders (build_dataloader into the text builder)."""
    from llmfoundry.utils.builders import build_eval_loaders, build_tokenizer

    if isinstance(eval_loader, list) and any(item.get("label") is None for item in eval_loader):
        return False  # train.py validate_config's ValueError; eval's build_eval_loaders KeyError
    tokenizer = build_tokenizer(str(tiny_data.tokenizer_dir), {})
    try:
        build_eval_loaders(copy.deepcopy(eval_loader), tokenizer, 2)
    except (TypeError, ValueError):
        return False
    return True


def test_loader_builder_keys_are_the_builders_keywords():
    from llmfoundry.data.finetuning.dataloader import build_finetuning_dataloader
    from llmfoundry.data.text_data import build_text_dataloader

    given = {"tokenizer", "device_batch_size"}  # build_dataloader passes these itself
    for builder in (build_text_dataloader, build_finetuning_dataloader):
        assert LOADER_BUILDER_KEYS == set(inspect.signature(builder).parameters) - given | {"name"}


@pytest.mark.parametrize(("shape", "want"), [
    ("single", []),
    ("single+label", ["eval_loader.label"]),  # TypeError: build_text_dataloader takes no label
    ("single+typo", ["eval_loader.num_worker"]),
    ("list", []),
    ("list-no-label", ["eval_loader.1"]),
    ("single+workers", ["eval_loader.prefetch_factor"]),  # torch's ValueError
])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_eval_loader_sections(tmp_path, tiny_data, shape, want, kind):
    single = _loader(tiny_data)
    eval_loader: Any = {
        "single": single,
        "single+label": {**single, "label": "c4"},
        "single+typo": {**single, "num_worker": 0},
        "list": [{**single, "label": "a"}, {**single, "label": "b"}],
        "list-no-label": [{**single, "label": "a"}, single],
        "single+workers": {**single, "prefetch_factor": 2},
    }[shape]
    assert _foundry_builds(eval_loader, tiny_data) == (not want)
    config = {**(TRAIN if kind == "train" else EVAL), "eval_loader": eval_loader}
    assert [key for _, key in _lint(tmp_path, config)] == want
