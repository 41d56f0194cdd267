"""A TE Linear the model was built with (no te_swap plan) counts its GEMM FLOPs the same after
FSDP1 wraps it as before: with use_orig_params (Composer's default) FSDP1 leaves each weight a
1-D view of the rank's shard, or 0 elements on a rank holding none of it
(torch/distributed/fsdp/_flat_param.py `_use_sharded_views`), where fp8_guard sizes its
layers (fit_start, after the wrap)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from foundry_fp8.composer.guard import layer_flops
from foundry_fp8.swap import linear_flops, module_flops
from tests.ranks import init_rank, run_ranks


class Linear(nn.Module):
    """TE's Linear as far as FLOPs go: `in_features`/`out_features` and a weight
    [out, in] (TE pytorch/module/linear.py)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


Linear.__module__ = "transformer_engine.pytorch.module"


def _model() -> nn.Sequential:
    return nn.Sequential(Linear(8, 16), nn.Linear(16, 16), Linear(16, 4))


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init_rank(rank, rendezvous)
    torch.manual_seed(0)
    model = _model()
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    te = {"0": model[0], "2": model[2]}
    result = {"shapes": [list(model[i].weight.shape) for i in (0, 2)],
              "flops": [module_flops(model[i]) for i in (0, 2)],
              "total": linear_flops(wrapped),
              "shares": layer_flops(wrapped, te, None)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_fsdp1_sharded_te_linears_count_their_unsharded_flops(tmp_path):
    run_ranks(_worker, str(tmp_path), deadline_s=120)
    found = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in found), "a rank did not finish"
    # by hand: 2 FLOPs per multiply-add, in x out of each GEMM
    flops = [2 * 8 * 16, 2 * 16 * 4]
    total = flops[0] + 2 * 16 * 16 + flops[1]
    for path in found:
        result = json.loads(path.read_text())
        # the wrap did shard: no weight kept its 2-D shape on this rank
        assert all(len(shape) == 1 for shape in result["shapes"])
        assert result["flops"] == flops
        assert result["total"] == total
        assert result["shares"] == {"0": flops[0] / total, "2": flops[1] / total}
    # the same counts unwrapped
    model = _model()
    assert [module_flops(model[i]) for i in (0, 2)] == flops
    assert linear_flops(model) == total
