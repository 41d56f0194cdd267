"""fp8_guard's FLOPs shares in a real Composer run, read back from the `jsonl` logger's files: a
model whose layers are partly te_swap's (emulated FP8) and partly a TE module it was built with,
with a tied LM head. The TE module computes in FP8 only under `amp_fp8` (which Composer refuses on
CPU), so here it runs in high precision: the guard does not judge it, and
`fp8/guard/fp8_flops_share`, the fallback records and the `max_fallback_share` budget count the
emulated layers of te_swap's own total (`swap.linear_flops`, the tied head included), agreeing
with te_swap's `fp8/linear_flops_share` (the guard counted the TE module as FP8: 3/7 against
te_swap's 2/7)."""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.shapes import FP8_DIM_MULTIPLE

D, VOCAB, BATCHES, INTERVAL, FAULTY = 16, 64, 12, 2, "module.blocks.0"
# tokens per batch (one GEMM's rows): what real TE's FP8 backward on Hopper needs of the
# weight-gradient GEMM's inner dim (the emulation warns of fewer: emulate._warn_unless_te_runs)
TOKENS = FP8_DIM_MULTIPLE
# multiply-adds per token: te_swap's two blocks and the TE module D x D each, the tied head
# D x VOCAB (high precision); the FP8 layers run 3 of the 7 parts
BLOCK, TOTAL = D * D, 3 * D * D + D * VOCAB


class Linear(nn.Module):
    """A TE `Linear` the model was built with (`fc_type: te`), as TE's contracts make it one
    for us (`te.probe`: the class name in a `transformer_engine` module, `fp8_meta` and
    `init_fp8_metadata`); te_swap's plan has no entry for it. Without TE's autocast it computes
    in high precision, so fp8_stats gives it what-if numbers (healthy here)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)
        self.fp8_meta: dict[str, Any] = {}

    def init_fp8_metadata(self) -> None:
        """TE's hook, never called here (TE's own autocast would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


Linear.__module__ = "transformer_engine.pytorch.module.linear"


class TiedLM(nn.Module):
    """Embedding, the TE module, two parallel linear blocks (te_swap converts them) and logits
    from the input embedding (MPT's `tie_word_embeddings`: a GEMM with no module of its own).
    `blocks.0` holds one huge weight, so its FP8 weight underflows at every judged step; its
    input is detached, so no other layer's gradient sees that weight."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=True)
        self.wte = nn.Embedding(VOCAB, D)
        self.native = Linear(D, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        with torch.no_grad():
            self.blocks[0].weight[0, 0] = 1e6

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.native(self.wte(tokens)))
        h = self.blocks[0](h.detach()) + self.blocks[1](h)
        return F.linear(h, self.wte.weight)


def _fit(folder: Path, max_fallback_share: float, caplog, refit: dict[str, Any] | None = None,
         loggers: Sequence[Any] = (), **stats: Any) -> tuple[FP8Guard, dict, dict]:
    """Train on one batch repeated (learning rate 0: each tensor's amax is the same at every
    step, so delayed scaling's history never falls behind it and every statistic but the faulty
    weight's stays healthy), with fp8_stats' options `stats` over its defaults here, then
    `trainer.fit(**refit)` if given, `loggers` beside the JSONL; returns the guard, fp8_guard's series by step
    (metrics.jsonl, the last record of a step) and hparams.json."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(BATCHES), labels.repeat(BATCHES))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    guard = FP8Guard(consecutive=2, max_fallback_share=max_fallback_share)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(
            model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
            run_name="run", train_dataloader=DataLoader(data, batch_size=TOKENS),
            max_duration=f"{BATCHES}ba", algorithms=[TESwap(backend="emulate")],
            callbacks=[FP8Stats(**{"interval": INTERVAL, "image_interval": None, **stats}),
                       guard],
            loggers=[JSONLLogger(path=str(folder / "metrics.jsonl")), *loggers], device="cpu",
            progress_bar=False)
        trainer.fit()
        if refit is not None:
            trainer.fit(**refit)
        trainer.close()
    series = {step: {k: m[k] for k in (FALLBACK_LAYERS, FP8_FLOPS_SHARE)}
              for step, m in read_jsonl(folder / "metrics.jsonl") if FP8_FLOPS_SHARE in m}
    return guard, series, json.loads((folder / "hparams.json").read_text())


def test_the_guards_share_is_te_swaps_and_leaves_the_te_module_out(tmp_path, caplog):
    """Within the budget: the faulty block falls back, 1 of the 2 FP8 blocks (half the FP8
    FLOPs, within 0.5), at the second judged step (step 0 casts with the initial scale); its
    record and the series count it of the same total as te_swap, and the TE module running in
    high precision is neither judged nor counted."""
    guard, series, hparams = _fit(tmp_path, 0.5, caplog)
    assert hparams["fp8/linear_flops_share"] == pytest.approx(2 * BLOCK / TOTAL)  # te_swap's
    assert "module.native" not in guard.core.flops
    assert sorted(guard.core.fallbacks) == [FAULTY]
    fallback = guard.core.fallbacks[FAULTY]
    assert fallback.step == 2 * INTERVAL
    assert hparams[f"fp8/guard/fallback/{FAULTY}"]["flops_share"] == pytest.approx(BLOCK / TOTAL)
    assert sorted(series) == list(range(0, BATCHES, INTERVAL))
    for step, logged in series.items():
        fallen = step >= fallback.step
        assert logged[FALLBACK_LAYERS] == float(fallen)
        assert logged[FP8_FLOPS_SHARE] == pytest.approx((2 - fallen) * BLOCK / TOTAL)


def test_the_budget_counts_the_fp8_layers_only(tmp_path, caplog):
    """Over the budget: the same fallback would put half the FP8 FLOPs in high precision, over
    0.4, so the block stays in FP8 with the budget's warning (counting the TE module as FP8
    made it a third, within the budget)."""
    guard, series, _ = _fit(tmp_path, 0.4, caplog)
    assert not guard.core.fallbacks
    assert all(logged == {FALLBACK_LAYERS: 0.0, FP8_FLOPS_SHARE: pytest.approx(2 * BLOCK / TOTAL)}
               for logged in series.values())
    [budget] = [r.getMessage() for r in caplog.records
                if "would also fall back" in r.getMessage()]
    assert f"{FAULTY} would also fall back, putting 50.0 % of the FP8 FLOPs" in budget
