"""Eval configs (scripts/eval/eval.py's shape) and the twins of the train rules about the model
section: each checked against LLM-Foundry's own eval code."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

MPT = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16,
       "vocab_size": 64, "loss_fn": "torch_crossentropy", "attn_config": {"attn_impl": "torch"}}
ENTRY = {"model_name": "m", "model": MPT, "tokenizer": {"name": "gpt2"}, "load_path": "/c.pt"}
BASE = {"max_seq_len": 16, "device_eval_batch_size": 4, "icl_tasks": "tasks.yaml"}


def _findings(tmp_path: Path, config: dict[str, Any]) -> list[tuple[str, str, str]]:
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [(f["rule"], f["key"], f["severity"]) for f in entry["findings"]]


def _with(**model: Any) -> dict[str, Any]:
    return {**ENTRY, "model": {**MPT, **model}}


@pytest.mark.parametrize(("config", "want"), [
    ({**BASE, "precision": "amp_fp8", "models": [ENTRY]}, [("FP8303", "models.0.model", "error")]),
    # TE models: Composer's eval loop turns FP8 autocast off, so they score in float32 (FP8307)
    ({**BASE, "precision": "amp_fp8", "models": [_with(fc_type="te")]},
     [("FP8307", "models.0.model", "warning")]),
    ({**BASE, "precision": "amp_fp8", "models": [_with(ffn_config={"ffn_type": "te_ln_mlp"})]},
     [("FP8307", "models.0.model", "warning")]),
    ({**BASE, "models": [ENTRY]}, []),  # amp_bf16
    ({**BASE, "models": [ENTRY, _with(attn_config={"attn_impl": "sdpa"})]},
     [("FP8304", "models.1.model.attn_config.attn_impl", "error")]),
    ({**BASE, "models": [_with(attn_config={"attn_impl": "sdpa"})],
      "callbacks": {"fp8_lint": {}}}, []),
    ({**BASE, "models": [_with(attn_config={"attn_impl": "sdpa"})], "code_paths": ["imp.py"]},
     [("FP8304", "models.0.model.attn_config.attn_impl", "warning")]),
    ({**BASE, "models": [_with(ffn_config={"ffn_typ": "mptglu"})]},
     [("FP8305", "models.0.model.ffn_config.ffn_typ", "error")]),
    ({**BASE, "models": [_with(fc_type="TE")]}, [("FP8305", "models.0.model.fc_type", "error")]),
    ({**BASE, "models": [_with(attn_config={"attn_impl": "sdpa", "attn_logit_softcapping": 30.0})],
      "callbacks": {"fp8_lint": {}}},
     [("FP8305", "models.0.model.attn_config.attn_logit_softcapping", "error")]),
    ({**BASE, "models": [{**ENTRY, "precision": "amp_fp8"}]},
     [("FP8306", "models.0.precision", "error")]),
    ({**BASE, "models": [{k: v for k, v in ENTRY.items() if k != "model_name"}]},
     [("FP8306", "models.0", "error")]),
    # train.py's shape (allow_toplevel_keys): the model at the top level, keys as written
    ({**BASE, **ENTRY, "precision": "amp_fp8"}, [("FP8303", "model", "error")]),
    ({**BASE, **_with(attn_config={"attn_impl": "sdpa"})},
     [("FP8304", "model.attn_config.attn_impl", "error")]),
    ({**BASE, **ENTRY, "models": [ENTRY]}, [("FP8301", "model", "error")]),
])
def test_eval_model_rules(tmp_path, config, want):
    assert _findings(tmp_path, config) == want


def _evaluate_model_keywords() -> set[str]:
    from llmfoundry.command_utils import eval as foundry_eval

    tree = ast.parse(inspect.getsource(foundry_eval.evaluate))
    call, = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "evaluate_model"]
    return {k.arg for k in call.keywords if k.arg is not None}


@pytest.mark.parametrize(("entry", "refused"), [
    (ENTRY, False),
    ({**ENTRY, "precision": "amp_fp8"}, True),  # multiple values for keyword argument
    ({**ENTRY, "model_nmae": "m"}, True),  # unexpected keyword argument
    ({k: v for k, v in ENTRY.items() if k != "tokenizer"}, True),  # missing argument
])
def test_fp8306_is_evaluate_models_own_type_error(tmp_path, entry, refused):
    """FP8306's reference: evaluate() calls evaluate_model(<its keywords>, **entry), which
    Python binds to evaluate_model's signature before its body runs."""
    from llmfoundry.command_utils import eval as foundry_eval

    signature = inspect.signature(foundry_eval.evaluate_model)
    keywords = {k: None for k in _evaluate_model_keywords()}
    try:
        signature.bind(**keywords, **entry)
        python_refuses = False
    except TypeError:
        python_refuses = True
    if "precision" in entry:  # a keyword given twice fails at the call itself
        with pytest.raises(TypeError, match="multiple values"):
            foundry_eval.evaluate_model(**keywords, **entry)
    found = [r for r, _, _ in _findings(tmp_path, {**BASE, "models": [entry]}) if r == "FP8306"]
    assert python_refuses == refused == bool(found)


def test_evaluate_hands_the_top_level_precision_to_every_model():
    """FP8303's reference: the precision each model's Trainer gets is the config's."""
    from llmfoundry.command_utils import eval as foundry_eval

    tree = ast.parse(inspect.getsource(foundry_eval.evaluate))
    call, = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "evaluate_model"]
    precision, = [k.value for k in call.keywords if k.arg == "precision"]
    assert ast.unparse(precision) == "eval_config.precision"


def test_an_mpt_without_te_layers_builds_no_te_module():
    """FP8303: the entry's MPT without fc_type te builds torch Linear layers only, which
    amp_fp8's fp8_autocast leaves alone."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    config = {k: v for k, v in MPT.items() if k not in ("name", "loss_fn")}
    model = MPTForCausalLM(MPTConfig(**config))
    assert not [n for n, m in model.named_modules()
                if type(m).__module__.startswith("transformer_engine")]
    assert any(type(m).__name__ == "Linear" for m in model.modules())


@pytest.mark.parametrize("edit", [
    {}, {"tokenizer": None}, {"model_name": None}, {"tokenizer": None, "model_name": None},
    {"load_path": None},
])
def test_fp8306_on_train_py_s_shape_is_allow_toplevel_keys_own_error(tmp_path, edit):
    """The reference: LLM-Foundry's allow_toplevel_keys, which eval.py runs on the config first;
    `None` in `edit` drops the key."""
    from llmfoundry.command_utils.eval import allow_toplevel_keys

    config = {**BASE, **ENTRY}
    for key, value in edit.items():
        config.pop(key) if value is None else config.update({key: value})
    try:
        allow_toplevel_keys(yaml.safe_load(yaml.safe_dump(config)))
        refused = False
    except ValueError as error:
        assert "tokenizer" in str(error)
        refused = True
    found = [(r, k) for r, k, _ in _findings(tmp_path, config) if r == "FP8306"]
    assert found == ([("FP8306", "model")] if refused else [])
