"""FP8 numerics in plain torch: TE's scaling rules, saturating round trips, tensor statistics.

Works on any device (FP8 readiness on CPU or A100). Scale rules follow TransformerEngine:
current scaling `scale = fp8_max / amax` (TE's compute_scale_from_amax), delayed scaling
`fp8_max / amax_from_history / 2**margin` with the previous scale kept when amax is 0 or not
finite, and the history rolled with slot 0 zeroed after every update.
"""

from __future__ import annotations

import torch

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FLOAT32_MAX = torch.finfo(torch.float32).max

#: Order of the values `tensor_stats_tensor` returns (one device tensor: one host transfer).
STAT_KEYS = ("amax", "amin", "underflow_pct", "overflow_pct", "mse", "cos_sim", "scale",
             "nan_count", "inf_count")


def _check_format(fmt: str) -> None:
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown FP8 format {fmt!r}: use 'e4m3' or 'e5m2'")


def current_scale(amax: torch.Tensor, fmt: str, *, epsilon: float = 0.0,
                  power_2: bool = False) -> torch.Tensor:
    """Current scaling: `fp8_max / max(amax, epsilon)`; 1 for zero or infinite amax,
    float32 max when the division overflows, rounded down to a power of 2 if asked."""
    _check_format(fmt)
    amax = torch.clamp(amax.float(), min=epsilon)
    scale = FP8_MAX[fmt] / amax
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    scale = torch.where(torch.isnan(scale), torch.ones_like(scale), scale)
    if power_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def delayed_scale_update(amax_history: torch.Tensor, scale: torch.Tensor,
                         fp8_max: torch.Tensor | float, algo: str = "max",
                         margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update: returns `(new_history, new_scale)`.

    `amax_history` is [history_len, n_tensors] with the newest amax in row 0.
    """
    if algo == "max":
        amax = amax_history.max(dim=0).values
    elif algo == "most_recent":
        amax = amax_history[0]
    else:
        raise ValueError(f"unknown amax_compute_algo {algo!r}: use 'max' or 'most_recent'")
    new_scale = (fp8_max / amax) / (2.0 ** margin)
    usable = (amax > 0) & torch.isfinite(amax)
    new_scale = torch.where(usable, new_scale, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLOAT32_MAX),
                            new_scale)
    new_history = torch.roll(amax_history, shifts=-1, dims=0)
    new_history[0] = 0.0
    return new_history, new_scale.to(scale.dtype)


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """`x -> saturate(x * scale) -> fp8 -> / scale`, in x's dtype.

    Saturation first: a plain cast to float8_e4m3fn turns overflow into NaN.
    """
    _check_format(fmt)
    scaled = x.float() * scale
    scaled = torch.clamp(scaled, -FP8_MAX[fmt], FP8_MAX[fmt])
    return (scaled.to(FP8_DTYPE[fmt]).float() / scale).to(x.dtype)


def tensor_stats_tensor(x: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float | None = None,
                        margin: int = 0) -> torch.Tensor:
    """All statistics of `tensor_stats` as one float32 tensor on x's device (order: STAT_KEYS).

    NaN and Inf elements are counted, then left out of every other number.
    """
    _check_format(fmt)
    flat = x.detach().reshape(-1).float()
    finite = torch.isfinite(flat)
    nan_count = torch.isnan(flat).sum()
    inf_count = torch.isinf(flat).sum()
    values = flat[finite]
    magnitude = values.abs()
    amax = magnitude.max() if values.numel() else torch.zeros((), device=flat.device)
    nonzero = magnitude[magnitude > 0]
    amin = nonzero.min() if nonzero.numel() else torch.zeros((), device=flat.device)
    if scale is None:
        scale_t = current_scale(amax, fmt) / (2.0 ** margin)
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=flat.device)
    count = max(values.numel(), 1)
    roundtrip = quantize_dequantize(values, scale_t, fmt)
    underflow = ((values != 0) & (roundtrip == 0)).sum() * (100.0 / count)
    if scale is None:
        # 0 by construction; amax * float32(fp8_max / amax) can land a rounding step above
        # fp8_max, which saturates to the value it would round to anyway.
        overflow = torch.zeros((), device=flat.device)
    else:
        overflow = (magnitude * scale_t > FP8_MAX[fmt]).sum() * (100.0 / count)
    values64, roundtrip64 = values.double(), roundtrip.double()
    mse = ((values64 - roundtrip64) ** 2).sum() / count
    norms = values64.norm() * roundtrip64.norm()
    cos = torch.where(norms > 0, (values64 * roundtrip64).sum() / norms.clamp_min(1e-300),
                      torch.ones((), dtype=torch.float64, device=flat.device))
    parts = [amax, amin, underflow, overflow, mse, cos, scale_t, nan_count, inf_count]
    return torch.stack([torch.as_tensor(p, device=flat.device).float().reshape(()) for p in parts])


def tensor_stats(x: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float | None = None,
                 margin: int = 0) -> dict[str, float]:
    """FP8 health of a tensor: amax, amin (smallest non-zero magnitude), underflow_pct (non-zero
    elements that round to 0), overflow_pct (scaled magnitude above the format max), mse and
    cos_sim against its FP8 round trip, the scale used (`None`: current scaling), NaN/Inf counts.
    Percentages are of the finite elements."""
    return dict(zip(STAT_KEYS, tensor_stats_tensor(x, fmt, scale, margin).tolist(), strict=True))
