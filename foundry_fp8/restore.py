"""Checking, repairing and combining the FP8 state a checkpoint holds, before `fp8_state` writes
it into a model: a restore gives valid state or a one-line refusal, never poisoned state.

Valid is what TE's delayed scaling can write (`numerics.delayed_scale_update`, after TE's fused
update kernel): a scale is finite and positive (TE keeps the old scale for a non-finite amax and
writes float32 max where the division overflows); a history holds amaxes, non-negative, +inf
included (TE's amax reduction keeps inf, so a step that overflowed leaves one in the window and
the update keeps the scale meanwhile), with the rows the
recipe keeps (or none yet); and no finite amax the scale was computed from is larger than the
scale allows (`amax * scale <= fp8_max * 2**-margin`): an absurd amax (1e30) planted in a
history would otherwise set every scale it reaches near zero for `amax_history_len` steps. A
column whose window holds +inf is not checked against its scale: TE kept that scale through the
inf, so nothing ties them. A NaN counts as "nothing recorded", as TE's amax skips NaN and its
update's max skips a NaN row (an earlier emulation recorded some): it is stored as 0, which the
update treats the same way. Row 0, the amaxes recorded since the last update, is not restored: no
scale was computed from it, so nothing can tell a planted 1e30 there from a real amax, and at a
Composer checkpoint (batch end, after the step's updates) it holds nothing but the amaxes of
no-grad FP8 forwards, which the next step records anew.

Repair (`strict: false`), by the same rules: a non-amax history entry (negative) is
dropped (0, "nothing recorded" to TE's update); a bad scale, which leaves nothing to check
its history against (recomputed from a history holding a planted 1e30, it flushed the tensor
to zero), and a history the scale contradicts, where nothing tells which of the two is wrong,
start that column fresh as TE starts a module (scale 1, no amax); a history of another length is fitted as TE's
`adjust_amax_history_length` does (first rows kept, zero rows added); anything malformed (type,
shape, unknown field) leaves the module fresh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from foundry_fp8.numerics import FLOAT32_MAX, FP8_MAX, delayed_scale
from foundry_fp8.recipe import FP8Recipe

FP8ModuleState = dict[str, dict[str, torch.Tensor]]

#: Per direction: the tensors TE keeps per GEMM (forward: input, weight, output; backward:
#: grad output, grad input), `fp8_meta.read_fp8_meta`'s field prefix.
DIRECTIONS = {"fwd": 3, "bwd": 2}
FIELDS = tuple(f"{d}_{kind}" for d in DIRECTIONS for kind in ("scale", "amax_history"))

#: Rounding slack of the consistency check: TE rounds `fp8_max / amax` once in float32.
_SLACK = 1e-3


class StateProblems(ValueError):
    """What is wrong with one module's saved state; `str()` is one line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(problems[0] + more)


def payload_problem(state: Any) -> str | None:
    """The first thing in a saved `fp8_state` entry that is not tensors and plain types in our
    layout, naming its key path; None when the layout is ours."""
    if not isinstance(state, Mapping):
        return f"the entry is a {type(state).__name__}, not a mapping"
    for key, value in state.items():
        if key == "unsaved" and not isinstance(value, bool):
            return f"unsaved: expected true or false, got {type(value).__name__}"
        if key == "recipe" and value is not None and not (
                isinstance(value, Mapping) and all(isinstance(v, (str, int, float, bool))
                                                   for v in value.values())):
            return "recipe: expected a mapping of plain values"
        if key == "modules" and (problem := _modules_problem(value, "modules")):
            return problem
        if key == "ranks":
            if not isinstance(value, list) or not value:
                return "ranks: expected a non-empty list"
            for rank, modules in enumerate(value):
                if problem := _modules_problem(modules, f"ranks[{rank}]"):
                    return problem
        if key not in ("unsaved", "recipe", "modules", "ranks"):
            return f"unknown key {key!r}"
    return None


def _modules_problem(modules: Any, where: str) -> str | None:
    if not isinstance(modules, Mapping):
        return f"{where}: expected a mapping of module names, got {type(modules).__name__}"
    for name, tensors in modules.items():
        if not isinstance(name, str):
            return f"{where}: module name {name!r} is not a string"
        if not isinstance(tensors, Mapping):
            return f"{where}.{name}: expected a mapping of tensors, got {type(tensors).__name__}"
        for field, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                return f"{where}.{name}.{field}: expected a tensor, got {type(value).__name__}"
            # a sparse or meta tensor has no values to check; torch's ops on it raise
            if value.layout != torch.strided or value.is_meta:
                return (f"{where}.{name}.{field}: expected a dense tensor of values, got a "
                        f"{str(value.layout).removeprefix('torch.')} tensor on {value.device}")
    return None


