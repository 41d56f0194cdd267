"""FP8 numerics in plain torch: TE's scaling rules, saturating round trips, tensor statistics.

Works on any device (FP8 readiness on CPU or A100). Scale rules follow TransformerEngine:
current scaling `scale = fp8_max / amax` (TE's compute_scale_from_amax), delayed scaling as
TE's default fused update (`delayed_scale_update`).

Statistics go through sufficient statistics (`sufficient_stats`): counts, sums and maxima that
pool by adding and maxing across pieces of a tensor (ranks), so cross-rank numbers are those of
the whole tensor and cost one all_reduce per reduction op; `finalize_stats` turns them into the
reported ones. Counts and maxima pool exactly; the sums of squares are float32 sums over rows of
at most `ROW` elements, added in float64, so pieces and the whole agree to float32 rounding
(about 1e-7 relative), not bit for bit.
"""

from __future__ import annotations

import torch

from foundry_fp8.recipe import FP8_MAX

FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FLOAT32_MAX = torch.finfo(torch.float32).max

#: Order of the values `tensor_stats_tensor` and `finalize_stats` return.
STAT_KEYS = ("amax", "amin", "underflow_pct", "overflow_pct", "mse", "rel_mse", "cos_sim", "scale",
             "current_scale", "scale_ratio", "nan_count", "inf_count")

#: Sufficient statistics of one tensor (`sufficient_stats`), in this order: the SUM_KEYS pool by
#: summing, the MAX_KEYS by taking the maximum (minima are stored negated), so pieces of a tensor
#: seen on several ranks or micro-batches pool exactly, with one all_reduce per reduction op.
SUM_KEYS = ("seen", "count", "nan_count", "inf_count", "underflow", "overflow", "sq_error",
            "dot", "x_sq", "rt_sq")
#: `scale_ratio` is each piece's own (its scale over its own amax's current scale): pieces cast
#: with different scales (micro-batches under delayed scaling, whose scale TE updates after each)
#: keep the ratio of the one that outgrew its scale most, which the smallest scale and the
#: pooled amax hid (a micro-batch overflowing 57 % at ratio 7.9 read as ratio 1.0). The
#: stale-scale rule judges the smallest scale over the whole tensor's current scale instead
#: (`health.rules.stale_scale_ratio`, from the logged `scale` and `current_scale`).
#: `neg_scale` is that of a piece with something to scale, `neg_idle_scale` that of one with
#: nothing (empty, all zero or NaN), which casts every element the same at any scale: pooled, it
#: is the tensor's scale only where no piece had something to scale.
MAX_KEYS = ("amax", "neg_amin", "neg_scale", "neg_idle_scale", "fp8_max", "scale_ratio")
SUFFICIENT_KEYS = SUM_KEYS + MAX_KEYS
SUFFICIENT_INDEX = {key: i for i, key in enumerate(SUFFICIENT_KEYS)}

#: Elements per piece `sufficient_stats` works on: its temporaries for a piece (magnitudes, two
#: float32 buffers, the FP8 values: at most 13 bytes per element, 11 for bfloat16) stay under
#: 208 MiB whatever the tensor's size (a contiguous x is read in place), in forward/backward
#: hooks while activations are alive.
CHUNK = 2 ** 24
#: Elements per float32 partial sum (exact counts up to 2**24, squares far from overflow); the
#: partial sums are added in float64.
ROW = 2 ** 10
#: frexp exponent of the amax's working magnitude `|x| * 2**m`, in [2**56, 2**57): the float32
#: squares of x and of the error (< 2**114) sum over a row of ROW short of overflow (< 2**124),
#: and errors down to 2**-119 of the amax still square to normal numbers (at an amax near
#: fp8_max, those below 2**-72 of it squared to 0: mse 0 for [3.4e38, 1.0], whose amax
#: round-trips exactly and whose 1.0 underflows, where TE's float32 mse is 0.5).
_WORK_EXPONENT = 57
#: Dtypes read as they are; any other is converted to float32 a piece at a time, as before.
_READ_AS_IS = (torch.float32, torch.bfloat16, torch.float16)


def _check_format(fmt: str) -> None:
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown FP8 format {fmt!r}: use 'e4m3' or 'e5m2'")


