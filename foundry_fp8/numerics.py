"""FP8 numerics in plain torch: TE's scaling rules, saturating round trips, tensor statistics.

Works on any device (FP8 readiness on CPU or A100). Scale rules follow TransformerEngine:
current scaling `scale = fp8_max / amax` (TE's compute_scale_from_amax), delayed scaling as
TE's default fused update (`delayed_scale_update`).

Statistics go through sufficient statistics (`sufficient_stats`): sums and maxima that pool
exactly across pieces of a tensor (ranks), so cross-rank numbers are those of the whole tensor
and cost one all_reduce per reduction op; `finalize_stats` turns them into the reported ones.
"""

from __future__ import annotations

import torch

from foundry_fp8.recipe import FP8_MAX

FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FLOAT32_MAX = torch.finfo(torch.float32).max

#: Order of the values `tensor_stats_tensor` and `finalize_stats` return.
STAT_KEYS = ("amax", "amin", "underflow_pct", "overflow_pct", "mse", "cos_sim", "scale",
             "current_scale", "scale_ratio", "nan_count", "inf_count")

#: Sufficient statistics of one tensor (`sufficient_stats`), in this order: the SUM_KEYS pool by
#: summing, the MAX_KEYS by taking the maximum (minima are stored negated), so pieces of a tensor
#: seen on several ranks or micro-batches pool exactly, with one all_reduce per reduction op.
SUM_KEYS = ("seen", "count", "nan_count", "inf_count", "underflow", "overflow", "sq_error",
            "dot", "x_sq", "q_sq")
MAX_KEYS = ("amax", "neg_amin", "neg_scale", "fp8_max")
SUFFICIENT_KEYS = SUM_KEYS + MAX_KEYS
SUFFICIENT_INDEX = {key: i for i, key in enumerate(SUFFICIENT_KEYS)}


def _check_format(fmt: str) -> None:
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown FP8 format {fmt!r}: use 'e4m3' or 'e5m2'")


def current_scale(amax: torch.Tensor, fmt: str, *, epsilon: float = 0.0,
                  power_2: bool = False) -> torch.Tensor:
    """Current scaling: `fp8_max / max(amax, epsilon)`; 1 for zero or infinite amax,
    float32 max when the division overflows, rounded down to a power of 2 if asked."""
    _check_format(fmt)
    return _scale_from_amax(amax, FP8_MAX[fmt], epsilon=epsilon, power_2=power_2)


def _divide(numerator: torch.Tensor | float, amax: torch.Tensor) -> torch.Tensor:
    """`numerator / amax` rounded once, as TE's kernels divide (`__fdiv_rn` in
    transformer_engine/common/recipe/recipe_common.cuh:31): torch computes `number / tensor`
    as a product with a rounded reciprocal, one ulp off for about a quarter of the amaxes."""
    return torch.as_tensor(numerator, dtype=torch.float32, device=amax.device) / amax


def _scale_from_amax(amax: torch.Tensor, fp8_max: torch.Tensor | float, *, epsilon: float = 0.0,
                     power_2: bool = False) -> torch.Tensor:
    """`current_scale` with the format's max given as a number or a per-element tensor."""
    amax = torch.clamp(amax.float(), min=epsilon)
    scale = _divide(fp8_max, amax)
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    scale = torch.where(torch.isnan(scale), torch.ones_like(scale), scale)
    if power_2:  # keep the exponent bits as TE does (recipe_common.cuh:39-41); log2 may round up
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
    return scale