def saved_recipe(state: Mapping[str, Any]) -> FP8Recipe | None:
    """The recipe a checkpoint was saved under (None: not recorded, a checkpoint before this
    was saved, or a run without a known recipe). Raises StateProblems on one we cannot read."""
    options = state.get("recipe")
    if options is None:
        return None
    try:
        return FP8Recipe(**options)
    except (TypeError, ValueError) as error:
        raise StateProblems([f"recipe: {error}"]) from None


def recipe_change(saved: FP8Recipe | None, run: FP8Recipe | None) -> str | None:
    """`key old -> new, ...` where the run's recipe is not the checkpoint's; None when they are
    the same or either is unknown. `reduce_amax` is not a change of the state: with it every
    rank holds the same state, without it each its own, and a checkpoint's per-rank states are
    combined as TE's reduction makes them where this run reduces (`fp8_state`)."""
    if saved is None or run is None:
        return None
    if saved.scaling != run.scaling:  # the other keys belong to one scaling or the other
        return f"scaling {saved.scaling} -> {run.scaling}"
    old, new = saved.as_config(), run.as_config()
    changed = [f"{key} {old.get(key, '-')} -> {new.get(key, '-')}"
               for key in sorted(old.keys() | new.keys())
               if key != "reduce_amax" and old.get(key) != new.get(key)]
    return ", ".join(changed) or None


#: The recipe keys that change the scale TE's update computes from a history, not the state's
#: layout: the format's max, the margin, and which amax of the history it takes.
SCALE_KEYS = ("fp8_format", "margin", "amax_compute_algo")


def scale_keys_changed(saved: FP8Recipe | None, run: FP8Recipe | None) -> list[str]:
    """The SCALE_KEYS where the run's recipe computes other scales than the checkpoint's from
    the same histories; none where either is unknown."""
    if saved is None or run is None:
        return []
    return [key for key in SCALE_KEYS if getattr(saved, key) != getattr(run, key)]


def te_scale(amax: torch.Tensor, recipe: FP8Recipe, direction: str,
             kept: torch.Tensor) -> torch.Tensor:
    """TE's delayed-scaling scale for `amax` under `recipe`: `numerics.delayed_scale`, the
    margin applied before the clamp (applied after it, a clamped scale came out 2**-margin too
    small)."""
    fmt = recipe.format_for(direction)  # type: ignore[arg-type]
    return delayed_scale(amax, kept.float(), FP8_MAX[fmt] * 2.0 ** -recipe.margin)


def recomputed_scales(tensors: Mapping[str, torch.Tensor], saved: FP8Recipe, run: FP8Recipe,
                      ) -> dict[str, torch.Tensor]:
    """`tensors` (checked) with the scales `run`'s recipe gives, for a recipe whose format,
    margin or amax_compute_algo changed. TE keeps a loaded scale until its next update, so the
    first step would cast with the old recipe's (HYBRID -> E4M3: gradients scaled for E5M2's
    57344 saturate at E4M3's 448). Under another `fp8_max * 2**-margin` a scale is the same
    amax under the new formula: the ratio of the two is a power of 2, so the product is TE's
    `scaled_max / amax` (a subnormal one, from an amax near 1e38, may be a step off), also
    where that amax has left the window or an overflow's inf sits in it, and float32 max where
    it overflows, as TE clamps. A saved float32 max is TE's clamp,
    not `scaled_max / amax`, so no ratio applies: that scale is the one `te_scale` gives from
    the restored history (the clamped product where the history holds no finite amax), as is
    every scale under another amax_compute_algo. TE's initial 1, where nothing was recorded,
    stays."""
    out = dict(tensors)
    for prefix, direction in (("fwd", "forward"), ("bwd", "backward")):
        scale, history = tensors[f"{prefix}_scale"], tensors[f"{prefix}_amax_history"]
        bounds = [FP8_MAX[r.format_for(direction)] * 2.0 ** -r.margin  # type: ignore[arg-type]
                  for r in (saved, run)]
        initial = (history == 0).all(dim=0) & (scale == 1)
        carried = torch.where(initial, scale, scale * (bounds[1] / bounds[0]))
        carried = carried.clamp(max=FLOAT32_MAX)
        from_history = (torch.ones_like(initial) if saved.amax_compute_algo !=
                        run.amax_compute_algo else scale == FLOAT32_MAX)
        recomputed = te_scale(_amax(history, run.amax_compute_algo), run, direction, carried)
        out[f"{prefix}_scale"] = torch.where(from_history, recomputed, carried)
    return out