def current_scale(amax: torch.Tensor, fmt: str, *, epsilon: float = 0.0,
                  power_2: bool = False) -> torch.Tensor:
    """Current scaling: `fp8_max / max(amax, epsilon)`; 1 for zero or infinite amax,
    float32 max when the division overflows, rounded down to a power of 2 if asked."""
    _check_format(fmt)
    return _scale_from_amax(amax, FP8_MAX[fmt], epsilon=epsilon, power_2=power_2)


def _on(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """value as float32 on device. A Python number is filled there: `torch.as_tensor(number,
    device=cuda)` copies from the host and waits for the work queued on the device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), value, dtype=torch.float32, device=device)


def _divide(numerator: torch.Tensor | float, amax: torch.Tensor) -> torch.Tensor:
    """`numerator / amax` rounded once, as TE's kernels divide (`__fdiv_rn` in
    transformer_engine/common/recipe/recipe_common.cuh:31): torch computes `number / tensor`
    as a product with a rounded reciprocal, one ulp off for about a quarter of the amaxes."""
    return _on(numerator, amax.device) / amax


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


def delayed_scale(amax: torch.Tensor, kept: torch.Tensor,
                  scaled_max: torch.Tensor | float) -> torch.Tensor:
    """Delayed scaling's scale for `amax` as `kernel_bulk` computes it
    (transformer_engine/common/recipe/delayed_scaling.cu:238-249, 331): `scaled_max / amax`
    (`fp8_max * 2**-margin`) rounded once, `kept` where the amax is not finite and positive (TE
    keeps the old scale), then float32 max for an infinite result (the margin applied first)."""
    amax = amax.float()
    scale = torch.where((amax > 0) & torch.isfinite(amax), _divide(scaled_max, amax), kept)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)


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
    # a column that recorded nothing keeps its scale: its amax counts as unusable (0)
    new_scale = delayed_scale(torch.where(recorded != 0, amax, torch.zeros_like(amax)), scale,
                              fp8_max * 2.0 ** -margin)
    rolled = torch.roll(amax_history, shifts=-1, dims=0)
    rolled[0] = 0.0
    new_history = torch.where(recorded != 0, rolled, amax_history)
    return new_history, new_scale.to(scale.dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """`saturate(x * scale)` cast to the FP8 dtype: the FP8 values a GEMM reads, byte for byte
    those of TE's cast (`OType(in * scale)` in float32, cuda_fp8.hpp's `__NV_SATFINITE`
    conversion; tests/test_numerics_te_cast.py).

    Saturation first: a plain cast to float8_e4m3fn turns overflow into NaN. Every NaN becomes
    the canonical 0x7F, as CUDA's conversion makes it: torch keeps a NaN's sign (0xFF).
    """
    _check_format(fmt)
    scaled = (x.float() * scale).clamp_(-FP8_MAX[fmt], FP8_MAX[fmt])
    return scaled.masked_fill_(torch.isnan(scaled), torch.nan).to(FP8_DTYPE[fmt])


def scale_inverse(scale: torch.Tensor | float) -> torch.Tensor:
    """`1 / scale` in float32, rounded once: the `scale_inv` TE's cast kernels write next to the
    FP8 data (`__frcp_rn`, transformer_engine/common/utils.cuh:949-951)."""
    return _divide(1.0, torch.as_tensor(scale, dtype=torch.float32))


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 values back to float32 as TE's dequantize kernel computes them: `q * scale_inv`
    (common/cast/fp8/dequantize_fp8.cuh:31-32), which differs from `q / scale` by an ulp for
    most scales that are no power of 2."""
    return q.float() * scale_inverse(scale)


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """`x -> saturate(x * scale) -> fp8 -> * scale_inv`, in x's dtype."""
    return dequantize(quantize(x, scale, fmt), scale).to(x.dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """The amax TE records when it casts x: the largest magnitude, NaN skipped and inf kept, as
    its kernels reduce with `fmaxf` (transformer_engine/common/util/vectorized_pointwise.h:202,
    common/recipe/current_scaling.cu:55-60); 0 for an empty x, which TE does not cast
    (pytorch/csrc/quantizer.cpp:634, 990). float32 on x's device, no host sync; read in pieces
    of CHUNK elements."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    return torch.stack([piece.abs().nan_to_num_(nan=0.0, posinf=torch.inf).max()
                        for piece in _pieces(x)]).max().float()


def _pieces(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x flattened, in pieces of at most CHUNK elements (one empty piece for an empty x)."""
    return x.detach().reshape(-1).split(CHUNK)


def _count(t: torch.Tensor, dim: int | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Nonzero (and NaN) elements of t, float32, exact up to 2**24: a float reduction reading t
    as it is, where `(t != 0).sum()` writes a bool tensor and sums an int64 copy of it."""
    return torch.linalg.vector_norm(t, ord=0, dim=dim, dtype=torch.float32, out=out)


def _magnitudes(piece: torch.Tensor, counts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """|piece| with NaN and Inf as 0 (a zero changes no sum, maximum or underflow count), in
    piece's dtype when float32/bfloat16/float16, else float32. `counts` gets the piece's
    [NaN, Inf, finite nonzero] counts."""
    magnitude = (piece if piece.dtype in _READ_AS_IS else piece.float()).abs()
    if counts is None:
        return magnitude.nan_to_num_(nan=0.0, posinf=0.0)
    every = _count(magnitude)
    no_nan = _count(magnitude.nan_to_num_(nan=0.0, posinf=torch.inf))
    finite = _count(magnitude.nan_to_num_(posinf=0.0))
    counts.append(torch.stack([every - no_nan, no_nan - finite, finite]))
    return magnitude


def nonfinite_seen(x: torch.Tensor) -> torch.Tensor:
    """[NaN in x, Inf in x] as 0 or 1 (float64, on x's device, no host sync), in the order of
    `SUFFICIENT_KEYS`' counts: one read of x, its largest magnitude, which a NaN or an Inf
    decides (NaN where both are), for the sightings after a tensor's first."""
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=x.device)
    top = torch.stack([torch.linalg.vector_norm(piece, ord=torch.inf).float()
                       for piece in _pieces(x)]).amax()
    return torch.stack([torch.isnan(top), torch.isinf(top)]).double()


def _exponent(t: torch.Tensor) -> torch.Tensor:
    """e with t = m * 2**e, m in [0.5, 1) (0 for t = 0)."""
    return torch.frexp(t.double()).exponent


def _power_of_2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as a normal float32 number (exponent clamped to [-126, 127]): a factor that
    rescales float32 numbers exactly, short of overflow and underflow."""
    return torch.ldexp(torch.ones((), device=exponent.device), exponent.clamp(-126, 127))


def _scaled(mag: torch.Tensor, factor: torch.Tensor, rows: int, width: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `mag * factor` as [rows, width], zeros after mag's end (they change no sum);
    written into `out` (float32 [rows, width]) when given."""
    flat = torch.empty(rows * width, device=mag.device) if out is None else out.view(-1)
    flat[mag.numel():].zero_()
    torch.mul(mag, factor.reshape(1), out=flat[:mag.numel()])  # one pass, bfloat16 read as is
    return flat.view(rows, width)


def _overflows(mag: torch.Tensor, limit: torch.Tensor, rows: int, width: int,
               out: torch.Tensor) -> torch.Tensor:
    """Per row of [rows, width], how many of mag exceed `limit`: TE's overflow test
    (`tensor > fp8_max * scale_inv`, transformer_engine/debug/features/utils/
    stats_computation.py:157), as `mag - limit` in float32 (bfloat16 widens exactly and the
    difference's sign is exact) clamped at 0 and counted, in `out` (float32 [rows, width])."""
    flat = out.view(-1)
    flat[mag.numel():].zero_()
    torch.sub(mag, limit.reshape(1), out=flat[:mag.numel()]).clamp_(min=0.0)
    return _count(out, dim=1)


def sufficient_stats(x: torch.Tensor, fmt: str = "e4m3",
                     scale: torch.Tensor | float | None = None, margin: int = 0, *,
                     power_2: bool = False) -> torch.Tensor:
    """The pooled summary of x's FP8 round trip: float64 [len(SUFFICIENT_KEYS)] on x's device,
    computed without a host sync. `scale=None`: current scaling (`/ 2**margin`, optionally a
    power of 2, from the amax TE takes: an Inf makes it 1). NaN/Inf elements are counted, then
    left out of every other number.

    Cheap enough for every watched tensor of a logging step: x is read in pieces of CHUNK
    elements (bfloat16 stays bfloat16 until it is scaled), with no float64 copy and no bool sum.
    The cast is `saturate(|x| * scale)` to FP8 as `quantize` rounds it (rounding is symmetric);
    the round trip is `r = fp8 * scale_inv` in float32, as TE's GEMMs and dequantize see it
    (`dequantize`). Every sum is taken where its float32 squares neither overflow nor
    underflow, whatever x's magnitude or the scale, by exact power-of-2 rescaling: x and the
    error `x - r` at `|x| * 2**m`, the amax near 2**57 (`_WORK_EXPONENT`); r at `fp8 * mant`,
    where `scale_inv = mant * 2**e`, mant in [0.5, 1) (so the product rounds as `fp8 * scale_inv`
    does, but for a product that is a float32 subnormal, which TE rounds coarser: a scale_inv
    below 2**-126 that is no power of 2), within the FP8 range however far the scale is from
    x's. The error is one float32 subtraction of the two, exact where r is near x (Sterbenz),
    so mse is the round trip's to float32 rounding, also where x * scale falls on the FP8 grid.
    All as float32 row sums, rescaled in float64. dot is `(x - r)·r + r_sq`, accurate wherever
    r is close to x or far below it (saturation, underflow), where `(x_sq + r_sq - sq_error) / 2`
    would cancel to noise.
    """
    _check_format(fmt)
    fp8_max, fp8_dtype, device = FP8_MAX[fmt], FP8_DTYPE[fmt], x.device
    pieces = _pieces(x)
    counts: list[torch.Tensor] = []  # per piece: NaN, Inf, finite nonzero (float32, <= 2**24)
    extremes = []  # per piece: largest magnitude, smallest nonzero one
    for piece in pieces:
        mag = _magnitudes(piece, counts)
        extremes.append(torch.stack([mag.max().float(), torch.where(
            mag > 0, mag, torch.inf).min().float()]) if mag.numel()
            else torch.stack([_on(0.0, device), _on(torch.inf, device)]))
    mags = [mag] if len(pieces) == 1 else []  # else each piece's again: bounded memory
    del mag
    stacked = torch.stack(extremes)
    amax, amin = stacked[:, 0].amax(), stacked[:, 1].amin()
    nan_count, inf_count, nonzero = torch.stack(counts).double().sum(dim=0).unbind()
    if scale is None:
        # TE's amax takes an Inf in (fmaxf), and an infinite amax casts at scale 1
        # (transformer_engine/common/recipe/recipe_common.cuh:24-26): the finite rest may then
        # saturate, which no other current-scaled cast does
        cast_amax = torch.where(inf_count > 0, torch.inf, amax.double()).float()
        scale_t = current_scale(cast_amax, fmt, power_2=power_2) / (2.0 ** margin)
        something = cast_amax > 0
    else:
        scale_t = _on(scale, device).reshape(())
        something = amax > 0
    # a piece with nothing to scale (empty, all zero or NaN: under current scaling amax 0, scale
    # 1 by TE's rule) leaves the pooled scale to the others: an empty rank made a rank's
    # 448 / amax read as 1 (scale_ratio 1 / 448); under delayed scaling without reduce_amax a
    # rank with all-zero values is still at scale 1 (or an old scale), which read as the scale
    # of the others' casts (a stale scale to the stale-scale rule)
    pooled_scale = torch.where(something, scale_t, torch.inf)
    # the amax at |x| * 2**m in [2**56, 2**57); m clamped here, so that x and r move by the
    # same power of 2
    e_work = (_WORK_EXPONENT - _exponent(amax)).clamp(-126, 127)
    x_to_work = _power_of_2(e_work)
    inverse = scale_inverse(scale_t)
    mant, e_inv = torch.frexp(inverse)
    limit = fp8_max * inverse  # float32, rounded once: TE's overflow bound (`_overflows`)
    r_to_work = _power_of_2(e_work + e_inv)  # r at fp8 * mant -> r at 2**m
    shapes = [(-(-piece.numel() // ROW), ROW) if piece.numel() > ROW else (1, piece.numel())
              for piece in pieces]
    # per row: ‖x‖, the FP8 values' nonzero count, ‖r‖, ‖x - r‖, (x - r)·r, overflow
    partial = torch.zeros(6, sum(rows for rows, _ in shapes), device=device)
    start = 0
    for piece, (rows, width) in zip(pieces, shapes, strict=True):
        span = slice(start, start + rows)
        start += rows
        mag = mags.pop() if mags else _magnitudes(piece)
        q = torch.empty(rows, width, device=device)
        partial[5, span] = _overflows(mag, limit, rows, width, out=q)
        q = _scaled(mag, scale_t, rows, width, out=q)  # |x| * scale, rounded as `quantize` does
        q = q.clamp_(max=fp8_max).copy_(q.to(fp8_dtype))
        w = _scaled(mag, x_to_work, rows, width)  # |x| * 2**m, exact
        del mag
        torch.linalg.vector_norm(w, dim=1, out=partial[0, span])
        _count(q, dim=1, out=partial[1, span])
        r = q.mul_(mant)  # the round trip * 2**-e, rounded as fp8 * scale_inv is
        torch.linalg.vector_norm(r, dim=1, out=partial[2, span])
        w.addcmul_(r, r_to_work.reshape(1), value=-1.0)  # (|x| - r) * 2**m: r's part is exact
        torch.linalg.vector_norm(w, dim=1, out=partial[3, span])
        torch.sum(r.mul_(w), dim=1, out=partial[4, span])
    partial = partial.double()
    x_work = x_to_work.double()
    r_scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=device), e_inv.double())
    # rows 0 and 3 by a slice: a Python list index is copied from the host (a sync on CUDA)
    x_sq, sq_error = partial[0:4:3].square().sum(dim=1) / x_work.square()
    rt_sq = partial[2].square().sum() * r_scale.square()
    overflow = partial[5].sum()
    if scale is None:  # without an Inf, `|x| * scale` above fp8_max is the division's rounding
        overflow = torch.where(inf_count > 0, overflow, 0.0)
    # this cast's scale_ratio, computed as `finalize_stats` does; 0 (pooling leaves it to the
    # others) where there was nothing to scale
    ratio = pooled_scale.double() / _scale_from_amax(amax.double(), _on(fp8_max, device)).double()
    ratio = torch.where((amax > 0) & torch.isfinite(pooled_scale), ratio, 0.0)
    parts = {
        "seen": _on(1.0, device), "count": x.numel() - nan_count - inf_count, "nan_count": nan_count,
        "inf_count": inf_count, "underflow": nonzero - partial[1].sum(),
        "overflow": overflow, "sq_error": sq_error,
        "dot": partial[4].sum() * r_scale / x_work + rt_sq, "x_sq": x_sq, "rt_sq": rt_sq,
        "amax": amax, "neg_amin": -amin, "neg_scale": -pooled_scale,
        "neg_idle_scale": torch.where(something, -torch.inf, -scale_t),
        "fp8_max": _on(fp8_max, device), "scale_ratio": ratio,
    }
    return torch.stack([parts[k].double().reshape(()) for k in SUFFICIENT_KEYS])


def empty_sufficient_stats(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[n, len(SUFFICIENT_KEYS)] rows that pooling leaves unchanged (a tensor nobody saw)."""
    rows = torch.zeros(n, len(SUFFICIENT_KEYS), dtype=torch.float64, device=device)
    rows[:, len(SUM_KEYS):] = -torch.inf
    return rows


#: How sufficient statistics pool, over ranks or over one tensor's pieces: SUM_KEYS summed,
#: MAX_KEYS maxed (the layout puts the sums first).
SUMMED, MAXED = slice(None, len(SUM_KEYS)), slice(len(SUM_KEYS), None)


def pool_sufficient_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows [..., K] of two pieces of the same tensors pooled as the ranks' are
    (`all_reduce_sufficient_stats`)."""
    return torch.cat([a[..., SUMMED] + b[..., SUMMED],
                      torch.maximum(a[..., MAXED], b[..., MAXED])], dim=-1)


def all_reduce_sufficient_stats(rows: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Pool rows [..., K] across the ranks of `group` (torch.distributed), in place: one
    all_reduce SUM and one all_reduce MAX, whatever the number of rows."""
    import torch.distributed as torch_dist

    sums = rows[..., SUMMED].contiguous()
    maxes = rows[..., MAXED].contiguous()
    torch_dist.all_reduce(sums, op=torch_dist.ReduceOp.SUM, group=group)
    torch_dist.all_reduce(maxes, op=torch_dist.ReduceOp.MAX, group=group)
    rows.copy_(torch.cat([sums, maxes], dim=-1))
    return rows


def finalize_stats(rows: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics [..., K] -> the statistics [..., len(STAT_KEYS)] (float64, same
    device). Percentages and mse are over the finite elements (NaN where there is none),
    rel_mse = ‖x - fp8(x)‖² / ‖x‖²; `scale` is the smallest scale of the pieces with
    something to scale (none had: the smallest of theirs; a row nobody saw: the current
    scale); `current_scale` is `fp8_max / amax` of the pooled
    amax (no margin); `scale_ratio` the largest of the pieces' own `scale / current_scale`
    (one piece, or pieces cast with one scale: `scale / current_scale`)."""
    s = {key: rows[..., i] for i, key in enumerate(SUFFICIENT_KEYS)}
    count = s["count"].clamp_min(1.0)
    amin = -s["neg_amin"]
    amin = torch.where(torch.isinf(amin), torch.zeros_like(amin), amin)
    current = _scale_from_amax(s["amax"], s["fp8_max"].float()).double()
    scale = -s["neg_scale"]
    idle = -s["neg_idle_scale"]  # no piece had anything to scale: their scale, if any cast
    scale = torch.where(torch.isinf(scale), torch.where(torch.isinf(idle), current, idle), scale)
    norms = s["x_sq"].sqrt() * s["rt_sq"].sqrt()
    # a zero tensor's round trip is exact (1); a nonzero one cast to all zeros kept nothing (0)
    cos = torch.where(norms > 0, s["dot"] / norms.clamp_min(1e-300),
                      (s["x_sq"] == 0).to(norms.dtype))
    stats = {
        "amax": s["amax"], "amin": amin, "underflow_pct": s["underflow"] * 100.0 / count,
        "overflow_pct": s["overflow"] * 100.0 / count, "mse": s["sq_error"] / count,
        # the error relative to the tensor's own size, comparable across layers and tensors
        "rel_mse": torch.where(s["x_sq"] > 0, s["sq_error"] / s["x_sq"].clamp_min(1e-300),
                               torch.zeros_like(s["x_sq"])),
        "cos_sim": cos, "scale": scale, "current_scale": current,
        "scale_ratio": torch.where(s["scale_ratio"] > 0, s["scale_ratio"], scale / current),
        "nan_count": s["nan_count"], "inf_count": s["inf_count"],
    }
    # a tensor seen with no finite element (all NaN/Inf) has no round trip to judge: NaN, which
    # the summaries and rules skip, rather than a perfect 1.0 and 0 % (`nan_count` says it)
    none = (s["count"] == 0) & (s["nan_count"] + s["inf_count"] > 0)
    for key in ("amin", "underflow_pct", "overflow_pct", "mse", "rel_mse", "cos_sim",
                "current_scale", "scale_ratio"):
        stats[key] = torch.where(none, torch.nan, stats[key])
    return torch.stack([stats[k] for k in STAT_KEYS], dim=-1)


def tensor_stats_tensor(x: torch.Tensor, fmt: str = "e4m3",
                        scale: torch.Tensor | float | None = None, margin: int = 0) -> torch.Tensor:
    """All statistics of `tensor_stats` as one float64 tensor on x's device (order: STAT_KEYS)."""
    return finalize_stats(sufficient_stats(x, fmt, scale, margin))


def tensor_stats(x: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float | None = None,
                 margin: int = 0) -> dict[str, float]:
    """FP8 health of a tensor: amax, amin (smallest non-zero magnitude), underflow_pct (non-zero
    elements that round to 0), overflow_pct (magnitude above `fp8_max * scale_inv`, TE's
    overflows%; under current scaling only where an Inf makes the scale 1), mse and
    cos_sim against its FP8 round trip `fp8 * scale_inv` (float32, as TE dequantizes), the scale used (`None`: current scaling), the current
    scale `fp8_max / amax` and `scale_ratio` (used / current: < 1 wastes range, > 1 overflows),
    NaN/Inf counts. Percentages are of the finite elements."""
    return dict(zip(STAT_KEYS, tensor_stats_tensor(x, fmt, scale, margin).tolist(), strict=True))