def delayed_scale_update(amax_history: torch.Tensor, scale: torch.Tensor,
                         fp8_max: torch.Tensor | float, algo: str = "max",
                         margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update, column by column as TE's default fused kernel
    (`kernel_bulk`, transformer_engine/common/recipe/delayed_scaling.cu:162-253, unchanged
    since v2.18): returns `(new_history, new_scale)`.

    `amax_history` is [history_len, n_tensors], the amax to record in row 0. A column whose row
    0 is 0 recorded nothing and is left alone, history and scale (l. 182-186), so updating
    twice changes nothing. Any other column (NaN too) is rolled up by one with row 0 zeroed,
    the recorded amax landing in the last row (l. 187-198); its new scale is
    `fp8_max * 2**-margin / amax` (l. 331, 239), amax being the largest row before the roll,
    NaN rows skipped as fmaxf does (`max`, l. 206-217), or row 0 (`most_recent`, l. 204). The
    scale is kept when that amax is not finite and positive, float32 max when the division
    overflows (l. 238-249). TE's unfused Python path (NVTE_UNFUSED_FP8_UPDATE=1) rolls every
    column; it is not modelled.
    """
    recorded = amax_history[0]
    if algo == "max":
        amax = torch.where(torch.isnan(amax_history), 0.0, amax_history).amax(dim=0)
    elif algo == "most_recent":
        amax = recorded
    else:
        raise ValueError(f"unknown amax_compute_algo {algo!r}: use 'max' or 'most_recent'")
    new_scale = _divide(fp8_max * 2.0 ** -margin, amax)
    usable = (recorded != 0) & (amax > 0) & torch.isfinite(amax)
    new_scale = torch.where(usable, new_scale, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLOAT32_MAX),
                            new_scale)
    rolled = torch.roll(amax_history, shifts=-1, dims=0)
    rolled[0] = 0.0
    new_history = torch.where(recorded != 0, rolled, amax_history)
    return new_history, new_scale.to(scale.dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """`saturate(x * scale)` cast to the FP8 dtype: the FP8 values a GEMM reads.

    Saturation first: a plain cast to float8_e4m3fn turns overflow into NaN.
    """
    _check_format(fmt)
    scaled = x.float() * scale
    return torch.clamp(scaled, -FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPE[fmt])


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 values back to float32: `q / scale`."""
    return q.float() / scale


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """`x -> saturate(x * scale) -> fp8 -> / scale`, in x's dtype."""
    return dequantize(quantize(x, scale, fmt), scale).to(x.dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """The amax TE records when it casts x: the largest magnitude, NaN skipped and inf kept, as
    its kernels reduce with `fmaxf` (transformer_engine/common/util/vectorized_pointwise.h:202,
    common/recipe/current_scaling.cu:55-60); 0 for an empty x, which TE does not cast
    (pytorch/csrc/quantizer.cpp:634, 990). float32 on x's device, no host sync."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    magnitude = x.detach().abs()
    return torch.where(torch.isnan(magnitude), 0, magnitude).max().float()


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude of x (float32, on x's device, 0 when there is none), without a
    host sync: what the monitor records on the batches before a logging step."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    magnitude = x.detach().abs()
    return torch.where(torch.isfinite(magnitude), magnitude, 0).max().float()


def sufficient_stats(x: torch.Tensor, fmt: str = "e4m3",
                     scale: torch.Tensor | float | None = None, margin: int = 0, *,
                     power_2: bool = False) -> torch.Tensor:
    """The pooled-exact summary of x's FP8 round trip: float64 [len(SUFFICIENT_KEYS)] on x's
    device, computed without a host sync. `scale=None`: current scaling (`/ 2**margin`,
    optionally a power of 2). NaN/Inf elements are counted, then left out of every other number.
    """
    _check_format(fmt)
    flat = x.detach().reshape(-1).float()
    device = flat.device
    finite = torch.isfinite(flat)
    values = torch.where(finite, flat, 0.0)  # a zero changes no sum, max or underflow count
    magnitude = values.abs()
    zero = torch.zeros((), device=device)
    amax = magnitude.max() if flat.numel() else zero
    amin = torch.where(magnitude > 0, magnitude, torch.inf).amin() if flat.numel() else zero + torch.inf
    if scale is None:
        scale_t = current_scale(amax, fmt, power_2=power_2) / (2.0 ** margin)
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(())
    roundtrip = quantize_dequantize(values, scale_t, fmt)
    underflow = ((values != 0) & (roundtrip == 0)).sum()
    if scale is None:
        # 0 by construction; amax * float32(fp8_max / amax) can land a rounding step above
        # fp8_max, which saturates to the value it would round to anyway.
        overflow = zero
    else:
        overflow = (magnitude * scale_t > FP8_MAX[fmt]).sum()
    values64, roundtrip64 = values.double(), roundtrip.double()
    parts = {
        "seen": 1.0, "count": finite.sum(), "nan_count": torch.isnan(flat).sum(),
        "inf_count": torch.isinf(flat).sum(), "underflow": underflow, "overflow": overflow,
        "sq_error": ((values64 - roundtrip64) ** 2).sum(), "dot": (values64 * roundtrip64).sum(),
        "x_sq": (values64 ** 2).sum(), "q_sq": (roundtrip64 ** 2).sum(),
        "amax": amax, "neg_amin": -amin, "neg_scale": -scale_t, "fp8_max": FP8_MAX[fmt],
    }
    return torch.stack([torch.as_tensor(parts[k], device=device).double().reshape(())
                        for k in SUFFICIENT_KEYS])


def empty_sufficient_stats(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[n, len(SUFFICIENT_KEYS)] rows that pooling leaves unchanged (a tensor nobody saw)."""
    rows = torch.zeros(n, len(SUFFICIENT_KEYS), dtype=torch.float64, device=device)
    rows[:, len(SUM_KEYS):] = -torch.inf
    return rows


def all_reduce_sufficient_stats(rows: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Pool rows [..., K] across the ranks of `group` (torch.distributed), in place: one
    all_reduce SUM and one all_reduce MAX, whatever the number of rows."""
    import torch.distributed as torch_dist

    sums = rows[..., :len(SUM_KEYS)].contiguous()
    maxes = rows[..., len(SUM_KEYS):].contiguous()
    torch_dist.all_reduce(sums, op=torch_dist.ReduceOp.SUM, group=group)
    torch_dist.all_reduce(maxes, op=torch_dist.ReduceOp.MAX, group=group)
    rows.copy_(torch.cat([sums, maxes], dim=-1))
    return rows


def finalize_stats(rows: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics [..., K] -> the statistics [..., len(STAT_KEYS)] (float64, same
    device). Percentages and mse are over the finite elements; `scale` is the smallest pooled
    scale; `current_scale` is `fp8_max / amax` of the pooled amax (no margin);
    `scale_ratio = scale / current_scale`."""
    s = {key: rows[..., i] for i, key in enumerate(SUFFICIENT_KEYS)}
    count = s["count"].clamp_min(1.0)
    amin = -s["neg_amin"]
    amin = torch.where(torch.isinf(amin), torch.zeros_like(amin), amin)
    scale = -s["neg_scale"]
    current = _scale_from_amax(s["amax"], s["fp8_max"].float()).double()
    norms = s["x_sq"].sqrt() * s["q_sq"].sqrt()
    cos = torch.where(norms > 0, s["dot"] / norms.clamp_min(1e-300), torch.ones_like(norms))
    stats = {
        "amax": s["amax"], "amin": amin, "underflow_pct": s["underflow"] * 100.0 / count,
        "overflow_pct": s["overflow"] * 100.0 / count, "mse": s["sq_error"] / count,
        "cos_sim": cos, "scale": scale, "current_scale": current, "scale_ratio": scale / current,
        "nan_count": s["nan_count"], "inf_count": s["inf_count"],
    }
    return torch.stack([stats[k] for k in STAT_KEYS], dim=-1)


def tensor_stats_tensor(x: torch.Tensor, fmt: str = "e4m3",
                        scale: torch.Tensor | float | None = None, margin: int = 0) -> torch.Tensor:
    """All statistics of `tensor_stats` as one float64 tensor on x's device (order: STAT_KEYS)."""
    return finalize_stats(sufficient_stats(x, fmt, scale, margin))


def tensor_stats(x: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float | None = None,
                 margin: int = 0) -> dict[str, float]:
    """FP8 health of a tensor: amax, amin (smallest non-zero magnitude), underflow_pct (non-zero
    elements that round to 0), overflow_pct (scaled magnitude above the format max), mse and
    cos_sim against its FP8 round trip, the scale used (`None`: current scaling), the current
    scale `fp8_max / amax` and `scale_ratio` (used / current: < 1 wastes range, > 1 overflows),
    NaN/Inf counts. Percentages are of the finite elements."""
    return dict(zip(STAT_KEYS, tensor_stats_tensor(x, fmt, scale, margin).tolist(), strict=True))
