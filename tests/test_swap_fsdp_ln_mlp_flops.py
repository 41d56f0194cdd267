"""A te.LayerNormMLP counts its two GEMMs' FLOPs the same after FSDP1 shards it as before.
It has no `in_features`/`out_features` (TE keeps only `size_per_partition`,
pytorch/module/layernorm_mlp.py:2028 at v2.18), so its FLOPs come from `fc1_weight` and
`fc2_weight`, which FSDP1 leaves a 1-D view of the rank's shard with use_orig_params
(Composer's default; torch/distributed/fsdp/_flat_param.py `_use_sharded_views`): it counted 0, where fp8_guard sizes its layers (fit_start, after the
wrap) and no te_swap plan (a model built with LLM-Foundry's `ffn_type: te_ln_mlp`) holds them.
Two gloo ranks, FULL_SHARD (one rank would not shard: torch switches it to NO_SHARD); the
stand-in TE's LayerNormMLP (tests/fake_te.py) has TE's parameters and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from foundry_fp8.composer.guard import layer_flops
from foundry_fp8.swap import linear_flops, module_flops, original_shapes
from tests.fake_te import _LayerNormMLP
from tests.ranks import init_rank, run_ranks

HIDDEN, FFN = 16, 64


def _model() -> nn.Sequential:
    _LayerNormMLP.__module__, _LayerNormMLP.__name__ = "transformer_engine.pytorch.module", \
        "LayerNormMLP"  # as tests/fake_te.py installs it
    return nn.Sequential(_LayerNormMLP(HIDDEN, FFN, device="cpu"), nn.Linear(HIDDEN, HIDDEN))


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init_rank(rank, rendezvous)
    torch.manual_seed(0)
    model = _model()
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    shapes = original_shapes(wrapped)
    result = {"fc1_shape": list(model[0].fc1_weight.shape),
              "flops": module_flops(model[0], shapes.get(model[0])),
              "total": linear_flops(wrapped),
              # fp8_guard's shares at FIT_START (after the wrap), no te_swap plan
              "guard": layer_flops(wrapped, {"mlp": model[0], "linear": model[1]}, None)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_fsdp1_sharded_layernorm_mlp_counts_its_unsharded_flops(tmp_path):
    run_ranks(_worker, str(tmp_path), deadline_s=120)
    found = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in found), "a rank did not finish"
    # by hand: 2 FLOPs per multiply-add; fc1 hidden x ffn, fc2 ffn x hidden, the Linear's
    flops = 2 * HIDDEN * FFN + 2 * FFN * HIDDEN
    total = flops + 2 * HIDDEN * HIDDEN
    for path in found:
        result = json.loads(path.read_text())
        # the wrap did shard: fc1 is a 1-D view of this rank's share
        assert len(result["fc1_shape"]) == 1
        assert result["flops"] == flops
        assert result["total"] == total
        assert result["guard"] == {"mlp": flops / total, "linear": 2 * HIDDEN * HIDDEN / total}
    # the same counts unwrapped
    model = _model()
    assert module_flops(model[0]) == flops
    assert linear_flops(model) == total