def checked_modules(names: Iterable[str], saved: Mapping[str, Mapping[str, torch.Tensor]],
                    saved_with: FP8Recipe | None, run: FP8Recipe | None,
                    named_length: int | None) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                       list[str], list[str]]:
    """`(tensors to write, names beyond repair, problems)` for the saved state of `names`: each
    checked by `check_module` under the recipe its scales were computed with, its scales
    recomputed where the run's recipe changes the scale keys (TE would keep the saved ones until
    its next update). The one sequence fp8_state and `load_fp8_state_dict` both run."""
    checked: dict[str, dict[str, torch.Tensor]] = {}
    fresh: list[str] = []
    problems: list[str] = []
    for name in sorted(names):
        tensors, found = check_module(name, saved[name], saved_with or run,
                                      run.amax_history_len if run is not None else None,
                                      named_length)
        problems += found
        if tensors is not None and scale_keys_changed(saved_with, run):
            assert saved_with is not None and run is not None  # a change needs both
            tensors = recomputed_scales(tensors, saved_with, run)
        if tensors is None:
            fresh.append(name)
        else:
            checked[name] = tensors
    return checked, fresh, problems


def fit_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """TE's `adjust_amax_history_length`: the first `length` rows, zero rows appended."""
    kept = history[:length]
    return torch.nn.functional.pad(kept, (0, 0, 0, length - kept.shape[0]))


def check_module(name: str, tensors: Mapping[str, torch.Tensor], recipe: FP8Recipe | None,
                 length: int | None, named_length: int | None = None,
                 ) -> tuple[dict[str, torch.Tensor] | None, list[str]]:
    """`(tensors to write, problems)` for one module's saved state.

    `recipe`: the one the scales were computed under (the checkpoint's, else the run's; None:
    unknown, then the loosest bound, E5M2's max and no margin); `length`: the history length the
    run's recipe keeps (None: unknown); `named_length`: the saved recipe's length where the
    caller already named the change to `length`, so histories of it are fitted without a
    problem of their own (one of another length still is one). The tensors to write are
    repaired by TE's rules (see the module doc), and None where the module can only start
    fresh. Problems name module and field; none means the state is valid as saved: what TE can
    write, +inf amaxes included.
    """
    problems = [f"{name}.{field}: not a field of FP8 state (expected {', '.join(FIELDS)})"
                for field in tensors if field not in FIELDS]
    out: dict[str, torch.Tensor] = {}
    gemms: dict[str, int] = {}
    for direction, per_gemm in DIRECTIONS.items():
        scale_key, history_key = f"{direction}_scale", f"{direction}_amax_history"
        scale, history = tensors.get(scale_key), tensors.get(history_key)
        shape = _shape_problem(scale, history, per_gemm)
        if shape:
            problems.append(f"{name}.{direction}_{shape[0]}: {shape[1]}")
            return None, problems
        assert scale is not None and history is not None
        gemms[direction] = scale.shape[0] // per_gemm
        out[scale_key], out[history_key] = _check_direction(
            f"{name}.{direction}", scale.float(), history.float(), recipe,
            "forward" if direction == "fwd" else "backward", length, named_length, problems)
    if gemms["fwd"] != gemms["bwd"]:
        problems.append(f"{name}: {gemms['fwd']} forward GEMMs but {gemms['bwd']} backward ones")
        return None, problems
    return out, problems


def _shape_problem(scale: Any, history: Any, per_gemm: int) -> tuple[str, str] | None:
    """`(field, what is wrong)` where the shapes are not TE's, the field `scale` or
    `amax_history`; None where they are."""
    for key, value, dims in (("scale", scale, 1), ("amax_history", history, 2)):
        if not isinstance(value, torch.Tensor):
            return key, "missing" if value is None else "not a tensor"
        if problem := _not_floating(value):
            return key, problem
        if value.dim() != dims:
            return key, f"a {value.dim()}-d tensor, expected a {dims}-d one"
    n = scale.shape[0]
    if n == 0 or n % per_gemm:
        return "scale", f"{n} values, expected {per_gemm} per GEMM"
    if history.shape[1] != n:
        return "amax_history", (f"shape {tuple(history.shape)}, expected [rows, {n}] as the "
                                "scale")
    return None


def _not_floating(value: torch.Tensor) -> str | None:
    """What is wrong with a tensor that cannot hold scales or amaxes, said one way wherever it
    is found (a module's field, a rank's); None for a floating one."""
    return None if value.is_floating_point() else f"a {value.dtype} tensor, expected a floating one"


