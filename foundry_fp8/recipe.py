"""The FP8 recipe a run uses, as users write it in a YAML (`te_swap: {fp8_recipe: {...}}`).

Pure Python, no torch: the linter, the Composer algorithm, the emulated backend and the TE
backend all validate recipes with `recipe_problems`, so a rule is written once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from decimal import Decimal
from enum import Enum
from typing import Any, Literal

Scaling = Literal["delayed", "current"]
FP8Format = Literal["HYBRID", "E4M3"]

#: Composer's default recipe (what every LLM-Foundry YAML run gets today). Our default matches
#: it, so adding `te_swap` never silently changes a run's numerics.
COMPOSER_DEFAULT_HISTORY = 16

#: `Float8CurrentScaling` exists from TE 2.2 (transformer_engine/common/recipe/__init__.py).
#: Its home is here, not in `te.facts` (which builds on this module), so recipe messages can
#: name it; `te.facts` re-exports it with the other TE facts.
MIN_TE_CURRENT_SCALING = (2, 2)
#: How messages write it (`te.facts.dotted`'s form, which this module cannot import).
CURRENT_SCALING_TE = "TE >= " + ".".join(map(str, MIN_TE_CURRENT_SCALING))

#: TE's environment variable for the backward's precision, and the values TE takes (from TE
#: 2.15: `te.facts.TE_BACKWARD_OVERRIDE_FROM`, where what it does is written). Here because a
#: recipe's own `backward_override` key is refused with a message naming it.
BACKWARD_OVERRIDE_ENV = "NVTE_BACKWARD_OVERRIDE"
BACKWARD_OVERRIDE_VALUES = ("high_precision", "dequantized")

#: The FP8 formats' largest finite values and smallest subnormals (OCP FP8 spec; torch's
#: `finfo(float8_e4m3fn).max`, `finfo(float8_e5m2).max`; E4M3: 2**-9, E5M2: 2**-16).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}

#: The largest `margin` whose scale still maps a tensor's amax into E4M3's range (the forward
#: format of every recipe): TE scales by `fp8_max * 2**-margin / amax` in FP32
#: (transformer_engine/common/recipe/delayed_scaling.cu:300 in TE 2.20; TE checks no bound,
#: recipe/__init__.py:253), so once 2**margin > 448 / 2**-9 (margin 18) even the amax is scaled
#: below E4M3's smallest subnormal: all but the largest elements flush to 0 (from margin 19 those
#: too, below half of it); `margin: 100000` makes the FP32
#: scale 0 and the loss NaN from step 1 (issue 19.3).
MAX_MARGIN = int(math.log2(FP8_MAX["e4m3"] / FP8_MIN_SUBNORMAL["e4m3"]))

#: The longest amax history: 64 times TE's default 1024 (recipe/__init__.py:255). TE checks no
#: bound; a window longer than a run is "every step so far", and the history is allocated per
#: tensor at the first FP8 step (10**10 steps: 40 GB each, failing at INIT).
MAX_HISTORY = 65536

#: `Float8CurrentScaling`'s per-tensor quantisation parameters, which TE's Linear/LayerNormLinear/
#: LayerNormMLP read: class attributes without annotations, so not fields and no constructor
#: option (common/recipe/__init__.py:304-306 at d0067d0, 229-231 at v2.2): pydantic dataclasses
#: ignore unknown keywords (`extra` defaults to 'ignore'), so TE drops them silently.
TE_CURRENT_SCALING_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")

#: Keys that TE's `DelayedScaling` used to read and no longer does, with what to do instead.
REMOVED_TE_KEYS: dict[str, str] = {
    "interval": "remove it: TE updates scales every step; it ignores `interval`, with a "
                "deprecation warning from 1.8 and silently from 2.2 (no such field: TE's "
                "pydantic recipes drop unknown keywords)",
    "override_linear_precision": (
        "remove it: TE 2.x dropped `override_linear_precision`; keep a layer out of FP8 "
        "with te_swap's `keep_first_blocks`/`exclude` instead"
    ),
}

#: TE's `DelayedScaling` fields with their defaults (TE 2.20.2,
#: transformer_engine/common/recipe/__init__.py:253-260, less the environment-set
#: `backward_override`): what a Composer `precision_config` means by a key it leaves out.
TE_DELAYED_DEFAULTS: dict[str, Any] = {
    "margin": 0, "fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max",
    "scaling_factor_compute_algo": None, "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False,
}

#: TE 2.20's recipes that are not per-tensor FP8 scaling (transformer_engine/common/recipe/
#: __init__.py:337, 392, 489, 630), by the names a user may write for `scaling`: foundry-fp8
#: models neither their numerics nor their state, so naming one is refused, never replaced.
UNSUPPORTED_TE_RECIPES: dict[str, str] = {
    **dict.fromkeys(("mxfp8", "mxfp8blockscaling", "mxfp8_block_scaling"), "MXFP8BlockScaling"),
    **dict.fromkeys(("block", "blockwise", "float8blockscaling", "fp8_block_scaling"),
                    "Float8BlockScaling"),
    **dict.fromkeys(("nvfp4", "fp4", "nvfp4blockscaling", "nvfp4_block_scaling"),
                    "NVFP4BlockScaling"),
    **dict.fromkeys(("custom", "customrecipe"), "CustomRecipe"),
}


def unsupported_recipe_problem(name: str) -> RecipeProblem:
    """The one line for a TE recipe foundry-fp8 does not model (`UNSUPPORTED_TE_RECIPES`)."""
    return RecipeProblem(
        "scaling", f"TransformerEngine's {name} is not supported: foundry-fp8 models per-tensor "
        "FP8 scaling only (TE's DelayedScaling and Float8CurrentScaling), and would not run "
        "another recipe in its place",
        "use scaling: delayed or scaling: current, or run TE's own recipe without te_swap")


#: The recipe keys only delayed scaling reads (current scaling refuses them: FP8008); also
#: named by the health rules' amax-spike change.
DELAYED_ONLY = ("amax_history_len", "amax_compute_algo", "margin", "reduce_amax")
_CURRENT_ONLY = ("use_power_2_scales",)


@dataclass(frozen=True)
class RecipeProblem:
    """One thing wrong with a recipe: the key it is about, what is wrong, and the fix."""

    key: str
    message: str
    fix: str


class RecipeError(ValueError):
    """A recipe that cannot be used; the message is one line and names the key."""

    def __init__(self, problem: RecipeProblem):
        self.problem = problem
        super().__init__(f"fp8_recipe.{problem.key}: {problem.message} (fix: {problem.fix})")


@dataclass(frozen=True)
class FP8Recipe:
    """How FP8 scaling factors are chosen.

    `delayed`: scale from the max (or most recent) amax of the last `amax_history_len` steps,
    as TE's `DelayedScaling`. `current`: scale from this tensor's own amax, as TE's
    `Float8CurrentScaling` (from TE MIN_TE_CURRENT_SCALING); keeps no history.
    HYBRID means E4M3 for forward tensors (activations, weights) and E5M2 for gradients.
    Checks itself as `from_options` checks a YAML mapping (`recipe_problems`): an option of
    the other mode, which neither TE nor the emulation would read, is refused.
    """

    scaling: Scaling = "delayed"
    fp8_format: FP8Format = "HYBRID"
    amax_history_len: int = COMPOSER_DEFAULT_HISTORY
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    reduce_amax: bool = True
    use_power_2_scales: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8_format", fp8_format_name(self.fp8_format))
        problems = recipe_problems(self._given())
        if problems:
            raise RecipeError(problems[0])
        for name in ("amax_history_len", "margin"):  # a numpy integer as the int it is
            object.__setattr__(self, name, int(getattr(self, name)))

    def _given(self) -> dict[str, Any]:
        """The options as the constructor got them, for `recipe_problems` to judge as it judges
        a YAML mapping: the other scaling mode's keys only where they differ from their
        defaults (value or type), since a default passed cannot be told from one filled in.
        `as_config()` leaves those keys out: judging it let `use_power_2_scales=True` pass
        under delayed scaling, ignored."""
        other = DELAYED_ONLY if _mode(self.scaling) == "current" else _CURRENT_ONLY
        given = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in other or type(value) is not type(f.default) or value != f.default:
                given[f.name] = value
        return given

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> FP8Recipe:
        """Build from YAML options, raising `RecipeError` on the first problem."""
        options = dict(options or {})
        problems = recipe_problems(options)
        if problems:
            raise RecipeError(problems[0])
        return cls(**{k: v for k, v in options.items() if k in _KNOWN_KEYS})

    def format_for(self, direction: Literal["forward", "backward"]) -> Literal["e4m3", "e5m2"]:
        """The FP8 format of forward tensors or of gradients under this recipe."""
        if direction == "backward" and self.fp8_format == "HYBRID":
            return "e5m2"
        return "e4m3"

    def as_config(self) -> dict[str, Any]:
        """The keys that matter for this scaling mode, for run configs and coverage tables (the
        others hold their defaults)."""
        skip = _CURRENT_ONLY if self.scaling == "delayed" else DELAYED_ONLY
        return {k: v for k, v in asdict(self).items() if k not in skip}


_KNOWN_KEYS = frozenset(f.name for f in fields(FP8Recipe))
#: Options TE 2.20's `DelayedScaling`/`Float8CurrentScaling` take that FP8Recipe does not model
#: (transformer_engine/common/recipe/__init__.py:253-261, 302-312): named as TE's, not unknown.
_TE_ONLY_KEYS = (frozenset(TE_DELAYED_DEFAULTS) - _KNOWN_KEYS) | {
    "backward_override", "fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"}
#: Of those, the ones a recipe may still write at TE's own default, per scaling mode (a recipe
#: copied from TE often spells its defaults out): `fp8_dpa`/`fp8_mha` are False in both
#: recipes, `scaling_factor_compute_algo` None in DelayedScaling only (TE 2.20,
#: transformer_engine/common/recipe/__init__.py:257-260, 310-311). They change nothing TE does.
_TE_DEFAULTS_ACCEPTED: dict[str, tuple[str, ...]] = {
    "delayed": ("fp8_dpa", "fp8_mha", "scaling_factor_compute_algo"),
    "current": ("fp8_dpa", "fp8_mha"),
}


def _te_defaults_accepted(scaling: Any) -> tuple[str, ...]:
    return _TE_DEFAULTS_ACCEPTED.get(scaling, ()) if isinstance(scaling, str) else ()


def _is_te_default(key: str, value: Any, scaling: Any) -> bool:
    """Whether `key: value` is one of TE's options we do not model, left at TE's default."""
    default = TE_DELAYED_DEFAULTS.get(key)
    return (key in _te_defaults_accepted(scaling) and type(value) is type(default)
            and value == default)


def _yaml(value: Any) -> str:
    """A default as a YAML user writes it."""
    return "null" if value is None else str(value).lower()


def fp8_format_name(value: Any) -> str:
    """An FP8 format's name however it is written: TE's `Format.HYBRID` (an Enum member),
    "HYBRID", "hybrid" or "Format.HYBRID" are all "HYBRID"."""
    if isinstance(value, Enum):
        return value.name
    return (value if isinstance(value, str) else _shown(value)).upper().removeprefix("FORMAT.")


def is_same_delayed_recipe(precision_config: Mapping[str, Any], recipe: FP8Recipe) -> bool:
    """Whether `DelayedScaling(**precision_config)` (how Composer reads it) means `recipe`.

    Compared on meaning, not spelling: keys left out take TE's defaults (`TE_DELAYED_DEFAULTS`)
    and `fp8_format` is compared by name. A key DelayedScaling lacks never matches, nor does a
    value `recipe` cannot hold (`fp8_dpa: true`, a callable `amax_compute_algo`).
    """
    if recipe.scaling != "delayed":
        return False
    given = {**TE_DELAYED_DEFAULTS, **precision_config}
    given["fp8_format"] = fp8_format_name(given["fp8_format"])
    ours = {k: v for k, v in recipe.as_config().items() if k in TE_DELAYED_DEFAULTS}
    return given == {**TE_DELAYED_DEFAULTS, **ours}


def run_fp8_recipe(swap: FP8Recipe | None, precision: str | None,
                   precision_config: Mapping[str, Any] | None) -> FP8Recipe | None:
    """The FP8 recipe a run's FP8 modules follow: te_swap's (`swap`); else, under `amp_fp8`,
    the `DelayedScaling` Composer builds (its `precision_config`, or Composer 0.32's default,
    `core/precision.py`: HYBRID, 16 steps of history, max); None where neither is known.
    Torch-free, so the linter reads a YAML's run as the runtime reads a built one."""
    if swap is not None:
        return swap
    if precision != "amp_fp8":
        return None
    if precision_config is None:
        return FP8Recipe(amax_history_len=COMPOSER_DEFAULT_HISTORY, amax_compute_algo="max")
    given = {**TE_DELAYED_DEFAULTS, **precision_config}
    try:
        return FP8Recipe(fp8_format=fp8_format_name(given["fp8_format"]),
                         **{k: given[k] for k in ("amax_history_len", "amax_compute_algo",
                                                  "margin", "reduce_amax")})
    except (TypeError, ValueError):  # a callable amax_compute_algo, ...: not one we can read
        return None


