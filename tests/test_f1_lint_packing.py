"""FP8006 and the finetuning loader's packing (helper F1, s22): a `packing_ratio` other than 1
re-pads every batch to max_seq_len (LLM-Foundry's own build_collate_fn and BinPackCollator),
so pad_to_longest makes no shorter batch there; `auto` may pick 1. And the pad-trimming
multiple read from LLM-Foundry's collator."""

from __future__ import annotations

import math

import pytest

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO, FOUNDRY_PAD_TRIM_MULTIPLE
from tests.mpt_yaml import finetuning_train, line_of

SIZES = (20, 9, 13, 30, 5, 17, 11, 3)  # example lengths (+2 label tokens each)


def _lengths(tiny_data, seq: int, **dataset) -> list[int]:
    """The sequence lengths of the batches LLM-Foundry's own build_collate_fn gives, 2 examples
    a batch of device_batch_size 2 (the first batch is never trimmed)."""
    from llmfoundry.data.finetuning.dataloader import build_collate_fn
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_data.tokenizer_dir))
    cfg = {"dataset": {"max_seq_len": seq, "decoder_only_format": True, **dataset}}
    collate, per_batch = build_collate_fn(cfg, tokenizer, device_batch_size=2)
    examples = [{"turns": [{"input_ids": [5] * n, "labels": [6] * 2}]} for n in SIZES]
    return [collate(examples[i:i + per_batch])["input_ids"].shape[1]
            for i in range(0, len(examples), per_batch)]


def _fp8006(tmp_path, dataset: str, micro: int, seq: int = 2048) -> list[tuple[str, str, int]]:
    text = finetuning_train(dataset, micro, seq)
    path = tmp_path / "train.yaml"
    path.write_text(text)
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [(f["key"], f["severity"], f["line"] == line_of(text, "pad_to_longest:"))
            for f in entry["findings"] if f["rule"] == "FP8006"]


@pytest.mark.parametrize("ratio", ["4.0", "2", "1.5"])
def test_packing_re_pads_every_batch_so_pad_to_longest_is_no_fp8006(tmp_path, tiny_data, ratio):
    """Before: an error (4 x L tokens for any L), though every batch is 4 x max_seq_len."""
    assert set(_lengths(tiny_data, 64, pad_to_longest=True, packing_ratio=float(ratio))) == {64}
    assert _fp8006(tmp_path, f"    pad_to_longest: true\n    packing_ratio: {ratio}\n", 4) == []


def test_packing_ratio_1_keeps_the_shorter_batches_and_the_error(tmp_path, tiny_data):
    assert set(_lengths(tiny_data, 64, pad_to_longest=True, packing_ratio=1)) != {64}
    assert _fp8006(tmp_path, "    pad_to_longest: true\n    packing_ratio: 1\n", 4) == [
        ("train_loader.dataset.pad_to_longest", "error", True)]


def test_packing_ratio_auto_is_1_up_to_100_tokens_and_else_a_warning(tmp_path, tiny_data):
    """auto_packing_ratio picks 1 without profiling up to FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO
    (read here from LLM-Foundry itself); above it the profiled ratio may be 1: a warning."""
    from llmfoundry.data.packing import auto_packing_ratio

    for seq, ratio in ((FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO, 1),
                       (FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO + 1, None)):
        cfg = {"dataset": {"max_seq_len": seq}}
        if ratio is not None:
            assert auto_packing_ratio(cfg, tokenizer=None, device_batch_size=2) == ratio
    auto = "    pad_to_longest: true\n    packing_ratio: auto\n"
    assert _fp8006(tmp_path, auto, 4, seq=FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO) == [
        ("train_loader.dataset.pad_to_longest", "error", True)]
    assert _fp8006(tmp_path, auto, 4) == [("train_loader.dataset.pad_to_longest", "warning", True)]
    assert _fp8006(tmp_path, auto, 16) == []


def test_the_pad_trimming_multiple_is_llm_foundrys(tiny_data):
    """allow_pad_trimming rounds each batch's longest example up to FOUNDRY_PAD_TRIM_MULTIPLE
    (collator.py:410), read back from LLM-Foundry's own collator."""
    lengths = _lengths(tiny_data, 64, allow_pad_trimming=True)
    longest = _lengths(tiny_data, 64, pad_to_longest=True)  # each batch's longest example
    assert lengths[0] == 64 and any(n % 16 for n in longest[1:])  # the first is never trimmed
    assert lengths[1:] == [FOUNDRY_PAD_TRIM_MULTIPLE * math.ceil(n / FOUNDRY_PAD_TRIM_MULTIPLE)
                           for n in longest[1:]]
