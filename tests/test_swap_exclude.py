"""te_swap's `exclude` that matches no module name (a typo: `lm_haed`, `down_projj`) kept
nothing in high precision without a word: the user meant those layers out of FP8 and they
trained in it. Now one warning names the option and the pattern."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from foundry_fp8 import SwapConfig, convert_to_fp8


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))


def test_an_exclude_matching_no_module_warns_naming_it():
    model = _llama()
    unfiltered = convert_to_fp8(copy.deepcopy(model), SwapConfig(backend="emulate"))
    with pytest.warns(UserWarning, match=r"algorithms\.te_swap\.exclude: 'down_projj' matches "
                                         r"none of the 15 layers te_swap decides on \(nearest: "
                                         r"'model\.layers\.\d\.mlp\.down_proj'\)"):
        plan = convert_to_fp8(model, SwapConfig(backend="emulate", exclude="down_projj"))
    assert [d.name for d in plan.converted] == [d.name for d in unfiltered.converted]


def test_an_exclude_that_matches_is_silent_and_keeps_its_layers():
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = convert_to_fp8(model, SwapConfig(backend="emulate", exclude=r"down_proj$"))
    kept = {d.name for d in plan.decisions if d.reason == "matched by exclude"}
    assert kept == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in kept)
