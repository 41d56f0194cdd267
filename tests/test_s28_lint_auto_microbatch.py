"""FP8006 with `device_train_microbatch_size: auto`: Composer starts at the per-rank batch size
and halves it at each CUDA out-of-memory, down to 1, so a micro-batch of 1 may run; before, auto
was not judged at all (a finetuning `pad_to_longest` run crashed in TE's FP8 assert after its
first OOM). Composer's own halving is the reference."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

MODEL = {
    "name": "mpt_causal_lm",
    "d_model": 2048,
    "n_heads": 16,
    "n_layers": 24,
    "fc_type": "te",
    "loss_fn": "torch_crossentropy",
}


def _fp8006(micro: Any, dataset: dict[str, Any], loader: str = "text") -> list[tuple]:
    config = {
        "precision": "amp_fp8",
        "max_seq_len": 2048,
        "device_train_microbatch_size": micro,
        "model": MODEL,
        "train_loader": {"name": loader, "dataset": dataset, "drop_last": True},
    }
    return [
        (f.key, f.severity, f.message.startswith("device_train_microbatch_size auto"))
        for f in lint_config(config, LintContext())
        if f.rule == "FP8006"
    ]


FINETUNE = {
    "hf_name": "mosaicml/dolly_hhrlhf",
    "split": "train",
    "max_seq_len": 2048,
    "pad_to_longest": True,
}


@pytest.mark.parametrize(
    ("micro", "dataset", "loader", "expected"),
    [
        ("auto", {"max_seq_len": 2048}, "text", []),
        (
            "auto",
            {"max_seq_len": 2044},
            "text",
            [("train_loader.dataset.max_seq_len", "warning", True)],
        ),
        (8, {"max_seq_len": 2044}, "text", []),  # 8 x 2044 = 16352, a multiple of 16
        (
            "auto",
            FINETUNE,
            "finetuning",
            [("train_loader.dataset.pad_to_longest", "warning", True)],
        ),
        (16, FINETUNE, "finetuning", []),
    ],
)
def test_auto_is_judged_at_one(micro, dataset, loader, expected):
    assert _fp8006(micro, dataset, loader) == expected


def test_the_reference_composer_halves_down_to_one(monkeypatch):
    from composer.trainer import trainer

    monkeypatch.setattr(trainer, "_clear_incomplete_train_states", lambda state: None)
    state, sizes = SimpleNamespace(device_train_microbatch_size=6), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while state.device_train_microbatch_size > 1:
            trainer._adjust_device_train_microbatch_size(state)
            sizes.append(state.device_train_microbatch_size)
    assert sizes == [3, 1]
    assert (
        trainer._get_initial_device_train_microbatch_size(
            "auto", True, SimpleNamespace(batch_size=6)
        )
        == 6
    )
