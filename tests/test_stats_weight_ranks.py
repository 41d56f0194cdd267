"""A weight's NaN/Inf counts under 2 CPU ranks (gloo): a weight the same on every rank (DDP's
replicas, FSDP's all-gathered weight) counts once, as on one rank and as TE's debug API (which
does not reduce weight statistics across ranks) counts it; different weights under one name
(expert parallelism) and the ranks' own inputs add up. Reference: the NaN/Inf elements the test
put in, counted with plain torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from tests.ranks import init_rank, run_ranks


def _model(rank: int, replicated: bool) -> nn.Module:
    torch.manual_seed(0 if replicated else rank)
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = float("nan")
        weight[1, : 1 + (0 if replicated else rank)] = float("inf")  # experts: 1 and 2 Infs
    return model


def _inputs(rank: int) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    x[0, rank] = float("nan")  # one NaN in each rank's input
    return x


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    result = {}
    for name, replicated in (("replicated", True), ("experts", False)):
        model = _model(rank, replicated)
        monitor = FP8Monitor(model, MonitorConfig(tensors=["activation", "weight"]),
                             on_warning=lambda _: None)
        monitor.start_step()
        model(_inputs(rank))
        result[name] = monitor.finish_step()
        result[f"{name}/weight"] = model[0].weight.detach().clone()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("weight_ranks")
    run_ranks(_worker, str(out))
    paths = [out / f"rank{r}.pt" for r in range(2)]
    assert all(p.exists() for p in paths), "a rank hung or died"
    return [torch.load(p, weights_only=False) for p in paths]


def _counts(metrics: dict, tensor: str) -> tuple[float, float]:
    return (metrics[layer_key("nan_count", tensor, "0")],
            metrics[layer_key("inf_count", tensor, "0")])


def test_a_weight_the_same_on_every_rank_counts_once(results):
    weight = results[0]["replicated/weight"]
    own = (float(weight.isnan().sum()), float(weight.isinf().sum()))
    assert own == (1.0, 1.0)
    for rank in results:
        assert _counts(rank["replicated"], "weight") == own  # not 2x: was (2.0, 2.0)
        assert _counts(rank["replicated"], "activation") == (2.0, 0.0)  # each rank's input


def test_different_weights_under_one_name_add_up(results):
    total = [sum(float(getattr(r["experts/weight"], f)().sum()) for r in results)
             for f in ("isnan", "isinf")]
    assert total == [2.0, 3.0]
    for rank in results:
        assert list(_counts(rank["experts"], "weight")) == total
