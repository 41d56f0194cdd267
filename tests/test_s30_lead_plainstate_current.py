"""State saved by `fp8_state_dict(model)` without a recipe, loaded under current scaling: it
blamed a history length current scaling does not use ("4 rows do not fit the recipe's 16"), or
with strict=False wrote the delayed histories in. It now says what does not fit and restores
nothing, as fp8_state does under current scaling."""

from __future__ import annotations

import logging

import pytest
import torch

from foundry_fp8 import FP8Recipe, fp8_state_dict, load_fp8_state_dict
from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta
from tests.test_s30_plainstate_load import BATCHES, _build, _train

CURRENT = FP8Recipe(scaling="current")


def test_a_delayed_state_without_its_recipe_is_not_written_under_current_scaling(caplog):
    model, optimizer = _build()
    _train(model, optimizer, BATCHES[:3])
    state = fp8_state_dict(model)  # no recipe recorded
    fresh, _ = _build()
    before = {name: read_fp8_meta(m) for name, m in fp8_modules(fresh)}
    with pytest.raises(ValueError, match=r"records no recipe and holds delayed-scaling amax "
                                         r"histories; this recipe \(.*current.*\) keeps none"):
        load_fp8_state_dict(fresh, state, recipe=CURRENT)
    with caplog.at_level(logging.WARNING):
        load_fp8_state_dict(fresh, state, recipe=CURRENT, strict=False)
    assert "nothing restored" in caplog.text
    after = {name: read_fp8_meta(m) for name, m in fp8_modules(fresh)}
    assert after.keys() == before.keys()
    for name, tensors in after.items():
        for key, value in tensors.items():
            assert torch.equal(value, before[name][key]), (name, key)
