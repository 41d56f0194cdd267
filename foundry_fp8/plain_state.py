"""FP8 scaling state for a plain PyTorch loop (`convert_to_fp8`, no Composer): `model.state_dict()`
holds none of it (emulated layers keep their delayed scales and amax histories outside it, and
`convert_to_fp8` leaves TE's `_extra_state` out, `swap._save_plain`), so a resume from model and
optimizer state alone starts every scale at 1 and every history at zero, another run.

`fp8_state_dict` saves it in `fp8_state`'s layout (tensors and plain values: `torch.load(...,
weights_only=True)` reads it back) and `load_fp8_state_dict` checks it as `fp8_state` does
(`foundry_fp8.restore`) before anything is written (`fp8_meta.write_fp8_meta`): a bad one is
refused in one line naming module and field, the model's state left as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta, write_fp8_meta
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.restore import (
    StateProblems,
    checked_modules,
    combine_ranks,
    payload_problem,
    recipe_change,
    saved_recipe,
)
from foundry_fp8.te import backend as te_backend

log = logging.getLogger(__name__)

_WHO = "load_fp8_state_dict"


def fp8_state_dict(model: nn.Module, *, recipe: FP8Recipe | None = None) -> dict[str, Any]:
    """`{"recipe": ..., "modules": {canonical name: scales and amax histories}}` (copies on the
    CPU), to save beside `model.state_dict()`. `recipe`: the one the FP8 autocast runs
    (`fp8_autocast(recipe=...)`, or te.autocast's as an FP8Recipe), recorded so a resume under
    another is refused; None records none (scales then checked against the loosest bound). A TE
    module before its first FP8 forward (or under current scaling) holds no state: its entry is
    empty, so a resume still knows it as one of the FP8 modules and has nothing to restore."""
    return {"recipe": recipe.as_config() if recipe is not None else None,
            "modules": {name: read_fp8_meta(module) for name, module in fp8_modules(model)}}


def load_fp8_state_dict(model: nn.Module, state: Mapping[str, Any], *,
                        recipe: FP8Recipe | None = None, strict: bool = True) -> None:
    """Write `fp8_state_dict`'s state (or an `fp8_state` checkpoint entry) into `model`, after
    `model.load_state_dict` and before the first resumed forward.

    Checked first, all modules before any is written: poisoned scales (NaN, inf, <= 0),
    histories the scales contradict or of another length, wrong shapes, FP8 modules missing on
    either side, a recipe other than `recipe` (the run's; None: the saved one's is taken as the
    run's). `strict`: raise ValueError, one line naming module and field, writing nothing;
    otherwise repair by TE's rules (`foundry_fp8.restore`), restore the modules on both sides,
    and log a warning per kind of repair. TE modules hold no state before their first FP8 forward: call this
    inside TE's autocast then, which creates it as that forward would."""
    if problem := payload_problem(state):
        raise ValueError(f"{_WHO}: not FP8 state as fp8_state_dict saves it ({problem})")
    if state.get("unsaved"):
        raise ValueError(f"{_WHO}: the checkpoint holds no FP8 state (reading it failed when "
                         "it was saved)")
    try:
        saved_with = saved_recipe(state)
    except StateProblems as error:
        raise ValueError(f"{_WHO}: {error}") from None
    run = recipe or saved_with
    saved, problems = (combine_ranks(state["ranks"]) if "ranks" in state
                       else (dict(state.get("modules", {})), []))
    if saved_with is None and run is not None and run.scaling != "delayed" and any(
            v.numel() for t in saved.values() for k, v in t.items() if k.endswith("_history")):
        _refuse(strict, "the saved state records no recipe and holds delayed-scaling amax "
                        f"histories; this recipe ({run.as_config()}) keeps none", "nothing restored")
        return
    change = recipe_change(saved_with, run)
    if change:
        assert saved_with is not None and run is not None  # a change needs both
        other_scaling = saved_with.scaling != run.scaling
        _refuse(strict, f"recipe changed: {change}", "FP8 scaling fresh" if other_scaling
                else "the saved state fitted to this recipe, as fp8_state does")
        if other_scaling:
            return
    modules = dict(fp8_modules(model))
    missing, unexpected = sorted(modules.keys() - saved.keys()), sorted(saved.keys() - modules)
    if missing or unexpected:
        _refuse(strict, f"the model's FP8 modules are not the saved ones: {len(missing)} without "
                        f"saved state{_named(missing)}; {len(unexpected)} saved, not in the "
                        f"model{_named(unexpected)}", "the modules in both restored")
    named_length = saved_with.amax_history_len if change and saved_with is not None else None
    checked, _, found = checked_modules((n for n in modules.keys() & saved.keys() if saved[n]),
                                        saved, saved_with, run, named_length)
    problems += found
    if problems:
        _refuse(strict, f"refused: {StateProblems(problems)}", "it repaired by TE's rules")
    for name, tensors in list(checked.items()):
        if not _has_state(name, modules[name], tensors, strict):
            del checked[name]
            continue
        try:
            write_fp8_meta(modules[name], tensors, check_only=True)
        except ValueError as error:
            _refuse(strict, f"does not fit the model (recipe changed?): {name}.{error}",
                    "that module fresh")
            del checked[name]
    for name, tensors in checked.items():
        write_fp8_meta(modules[name], tensors)


def _has_state(name: str, module: nn.Module, tensors: Mapping[str, torch.Tensor],
               strict: bool) -> bool:
    """Whether `module` holds scaling state to write into: a TE module gets it here inside TE's
    FP8 autocast (`te_backend.init_fp8_state`, as its first FP8 forward would)."""
    if read_fp8_meta(module) or te_backend.init_fp8_state(
            module, num_gemms=len(tensors["fwd_scale"]) // 3) and read_fp8_meta(module):
        return True
    _refuse(strict, f"{name}: a TE module holds no FP8 state before its first FP8 forward: call "
                    "load_fp8_state_dict inside TE's autocast", "that module fresh")
    return False


def _named(names: list[str]) -> str:
    return f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""


def _refuse(strict: bool, message: str, outcome: str) -> None:
    """Raise under `strict`, else say what `strict=False` continues with."""
    if strict:
        raise ValueError(f"{_WHO}: {message} (strict=False: {outcome})")
    log.warning("%s: %s; continuing with %s", _WHO, message, outcome)