def step0_scaling(run: FP8Recipe | None, what_if: FP8Recipe | None) -> Scaling | None:
    """The scaling fp8_stats judges a fresh run's step 0 under: the run's own recipe
    (`run_fp8_recipe`), else fp8_stats' what-if `recipe` (the casts it computes for layers not
    in FP8). fp8_stats at FIT_START and the linter's FP8058 both ask here, so they agree."""
    recipe = run or what_if
    return None if recipe is None else recipe.scaling


def _is_int(value: Any) -> bool:
    """An integer however written (a numpy integer from a Python caller too), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _mode(value: Any) -> str:
    """A choice's value for comparing with its names: "" for a non-string (an array's `==`
    is elementwise, and `in` on it raises)."""
    return value if isinstance(value, str) else ""


def _article(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _shown(value: Any) -> str:
    """`value` as a message shows it. An integer past 20 digits is named by its digit count,
    counted without `str` (a 4300-digit one makes `repr` raise: sys.get_int_max_str_digits)."""
    if _is_int(value) and not -10**20 < value < 10**20:
        whole = abs(int(value))
        digits = max(1, whole.bit_length() * 30103 // 100000)  # log10(2): within 1 below
        while 10**digits <= whole:
            digits += 1
        return f"a {'negative ' if value < 0 else ''}{digits}-digit integer"
    try:
        return repr(value)
    except ValueError:  # a Fraction or Decimal too long to print
        return f"{_article(type(value).__name__)} too long to print"


def _margin_why(margin: Any) -> str:
    """Why a margin is refused, by what it is: the bound it crosses, or the type. Judged
    exactly (never through `float`, which overflows on 10**400). TE's recipes declare
    `margin: int` in pydantic dataclasses (common/recipe/__init__.py:12, 253 at d0067d0), and
    TE pins no pydantic (setup.py:123 at d0067d0, 95 at v2.2): pydantic 2 turns 2.0 into 2 and
    refuses 2.5, NaN and inf; pydantic 1 truncates 2.5 to 2 (its int_validator is `int(v)`)."""
    name = type(margin).__name__
    if margin is None:
        return "null, not a number"
    if isinstance(margin, bool) or not isinstance(margin, numbers.Number):
        return f"{_article(name)}, not a number"
    if not isinstance(margin, (numbers.Real, Decimal)):
        return f"{_article(name)}, not a real number"
    if _is_int(margin):
        top, bottom = int(margin), 1
    else:
        ratio = getattr(margin, "as_integer_ratio", None)
        if ratio is None:
            return f"{_article(name)}, a number foundry-fp8 cannot read exactly"
        try:
            top, bottom = ratio()
        except (ValueError, ArithmeticError):  # NaN; infinities (OverflowError)
            return "not a finite number"
    if bottom != 1:
        return ("a fraction: TransformerEngine's recipes declare margin an int, which pydantic "
                f"2 refuses and pydantic 1 truncates to {_shown(int(margin))}")
    if top < 0:
        return "a negative margin scales the amax above E4M3's max: the largest elements saturate"
    if top > MAX_MARGIN:
        return ("a larger margin scales even the amax below E4M3's smallest subnormal: the "
                "tensor flushes to 0")
    return f"{_article(name)}: write {top}"


def recipe_problems(options: Mapping[str, Any]) -> list[RecipeProblem]:
    """Every problem with a recipe mapping (empty when it is usable). Never raises."""
    if not isinstance(options, Mapping):
        return [RecipeProblem("", f"must be a mapping, got {type(options).__name__}",
                              "write fp8_recipe as a mapping, e.g. {scaling: delayed}")]
    problems: list[RecipeProblem] = []
    scaling = options.get("scaling", "delayed")
    for key in options:
        key = key if isinstance(key, str) else _shown(key)
        if key in REMOVED_TE_KEYS:
            problems.append(RecipeProblem(key, "TransformerEngine no longer uses this key",
                                          REMOVED_TE_KEYS[key]))
        elif key == "backward_override":
            problems.append(RecipeProblem(
                key, f"TransformerEngine takes it from {BACKWARD_OVERRIDE_ENV} (te_swap builds "
                "TE's recipe without it, and the emulated backend reads the variable too)",
                f"remove it and set {BACKWARD_OVERRIDE_ENV}="
                f"{'|'.join(BACKWARD_OVERRIDE_VALUES)} in the environment, with scaling: current"))
        elif key in TE_CURRENT_SCALING_QPARAMS:
            problems.append(RecipeProblem(
                key, "a class attribute of TransformerEngine's Float8CurrentScaling, not an "
                "option a recipe can set (TE's constructor ignores it, as its pydantic recipes "
                "do every unknown keyword)",
                "remove it; for power-of-2 scales write use_power_2_scales: true with "
                "scaling: current"))
        elif key in _TE_ONLY_KEYS:
            if _is_te_default(key, options[key], scaling):
                continue
            default = (f" (TE's default, {_yaml(TE_DELAYED_DEFAULTS[key])}, is accepted)"
                       if key in _te_defaults_accepted(scaling) else "")
            problems.append(RecipeProblem(
                key, "a TransformerEngine recipe option that foundry-fp8 does not support (it "
                "models TE's linear-layer FP8 casts and scales only)",
                f"remove it{default}; the supported keys are: {', '.join(sorted(_KNOWN_KEYS))}"))
        elif key not in _KNOWN_KEYS:
            problems.append(RecipeProblem(
                key, "unknown recipe key", f"use one of: {', '.join(sorted(_KNOWN_KEYS))}"))

    block = UNSUPPORTED_TE_RECIPES.get(scaling.lower()) if isinstance(scaling, str) else None
    if block is not None:
        problems.append(unsupported_recipe_problem(block))
    elif _mode(scaling) not in ("delayed", "current"):
        problems.append(RecipeProblem(
            "scaling", f"unknown scaling {_shown(scaling)}",
            "use 'delayed' (TE DelayedScaling) or 'current' (TE Float8CurrentScaling, "
            f"{CURRENT_SCALING_TE})"))

    fmt = fp8_format_name(options.get("fp8_format", "HYBRID"))
    if fmt == "E5M2":
        problems.append(RecipeProblem(
            "fp8_format", "pure E5M2 training is not supported by TransformerEngine",
            "use HYBRID (E4M3 forward, E5M2 gradients) or E4M3"))
    elif fmt not in ("HYBRID", "E4M3"):
        problems.append(RecipeProblem("fp8_format", f"unknown FP8 format {fmt!r}",
                                      "use HYBRID or E4M3"))

    history = options.get("amax_history_len", COMPOSER_DEFAULT_HISTORY)
    if not _is_int(history) or not 1 <= history <= MAX_HISTORY:
        problems.append(RecipeProblem(
            "amax_history_len",
            f"must be an integer from 1 to {MAX_HISTORY}, got {_shown(history)}",
            "e.g. 16 (Composer's default) or 1024 (TE's default)"))
    algo = options.get("amax_compute_algo", "max")
    if callable(algo):  # TE then runs its unfused Python update (quantization.py:687-691)
        problems.append(RecipeProblem(
            "amax_compute_algo", "a callable makes TransformerEngine update scales with its "
            "unfused Python path, which foundry-fp8 does not model", "use 'max' or 'most_recent'"))
    elif _mode(algo) not in ("max", "most_recent"):
        problems.append(RecipeProblem("amax_compute_algo", f"unknown algorithm {_shown(algo)}",
                                      "use 'max' or 'most_recent'"))
    margin = options.get("margin", 0)
    if not _is_int(margin) or not 0 <= margin <= MAX_MARGIN:
        problems.append(RecipeProblem(
            "margin", f"must be an integer from 0 to {MAX_MARGIN}, got {_shown(margin)} "
            f"({_margin_why(margin)})", "use 0 unless you see overflows"))
    for flag in ("reduce_amax", "use_power_2_scales"):
        if flag in options and not isinstance(options[flag], bool):
            problems.append(RecipeProblem(
                flag, f"must be true or false, got {_shown(options[flag])}",
                f"write {flag}: true or {flag}: false"))

    if _mode(scaling) == "current":
        for key in DELAYED_ONLY:
            if key in options:
                problems.append(RecipeProblem(
                    key, "only applies to delayed scaling; current scaling keeps no amax history",
                    f"remove {key}, or use scaling: delayed"))
    elif _mode(scaling) == "delayed":
        for key in _CURRENT_ONLY:
            if key in options:
                problems.append(RecipeProblem(key, "only applies to current scaling",
                                              f"remove {key}, or use scaling: current"))
    return problems


#: What TE's autocast runs under when given no recipe on Hopper: `DelayedScaling()`
#: (pytorch/quantization.py:242-254 in TE 2.20), with its 1024-step history, not Composer's 16.
TE_DEFAULT_RECIPE = FP8Recipe(**{k: v for k, v in TE_DELAYED_DEFAULTS.items() if k in _KNOWN_KEYS})
