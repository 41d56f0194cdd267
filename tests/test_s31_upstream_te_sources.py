"""Our TE facts and te.backend's recipes against the installed TE's own Python sources, read
without loading TE's libraries: its recipe classes (transformer_engine/common/recipe/
__init__.py, plain Python on pydantic) and its import-time cuDNN floor (common/__init__.py,
with TE's own build switch NVTE_PROJECT_BUILDING, l. 488 in 2.20.2, which skips the loading).
So they run wherever TE's files are installed, a GPU-less machine with a broken torch
extension included. Skipped where TE is absent (CI).

Run on 2026-12-01 (PYTHONPATH holding the files, with a dist-info for the version) against the
newest releases, the 2.20.2 wheel (PyPI's newest) and the 2.19.0 wheel (the newest the `te`
extra takes), and the tags at our version thresholds, v1.12, v2.2, v2.8, v2.15, v2.16,
v2.16.1, v2.17, v2.17.1 and v2.18: all pass (v1.12: its delayed scaling; it has no current
scaling). Each threshold moved by one release (TE_MIN_CUDNN_FROM to 2.19,
POWER_2_SCALES_ENV_FROM to 2.9, TE_BACKWARD_OVERRIDE_FROM to 2.16, 2.17.1 out of
TE_PICKLE_GUARD_FIXES) fails against its tag."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import pytest

from foundry_fp8 import FP8Recipe
from foundry_fp8.recipe import (
    REMOVED_TE_KEYS,
    TE_CURRENT_SCALING_QPARAMS,
    TE_DELAYED_DEFAULTS,
    RecipeError,
)
from foundry_fp8.te import backend, probe
from foundry_fp8.te.facts import (
    POWER_2_SCALES_ENV,
    POWER_2_SCALES_ENV_FROM,
    TE_BACKWARD_OVERRIDE_FROM,
    TE_MIN_CUDNN,
    TE_MIN_CUDNN_FROM,
    backward_override_problems,
)

BACKWARD_OVERRIDE = "NVTE_BACKWARD_OVERRIDE"


def _te_folder() -> Path:
    spec = importlib.util.find_spec("transformer_engine")  # imports nothing of TE
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TransformerEngine's sources are not installed")
    if probe.te_version() is None:
        pytest.skip("TransformerEngine has no package metadata: its version is unknown")
    return Path(next(iter(spec.submodule_search_locations)))


def _execute(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The file at `path` run as module `name`, in sys.modules for this test (dataclasses
    resolve a class's annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def te_recipes(monkeypatch) -> Callable[..., types.ModuleType]:
    """`load(**env)`: TE's recipe module executed afresh under `env` (TE reads its variables in
    the class bodies, once, at import) and installed as `transformer_engine.common.recipe`, where
    te.backend imports it; parents stand-ins, so TE's libraries stay unloaded."""
    folder = _te_folder()

    def load(**env: str | None) -> types.ModuleType:
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        recipe = _execute("transformer_engine.common.recipe",
                          folder / "common" / "recipe" / "__init__.py", monkeypatch)
        root, common = (types.ModuleType(n) for n in ("transformer_engine",
                                                     "transformer_engine.common"))
        root.common, common.recipe = common, recipe
        for module in (root, common):  # found as packages (probe.te_available's find_spec)
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None,
                                                             is_package=True)
            monkeypatch.setitem(sys.modules, module.__name__, module)
        return recipe

    return load


def _defaults(cls: type) -> dict:
    return {f.name: f.default.name if isinstance(f.default, Enum) else f.default
            for f in dataclasses.fields(cls)}