def _check_direction(where: str, scale: torch.Tensor, history: torch.Tensor,
                     recipe: FP8Recipe | None, direction: str, length: int | None,
                     named_length: int | None, problems: list[str],
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One direction's (scale, history), repaired; problems appended."""
    fmt = (recipe or FP8Recipe()).format_for(direction)  # type: ignore[arg-type]
    margin = 2.0 ** -(recipe.margin if recipe else 0)
    bound = (FP8_MAX[fmt] if recipe else max(FP8_MAX.values())) * margin
    algo = recipe.amax_compute_algo if recipe else "max"
    history = torch.nan_to_num(history, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    if history.shape[0]:
        history[0] = 0.0  # amaxes not used by any update yet: nothing checks them (module doc)
    if length is not None and history.shape[0] not in (0, length):
        if history.shape[0] != named_length:
            problems.append(f"{where}_amax_history: {history.shape[0]} rows do not fit the "
                            f"recipe's {length} (recipe changed?)")
        history = fit_history(history, length)
    # TE's amaxes are reduced with fmaxf, which skips NaN and keeps +inf
    # (transformer_engine/common/util/vectorized_pointwise.h:202, recipe/delayed_scaling.cu:192,
    # 213), so a history holds inf after a step that overflowed, never a negative value.
    bad = history < 0
    if bad.any():
        problems.append(f"{where}_amax_history: {_example(history[bad])} is not an amax TE "
                        "records (>= 0 or inf)")
        history = torch.where(bad, torch.zeros_like(history), history)
    # TE never writes a non-finite scale: it keeps the old one where the amax is not finite and
    # writes float32 max where the division overflows (delayed_scaling.cu:238-249). Without a
    # scale nothing checks the history beside it, and TE's next update would compute the scale
    # from it, a planted amax included: that column starts fresh.
    bad_scale = ~torch.isfinite(scale) | (scale <= 0)
    if bad_scale.any():
        problems.append(f"{where}_scale: {_example(scale[bad_scale])} is not a scale "
                        "(finite, > 0)")
        scale = torch.where(bad_scale, torch.ones_like(scale), scale)
        history = torch.where(bad_scale, torch.zeros_like(history), history)
    amax = _amax(history, algo)
    # an inf amax: TE kept the scale from before it (delayed_scaling.cu:238-242), nothing to check
    contradicted = torch.isfinite(amax) & (amax.double() * scale.double() > bound * (1 + _SLACK))
    if contradicted.any():
        i = int(contradicted.nonzero()[0])
        problems.append(f"{where}_amax_history: amax {amax[i].item():.4g} is more than scale "
                        f"{scale[i].item():.4g} allows (at most {bound / scale[i].item():.4g}: "
                        "the scale was not computed from it)")
        scale = torch.where(contradicted, torch.ones_like(scale), scale)
        history = torch.where(contradicted, torch.zeros_like(history), history)
    return scale, history


def _amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax per column that the last scale update used, as far as the history still holds
    it: the largest past row (`max`), or the last one (`most_recent`); row 0, the amax being
    recorded for the next update, is not in it."""
    past = history[1:]
    if past.shape[0] == 0:
        return torch.zeros(history.shape[1])
    return past[-1] if algo == "most_recent" else past.amax(dim=0)


def _example(values: torch.Tensor) -> str:
    return f"{values.flatten()[0].item():g}"


def combine_ranks(ranks: list[FP8ModuleState]) -> tuple[FP8ModuleState, list[str]]:
    """`(one state, problems)` from several ranks' different ones, as TE's amax reduction would
    have made it: with `reduce_amax` every update sees the max over ranks of each amax, so the
    histories are the elementwise max of the ranks' ones and the scale is the one the largest
    amax gives, the smallest rank's scale. Modules or fields some ranks lack are taken from
    those that have them; NaN and negative values pass through, for `check_module` to find, and
    +inf as TE's reduction keeps it; combined in float32, as `check_module` reads them. A
    field that is not floating point, or whose shape differs from the first rank's holding it
    (no run saves either), is left out of the combination, a problem."""
    combined: FP8ModuleState = {}
    first: dict[tuple[str, str], int] = {}
    problems = []
    for rank, modules in enumerate(ranks):
        for name, tensors in modules.items():
            into = combined.setdefault(name, {})
            for field, value in tensors.items():
                have = into.get(field)
                if problem := _not_floating(value):
                    problems.append(f"ranks[{rank}].{name}.{field}: {problem} (left out)")
                    continue
                value = value.float()
                if have is None:
                    into[field], first[name, field] = value.clone(), rank
                elif have.shape != value.shape:
                    problems.append(f"ranks[{rank}].{name}.{field}: shape {tuple(value.shape)}, "
                                    f"ranks[{first[name, field]}] saved "
                                    f"{tuple(have.shape)} (left out)")
                elif field.endswith("_scale"):
                    into[field] = torch.minimum(have, value)
                else:
                    into[field] = torch.maximum(have, value)
    return combined, problems
