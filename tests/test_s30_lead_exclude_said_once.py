"""te_swap's `exclude` that matches none of the layers it decides on (FP8055). In a run with
fp8_lint, the user read it twice at INIT: fp8_lint's finding (with the nearest name and the
fix) and te_swap's own warning ("matches no module name ... (a typo?)"). te_swap now says it as
the rule does, judged on the layers it really decides on (also an exclude that matches only a
module te_swap never converts, such as the embedding, which it missed), and fp8_lint leaves it
to te_swap."""

from __future__ import annotations

import logging
import warnings

import pytest

from foundry_fp8 import SwapConfig, convert_to_fp8
from tests.test_s28_swap_exclude_names import tiny_mpt
from tests.tiny_run import run_tiny


def test_an_exclude_matching_only_a_module_te_swap_never_converts_is_said():
    """`wte` (the embedding) is a module name of the model, so the old check was silent; it is
    none of the layers te_swap decides on, so the exclude keeps nothing out of FP8."""
    with pytest.warns(UserWarning, match=r"algorithms\.te_swap\.exclude: 'wte' matches none of "
                                         r"the 8 layers te_swap decides on \(nearest: "):
        plan = convert_to_fp8(tiny_mpt(), SwapConfig(backend="emulate", exclude="wte"),
                              precision="fp32")
    assert not [d for d in plan.decisions if d.reason == "matched by exclude"]


def test_a_run_with_fp8_lint_says_it_once(tmp_path, tiny_data, caplog):
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_tiny(tmp_path, tiny_data, {
            "max_duration": "1ba", "eval_interval": "1ba", "save_interval": "1ba",
            "algorithms": {"te_swap": {"exclude": "nothing_matches_this"}}})
    said = [str(w.message) for w in caught if "nothing_matches_this" in str(w.message)]
    said += [r.getMessage() for r in caplog.records if "nothing_matches_this" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("algorithms.te_swap.exclude: 'nothing_matches_this' matches none "
                              "of the 8 layers te_swap decides on (nearest: 'model.transformer."), said