def test_composers_missing_keys_mean_tes_delayed_defaults(te_recipes):
    """recipe.TE_DELAYED_DEFAULTS are TE's DelayedScaling defaults (common/recipe/__init__.py:
    253-260 in 2.20.2); TE's other fields are the environment-read `backward_override` (l. 261,
    from TE 2.15) and, in TE 1.x, the keys recipe.REMOVED_TE_KEYS refuses. The recipe
    te.backend builds from ours carries our values in TE's own fields."""
    recipe = te_recipes(**{BACKWARD_OVERRIDE: None})
    defaults = _defaults(recipe.DelayedScaling)
    assert {k: defaults.get(k) for k in TE_DELAYED_DEFAULTS} == TE_DELAYED_DEFAULTS
    others = set(defaults) - set(TE_DELAYED_DEFAULTS) - set(REMOVED_TE_KEYS)
    assert others == ({"backward_override"} if probe.te_version() >= TE_BACKWARD_OVERRIDE_FROM
                      else set())

    ours = FP8Recipe(fp8_format="E4M3", amax_history_len=16, amax_compute_algo="most_recent",
                     margin=2, reduce_amax=False)
    built = backend.to_te_recipe(ours)
    assert type(built) is recipe.DelayedScaling and built.fp8_format is recipe.Format.E4M3
    assert (built.amax_history_len, built.amax_compute_algo, built.margin, built.reduce_amax) == (
        16, "most_recent", 2, False)


def _current_scaling(recipe: types.ModuleType) -> type:
    cls = getattr(recipe, "Float8CurrentScaling", None)
    if cls is None:
        pytest.skip(f"TransformerEngine {probe.te_version()} has no current scaling")
    return cls


@pytest.mark.parametrize("env", [None, "0", "1", "true"])
@pytest.mark.parametrize("power_2", [False, True])
def test_current_scalings_power_of_2_reaches_tes_quantizer_params(te_recipes, env, power_2):
    """TE's te.Linear reads power-of-2 from Float8CurrentScaling's class-level QParams, fixed at
    import from NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES == "1" (l. 302-306 in 2.20.2): the
    recipe te.backend builds carries the recipe's own choice in all three, leaves TE's class
    (every other recipe) as the variable set it, and the one-line warning names the
    disagreement exactly where there is one."""
    recipe = te_recipes(**{POWER_2_SCALES_ENV: env, BACKWARD_OVERRIDE: None})
    cls = _current_scaling(recipe)
    reads_env = probe.te_version() >= POWER_2_SCALES_ENV_FROM  # TE 2.2-2.7 never read it
    by_env = reads_env and env == "1"
    ours = FP8Recipe(scaling="current", use_power_2_scales=power_2)
    built = backend.to_te_recipe(ours)
    assert type(built) is cls
    if "use_power_2_scales" in {f.name for f in dataclasses.fields(cls)}:  # TE >= 2.8
        assert cls().use_power_2_scales is by_env and built.use_power_2_scales is power_2
    for name in TE_CURRENT_SCALING_QPARAMS:
        assert getattr(built, name).power_2_scale is power_2
        assert getattr(cls, name).power_2_scale is by_env  # TE's class untouched
    conflict = backend.power_2_env_conflict(ours, probe.te_version())
    assert (conflict is not None) == (reads_env and env is not None and by_env != power_2)


@pytest.mark.parametrize("value", [None, "high_precision", "dequantized", "bogus", ""])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_tes_recipes_refuse_the_backward_override_where_the_facts_say(te_recipes, value,
                                                                      scaling):
    """te.facts' verdict on NVTE_BACKWARD_OVERRIDE is TE's own: its recipes assert the value
    (and DelayedScaling that it is unset) in `__post_init__` (l. 262-270, 314-318 in 2.20.2),
    which pydantic raises as a ValueError; te.backend says it in one line naming the variable
    instead."""
    recipe = te_recipes(**{BACKWARD_OVERRIDE: value})
    cls = recipe.DelayedScaling if scaling == "delayed" else _current_scaling(recipe)
    refused = bool(backward_override_problems(value, probe.te_version(), scaling))
    try:
        cls()
        te_refuses = False
    except ValueError:  # pydantic's ValidationError
        te_refuses = True
    assert te_refuses is refused
    if refused:
        with pytest.raises(RecipeError, match=BACKWARD_OVERRIDE):
            backend.to_te_recipe(FP8Recipe(scaling=scaling))
    else:
        assert type(backend.to_te_recipe(FP8Recipe(scaling=scaling))) is cls


