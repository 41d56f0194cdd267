"""Huge integers in a config (a structure-aware fuzzer's finding, session 23). omegaconf reads a
decimal of up to 4300 digits and a hexadecimal of any length, but the rules' arithmetic on such a
value (tokens per micro-batch, d_model x expansion_ratio) made ints Python will not write as text:
each such rule failed as "FP80xx's check failed on this config ... a foundry-fp8 bug". A value
past MAX_INT_DIGITS is now one line at its line and column (the linter's bound, said so); one
within it lints without a rule failing; a decimal past Python's 4300 digits is still refused as
omegaconf refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.load import MAX_INT_DIGITS

BASE = ("variables:\n  seq: {seq}\nmax_seq_len: ${{variables.seq}}\nprecision: amp_fp8\n"
        "device_train_microbatch_size: {micro}\nglobal_train_batch_size: 8\nmax_duration: 1ba\n"
        "model:\n  name: mpt_causal_lm\n  d_model: {d_model}\n  n_heads: 8\n"
        "  expansion_ratio: {ratio}\n  loss_fn: torch_crossentropy\n"
        "algorithms:\n  te_swap: {{}}\n")


def _entry(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> dict:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return lint_file(path, overrides=overrides)


def _failed_rules(entry: dict) -> list[str]:
    return [f["message"] for f in entry["findings"] if "check failed" in f["message"]]


def test_an_int_past_the_bound_is_one_line_at_its_place(tmp_path: Path) -> None:
    big = "9" * 4300  # omegaconf (LLM-Foundry's reader) takes it
    text = BASE.format(seq=128, micro=big, d_model=256, ratio=4)
    assert OmegaConf.create(text).device_train_microbatch_size == int(big)
    entry = _entry(tmp_path, text)
    assert entry["error"] == (f"{tmp_path / 'train.yaml'}:5:31: an integer of more than "
                              f"{MAX_INT_DIGITS} digits, which no config needs; refusing to load "
                              "it (the linter's bound; YAML's and JSON's readers take it)")
    hexadecimal = "0x" + "f" * 5000  # any length: read in base 16, which Python does not limit
    assert OmegaConf.create(f"a: {hexadecimal}\n").a > 0
    entry = _entry(tmp_path, BASE.format(seq=128, micro=8, d_model=hexadecimal, ratio=4))
    assert f":10:12: an integer of more than {MAX_INT_DIGITS} digits" in entry["error"]
    # past Python's own limit: omegaconf's load refuses it too
    with pytest.raises(ValueError, match="4300"):
        OmegaConf.create("a: " + "9" * 4301 + "\n")
    entry = _entry(tmp_path, BASE.format(seq="-" + "9_" * 4301, micro=8, d_model=256, ratio=4))
    assert entry["error"].endswith(":2:8: an integer of 4301 digits; Python reads at most 4300 "
                                   "(quote it if it is a string)")


def test_an_override_past_the_bound_is_one_line(tmp_path: Path) -> None:
    item = "model.d_model=" + "9" * 4300
    entry = _entry(tmp_path, BASE.format(seq=128, micro=8, d_model=256, ratio=4), (item,))
    assert entry["error"] == (f"{tmp_path / 'train.yaml'}: --override {item}: an integer of more "
                              f"than {MAX_INT_DIGITS} digits, which no config needs (the linter's "
                              "bound)")


def test_ints_within_the_bound_fail_no_rule(tmp_path: Path) -> None:
    within = "9" * MAX_INT_DIGITS
    for values in ({"seq": within, "micro": within, "d_model": within, "ratio": within},
                   {"seq": within, "micro": 8, "d_model": 256, "ratio": 4}):
        entry = _entry(tmp_path, BASE.format(**values))
        assert entry["error"] is None and entry["findings"]
        assert _failed_rules(entry) == []
    entry = _entry(tmp_path, BASE.format(seq=128, micro=8, d_model=256, ratio=4),
                   ("model.d_model=" + within, "model.n_heads=" + within))
    assert entry["error"] is None and _failed_rules(entry) == []
