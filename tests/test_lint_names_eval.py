"""Eval configs' built-by-name sections and eval loaders (FP8309, FP8310, FP8047's label in
eval): LLM-Foundry's own evaluate() on each config, a tiny GPT-2 from a local config and the
tiny text data, against what the linter says. Every config evaluate() takes lints without an
error; each one it refuses is flagged at the key the table names, by the rule it names."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

pytest.importorskip("llmfoundry")

Edit = Callable[[dict[str, Any]], Any]


def _items(*labels: Any, drop: tuple[str, ...] = (), **item: Any) -> Edit:
    """eval_loaders in place of eval_loader, one item per label (`...`: no label); the last
    item takes `item` and loses the keys in `drop`."""
    def edit(config: dict[str, Any]) -> None:
        loader = config.pop("eval_loader")
        items = [{**copy.deepcopy(loader), **({} if label is ... else {"label": label})}
                 for label in labels]
        items[-1].update(item)
        for key in drop:
            del items[-1][key]
        config["eval_loaders"] = items
    return edit


def _second_model(config: dict[str, Any]) -> None:
    config["models"].append({**copy.deepcopy(config["models"][0]), "model_name": "m2"})


def _top_level(config: dict[str, Any]) -> None:
    """train.py's shape, which allow_toplevel_keys turns into `models: [...]`."""
    config.update(config.pop("models")[0])


#: (label, edit, the findings of FP8047/FP8309/FP8310 as (rule, key); [] where evaluate()
#: takes the config).
CASES: list[tuple[str, Edit, list[tuple[str, str]]]] = [
    ("as is", lambda c: None, []),
    ("loader without name", lambda c: c["eval_loader"].pop("name"),
     [("FP8309", "eval_loader")]),
    ("loader name null", lambda c: c["eval_loader"].update(name=None),
     [("FP8309", "eval_loader.name")]),
    ("loader name empty", lambda c: c["eval_loader"].update(name=""),
     [("FP8309", "eval_loader.name")]),
    ("model without name", lambda c: c["models"][0]["model"].pop("name"),
     [("FP8309", "models.0.model")]),
    ("model name null", lambda c: c["models"][0]["model"].update(name=None),
     [("FP8309", "models.0.model.name")]),
    ("tokenizer without name", lambda c: c["models"][0]["tokenizer"].pop("name"),
     [("FP8309", "models.0.tokenizer")]),
    ("tokenizer name null", lambda c: c["models"][0]["tokenizer"].update(name=None),
     [("FP8309", "models.0.tokenizer.name")]),
    ("tokenizer empty", lambda c: c["models"][0].update(tokenizer={}),
     [("FP8309", "models.0.tokenizer")]),
    ("top-level model without name",
     lambda c: (_top_level(c), c["model"].pop("name")), [("FP8309", "model")]),
    ("top-level tokenizer name empty",
     lambda c: (_top_level(c), c["tokenizer"].update(name="")), [("FP8309", "tokenizer.name")]),
    ("list", _items("a", "b"), []),
    ("list, a null label", _items(None, "b"), []),  # eval logs it as eval/None
    ("list, no label", _items("a", ...), [("FP8047", "eval_loaders.1")]),
    ("list item without name", _items("a", "b", drop=("name",)),
     [("FP8309", "eval_loaders.1")]),
    ("list item name null", _items("a", "b", name=None), [("FP8309", "eval_loaders.1.name")]),
    ("eval_loader as a list, no label",
     lambda c: c.update(eval_loader=[{**c["eval_loader"], "label": "a"}, c["eval_loader"]]),
     [("FP8047", "eval_loader.1")]),
    ("two models", _second_model, [("FP8310", "eval_loader")]),
    ("two models, a list", lambda c: (_items("a", "b")(c), _second_model(c)),
     [("FP8310", "eval_loaders")]),
    ("two models, no loader", lambda c: (c.pop("eval_loader"), _second_model(c)), []),
]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    from transformers import GPT2Config

    path = tmp_path_factory.mktemp("gpt2")
    GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(path)
    return path


def _base(tiny_data: Any, gpt2: Path) -> dict[str, Any]:
    loader = {"name": "text", "dataset": {"local": str(tiny_data.data_dir), "split": "val",
                                          "max_seq_len": 32, "shuffle": False},
              "drop_last": False, "num_workers": 0, "prefetch_factor": None,
              "persistent_workers": False}
    return {"max_seq_len": 32, "device_eval_batch_size": 2, "precision": "fp32",
            "eval_subset_num_batches": 1, "icl_tasks": [],
            "models": [{"model_name": "m", "tokenizer": {"name": str(tiny_data.tokenizer_dir)},
                        "model": {"name": "hf_causal_lm", "pretrained": False,
                                  "pretrained_model_name_or_path": str(gpt2)}}],
            "eval_loader": loader}


def _evaluate(path: Path) -> Exception | None:
    """What LLM-Foundry's eval_from_yaml raises on the file; None: it evaluated every model."""
    from llmfoundry.command_utils.eval import eval_from_yaml
    from omegaconf import OmegaConf
    from omegaconf.resolvers import oc

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainers, _ = eval_from_yaml(str(path), None)
    except Exception as e:  # the test compares refusal with the linter's findings
        return e
    finally:  # eval_from_yaml clears it for the whole process: later tests resolve with it
        if not OmegaConf.has_resolver("oc.env"):
            OmegaConf.register_new_resolver("oc.env", oc.env)
    for trainer in trainers:
        trainer.close()
    return None


def _kind(error: Exception | None) -> str:
    """A refusal as `_said` names it: KeyError's key, or the error's type."""
    if isinstance(error, KeyError):
        return f"KeyError {error.args[0]}"
    return type(error).__name__


def _said(rule: str, key: str) -> set[str] | str:
    """The refusal a finding's message names for it."""
    if rule == "FP8309" and key.endswith(".name"):  # looked up: no registry, no such tokenizer
        return {"RegistryError", "OSError", "HFValidationError"}
    return {"FP8047": "KeyError label", "FP8309": "KeyError name",
            "FP8310": "KeyError " + ("label" if key == "eval_loaders" else "name")}[rule]


@pytest.mark.parametrize(("label", "edit", "want"), CASES, ids=[c[0] for c in CASES])
def test_eval_refuses_what_the_linter_flags(tmp_path, tiny_data, gpt2, label, edit, want):
    config = _base(tiny_data, gpt2)
    edit(config)
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    found = [(f["rule"], f["key"]) for f in entry["findings"]
             if f["rule"] in ("FP8047", "FP8309", "FP8310")]
    errors = [f for f in entry["findings"] if f["severity"] == "error"]
    refusal = _evaluate(path)
    assert found == want
    if want:
        said = _said(*want[0])
        assert _kind(refusal) in (said if isinstance(said, set) else {said}), refusal
    else:
        assert refusal is None, refusal
        assert errors == []