def test_tes_cudnn_floor_is_the_facts(monkeypatch):
    """TE refuses, at import, a cuDNN older than MIN_CUDNN_VERSION from TE_MIN_CUDNN_FROM on
    (common/__init__.py:24, 35-42 in 2.20.2; no such check in 2.19.0, the newest the `te`
    extra takes), in the words the doctor's FP8206 reads."""
    from tests.test_env25_te_mixes import CUDNN

    folder = _te_folder()
    monkeypatch.setenv("NVTE_PROJECT_BUILDING", "1")  # TE's own switch: load no library
    monkeypatch.delenv("NVTE_RELEASE_BUILD", raising=False)
    common = _execute("_te_common_source", folder / "common" / "__init__.py", monkeypatch)
    checks = hasattr(common, "check_cudnn_version")
    assert checks is (probe.te_version() >= TE_MIN_CUDNN_FROM)
    if not checks:
        return
    assert common.MIN_CUDNN_VERSION[:2] == TE_MIN_CUDNN
    with pytest.raises(RuntimeError) as refused:
        common.check_cudnn_version(90501)  # torch 2.7's nvidia-cudnn-cu12 9.5.1.17
    assert f"{type(refused.value).__name__}: {refused.value}" == CUDNN


def test_our_inert_extra_state_is_what_tes_pickle_guard_ignores(te_recipes, monkeypatch):
    """TE's pickle guard (pytorch/_extra_state.py, from 2.16.1, 2.17.1 and 2.18: exactly the
    releases `refuses_pickled_extra_state` names) ignores the pickled `None` fp8_state saves in
    `_extra_state` (l. 113-187 in 2.20.2: no global, no delayed-scaling key), and refuses TE's
    own delayed-scaling state (`get_extra_state`'s dict, module/base.py:1396-1405), which
    `holds_te_scaling_state` finds by the key TE's guard reads too (l. 25-30); a current-scaling
    state it ignores, and so do we."""
    import pickle

    import torch

    from foundry_fp8.te.extra_state import holds_te_scaling_state, inert_extra_state
    from foundry_fp8.te.facts import refuses_pickled_extra_state

    guard_file = _te_folder() / "pytorch" / "_extra_state.py"  # before te_recipes' stand-ins
    recipe = te_recipes(**{BACKWARD_OVERRIDE: None})
    assert guard_file.exists() is refuses_pickled_extra_state(probe.te_version())
    if not guard_file.exists():
        return
    guard = _execute("transformer_engine.pytorch._extra_state", guard_file, monkeypatch)
    assert guard.UNSAFE_PICKLE_EXTRA_STATE_ENV == "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    ignore, unsafe = (guard._PickledExtraStateAction.IGNORE,
                      guard._PickledExtraStateAction.UNSAFE_LOAD)

    def state(te_recipe: object, **tensors: torch.Tensor) -> torch.Tensor:
        saved = {"recipe": te_recipe, **tensors, "extra_fp8_variables": {"num_gemms": 1}}
        return torch.frombuffer(bytearray(pickle.dumps(saved)), dtype=torch.uint8)

    delayed = state(recipe.DelayedScaling(), scale_fwd=torch.ones(3),
                    amax_history_fwd=torch.zeros(4, 3), scale_bwd=torch.ones(2),
                    amax_history_bwd=torch.zeros(4, 2))
    current = state(_current_scaling(recipe)())
    for tensor, verdict, ours in ((inert_extra_state(), ignore, False), (delayed, unsafe, True),
                                  (current, ignore, False)):
        assert guard._classify_extra_state_pickle(tensor.numpy().tobytes()) is verdict
        assert holds_te_scaling_state({"layer._extra_state": tensor}) is ours
