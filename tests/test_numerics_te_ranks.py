"""Statistics pooled across 2 gloo ranks (`all_reduce_sufficient_stats`) equal those of the
ranks' tensors concatenated, every statistic, against the float64 reference of
tests/test_numerics.py (TE's cast and overflow test): uneven shards, NaN/Inf, bfloat16, an
empty shard and an all-zero one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from foundry_fp8.numerics import (
    STAT_KEYS,
    all_reduce_sufficient_stats,
    finalize_stats,
    sufficient_stats,
)
from tests.ranks import init_rank, run_ranks
from tests.test_numerics import pooled_rel, ref_stats
from tests.test_numerics_te_stats import te_amax, te_current_scale

NAN, INF = float("nan"), float("inf")


def _shards(case: str) -> list[torch.Tensor]:
    """Rank 0's and rank 1's piece of one tensor."""
    gen = torch.Generator().manual_seed(31)
    a = torch.randn(1001, generator=gen) * torch.logspace(-9, 3, 1001)
    b = torch.randn(2000, generator=gen) * 3
    a[17], b[5], b[6], b[1000:1100] = NAN, INF, -INF, 0.0
    if case == "uneven":
        return [a, b]
    if case == "bfloat16":
        return [a.bfloat16(), b.bfloat16()]
    if case == "empty":
        return [a, a[:0]]
    if case == "zeros":
        return [a, torch.zeros(50)]
    raise ValueError(case)


# current scaling (None) where one scale serves the whole tensor: an Inf on one rank only casts
# the ranks at different scales (tests/test_stats_distributed.py pools those)
CASES = [(case, fmt, scale) for case in ("uneven", "bfloat16", "empty", "zeros")
         for fmt in ("e4m3", "e5m2") for scale in (None, 5.0)
         if scale is not None or case in ("empty", "zeros")]


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        rows = torch.stack([sufficient_stats(_shards(case)[rank], fmt, scale)
                            for case, fmt, scale in CASES])
        all_reduce_sufficient_stats(rows)
        torch.save(finalize_stats(rows).tolist(), f"{out_dir}/rank{rank}.pt")
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def pooled(tmp_path_factory) -> list[dict[str, float]]:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(_worker, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]
    return [dict(zip(STAT_KEYS, row, strict=True)) for row in ranks[0]]


def _reference(case: str, fmt: str, scale: float | None) -> dict[str, float]:
    """Every statistic of the concatenation, each rank cast at its own current scale when
    `scale` is None (TE's per-rank cast); a shard with nothing to scale casts nothing."""
    shards = [[float(v) for v in s.float()] for s in _shards(case)]
    values = shards[0] + shards[1]
    finite = [v for v in values if v == v and abs(v) != INF]
    if scale is None:
        scales = [te_current_scale(te_amax(s), fmt) for s in shards if any(s)]
        [used] = scales  # one shard to scale
    else:
        used = scale
    want = ref_stats(values, fmt, used)
    if scale is None and not any(abs(v) == INF for v in values):
        want["overflow_pct"] = 0.0  # a cast at its own amax clips nothing
    current = te_current_scale(max(abs(v) for v in finite), fmt)
    return {**want, "scale": used, "current_scale": current, "scale_ratio": used / current,
            "nan_count": sum(1 for v in values if v != v),
            "inf_count": sum(1 for v in values if abs(v) == INF)}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_pooled_statistics_are_those_of_the_concatenated_tensor(pooled, index):
    case, fmt, scale = CASES[index]
    got, want = pooled[index], _reference(case, fmt, scale)
    assert set(want) == set(STAT_KEYS)
    for key in STAT_KEYS:
        assert got[key] == pytest.approx(want[key], rel=pooled_rel(key), abs=1e-300), key
