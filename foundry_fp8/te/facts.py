"""Every TransformerEngine, CUDA and GPU version fact we rely on, LLM-Foundry's init of TE
modules included, with where it was read, and what they mean for a recipe
(`environment_problems`). Pure Python: no torch, no TE. The backend, te_swap's plan, the linter's
rules, the doctor and `fp8_state` read these names, so a fact is written once.
"""

from __future__ import annotations

from foundry_fp8.recipe import (
    BACKWARD_OVERRIDE_ENV,
    BACKWARD_OVERRIDE_VALUES,
    MIN_TE_CURRENT_SCALING,
    FP8Recipe,
    RecipeProblem,
)

#: Read by TE >= 2.8 at import as Float8CurrentScaling's `use_power_2_scales` default, on
#: exactly "1" (transformer_engine/common/recipe/__init__.py:230 at v2.8, 302 at d0067d0).
POWER_2_SCALES_ENV = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
#: The first TE that reads POWER_2_SCALES_ENV: TE 2.2-2.7 never read it (no mention in
#: transformer_engine/ at v2.7).
POWER_2_SCALES_ENV_FROM = (2, 8)

Version = tuple[int, ...]

#: The oldest TE whose module arguments and FP8 state layout the backend was checked against;
#: also the first TE whose activation recompute keeps FP8 scales right (TE issue #1190, fixed by
#: TE PR #1254, first released in v1.12).
MIN_TE = (1, 12)
MIN_TE_FOR_RECOMPUTE = (1, 12)

#: `Float8CurrentScaling`'s first TE: `recipe.MIN_TE_CURRENT_SCALING` (imported above), whose
#: own messages name it.

#: TE's debug features (`transformer_engine/debug/`) exist from TE 2.4, but up to 2.6
#: `LogFp8TensorStats` supports only `underflows%` (its `_get_supported_stats_list`, v2.6
#: debug/features/log_fp8_tensor_stats.py:86-88; any other stat fails an assert in the forward);
#: the statistics `te_debug` asks for (`overflows%`, `scale_inv_*`, `mse`, recipe-prefixed
#: what-ifs) from TE 2.7.
MIN_TE_DEBUG_STATS = (2, 7)

#: The first TE whose `import transformer_engine` itself compares the metapackage's version with
#: the core package's, with or without the torch extension (sanity_checks_for_pypi_installation,
#: transformer_engine/common/__init__.py:195-212 at v2.9-v2.18 and main d0067d0, 197-214 in the
#: 2.19.0 wheel, 249-266 in the 2.20.2 wheel); before, only load_framework_extension compared them.
TE_CORE_CHECK = (2, 9)

#: The cuDNN TE's torch extension needs from TE 2.20: loading it raises "Transformer Engine
#: requires cuDNN 9.12.0 or later, but the cuDNN runtime is X." (TE 2.20.2
#: transformer_engine/common/__init__.py:22-24 MIN_CUDNN_VERSION, :35-42, called at :220-221);
#: no such check at v2.18, in the 2.19.0 wheel (the newest the `te` extra takes) nor main
#: d0067d0 (2.20.0.dev0). torch 2.7.0 pins nvidia-cudnn-cu12==9.5.1.17 (its Requires-Dist).
TE_MIN_CUDNN: Version = (9, 12)
TE_MIN_CUDNN_FROM: Version = (2, 20)

#: MXFP8 runs on compute capability MXFP8_CAPABILITY[0] up to, not including, [1] (TE's
#: `_compute_mxfp8_support`, pytorch/quantization.py:162-168 at v2.18 and in 2.20.2;
#: pytorch/fp8.py:47-53 at v2.6, the first tag refusing 12.0+ "MXFP8 (for all gemm layouts) is
#: not supported on 12.0+ architectures yet"; v2.0-v2.5 take 10.0 and above).
MXFP8_CAPABILITY: tuple[Version, Version] = ((10, 0), (12, 0))
MXFP8_CAPABILITY_CAPPED_FROM = (2, 6)

#: From TE 2.9 its GEMM checks an FP8 operand's leading dim (the inner dim of a TN GEMM) for
#: 16 and stops with this message (CanonicalizeGemmInput, common/gemm/cublaslt_gemm.cu:146-148
#: and :227-229 at v2.9, :160-162 and :251-253 at v2.18; no such check at v2.8).
TE_GEMM_LEADING_DIM_FROM = (2, 9)
TE_GEMM_LEADING_DIM_ERROR = "Leading dimension requirement on A for FP8 GEMM. Caller must pad."

#: The newest TE release whose Python sources foundry-fp8's TE facts were checked against (the
#: 2.20.2 wheel, tests/test_s31_upstream_te_sources.py): te_swap's `backend: te`, fp8_state and
#: fp8_guard read TE internals (fp8_meta, `_extra_state`, the autocast state) a later minor
#: release may change (doctor FP8217).
TE_NEWEST_READ: Version = (2, 20, 2)

#: `te.LayerNorm` became a `te.ops` op in TE 1.13, taking `normalized_shape`/`dtype`; TE 1.12's
#: takes `hidden_size`/`params_dtype`.
TE_LAYERNORM_AS_OP = (1, 13)

#: TE's LayerNormMLP casts fc2's output gradient with scale slot GRAD_OUTPUT1 (0) up to TE 2.3
#: and GRAD_OUTPUT2 (2) from TE 2.4 (pytorch/module/layernorm_mlp.py).
TE_LN_MLP_GRAD_OUTPUT2 = (2, 4)

#: The first TE that warns "Recipe type changed" where a layer's recipe changes class (its
#: `init_fp8_metadata`, pytorch/module/base.py:935-944 at v2.4; none at v2.3): older TE, from
#: MIN_TE_CURRENT_SCALING on, switches the layer to the new recipe's fresh state silently.
TE_RECIPE_CHANGE_WARNING_FROM = (2, 4)

# TE's `set_extra_state` skips an empty `_extra_state` tensor from TE 2.4 on; older TE fails to
# unpickle one, while a pickled `None` loads as "no state" on every TE from 1.12 to 2.20: so
# `te.extra_state` saves a pickled `None` (a rule for our checkpoints, no version check).

#: TE releases that refuse to unpickle a delayed-scaling `_extra_state` unless
#: NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is exactly "1" (pytorch/_extra_state.py): 2.16.1,
#: 2.17.1 and everything from 2.18 (2.16.0 and 2.17.0 have no such guard).
TE_PICKLE_GUARD_FIXES = ((2, 16, 1), (2, 17, 1))
TE_PICKLE_GUARD_FROM = (2, 18)

#: NVTE_BACKWARD_OVERRIDE, read from TE 2.15 (PR #2644, commit fdf9fb16; first tag v2.15; older
#: TE ignores it): the default of every recipe class's `backward_override` field, read once when
#: TE is imported (`os.getenv` in the class body, transformer_engine/common/recipe/__init__.py:219
#: and 270 at v2.15, 261 and 312 at release_v2.19 and main d0067d0). Unset (None) or one of
#: BACKWARD_OVERRIDE_VALUES, else every recipe's `__post_init__` assertion fails (an empty value
#: too); `DelayedScaling` asserts it is None (l. 226-228 at v2.15, 268-270 at main, 264-270 in
#: the 2.20.2 wheel), so with it set a delayed-scaling recipe, TE's default one included, cannot
#: be built. TE's recipes are pydantic dataclasses, which report a failed `__post_init__` assert
#: as pydantic's ValidationError (a ValueError: "Assertion failed, Delayed scaling only supports
#: backward_override=None."; pydantic 2.11.7, the GPU kit's, and 2.14), not AssertionError. Under
#: current scaling a te.Linear's backward runs unquantized (`ctx.fp8 = False`, no gradient cast,
#: pytorch/module/linear.py:554-564 at v2.15): dgrad multiplies the gradient by the weight as
#: stored (`high_precision`) or by its FP8 copy dequantized to the activation dtype
#: (`dequantized`, l. 804-812), wgrad by the input cast to the activation dtype
#: (`high_precision` saves the original input, l. 141-142) or its FP8 copy dequantized (l. 722-
#: 727). te.LayerNormMLP refuses it (an assert in its forward, module/layernorm_mlp.py:246-250).
#: The variable's name and values are `recipe.BACKWARD_OVERRIDE_ENV`/`BACKWARD_OVERRIDE_VALUES`
#: (imported above), whose recipe messages name them.
TE_BACKWARD_OVERRIDE_FROM = (2, 15)

#: FP8 GEMMs need Ada/Hopper (compute capability 8.9) or newer; on Ada (8.9) TE also wants torch
#: built for CUDA >= 12.1 (TE `_compute_fp8_support`, pytorch/quantization.py; the same check
#: since TE 1.0 in pytorch/fp8.py).
MIN_FP8_CAPABILITY = (8, 9)
ADA = (8, 9)
MIN_CUDA_FOR_ADA_FP8 = (12, 1)


def parse_version(text: str | None) -> Version | None:
    """Leading numeric release of a version string ('2.7.0+cu126' -> (2, 7, 0)); None if none."""
    if not text:
        return None
    numbers: list[int] = []
    for part in str(text).split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):  # '0rc1', '1a0': a pre-release tail ends the release
            break
    return tuple(numbers) or None


def dotted(version: Version | None) -> str:
    """(2, 20, 2) -> '2.20.2'; '?' when unknown. The one version formatter."""
    return ".".join(map(str, version)) if version else "?"


#: How to install a TE te_swap's `backend: te` takes, for fix messages: foundry-fp8 is not on
#: PyPI, so `pip install 'foundry-fp8[te]'` would find nothing (or another's package). TE's own
#: install line (its README): the torch extension builds against the installed torch, hence
#: --no-build-isolation. Below TE_MIN_CUDNN_FROM: that TE refuses, at import, the cuDNN torch 2.7
#: (setup.cfg's torch) pins, so `import llmfoundry` fails with it. The same bounds as
#: setup.cfg's extra `te` (test_lint_install_hint).
TE_REQUIREMENT = f"transformer-engine[pytorch]>={dotted(MIN_TE)},<{dotted(TE_MIN_CUDNN_FROM)}"
TE_INSTALL_HINT = f'pip install --no-build-isolation "{TE_REQUIREMENT}"'


def refuses_pickled_extra_state(version: Version) -> bool:
    """Whether this TE refuses its own pickled delayed-scaling `_extra_state` by default."""
    version = tuple(version)
    return version >= TE_PICKLE_GUARD_FROM or any(
        version[:2] == fix[:2] and version >= fix for fix in TE_PICKLE_GUARD_FIXES)


def ln_mlp_grad_slot(version: Version | None) -> int | None:
    """fc2's grad-output scale slot in TE's LayerNormMLP for this TE (None: TE unknown)."""
    if version is None:
        return None
    return 2 if tuple(version) >= TE_LN_MLP_GRAD_OUTPUT2 else 0


def environment_problems(recipe: FP8Recipe, capability: tuple[int, int] | None,
                         te_version: Version | None) -> list[RecipeProblem]:
    """Problems running `recipe` on a GPU of `capability` with TE `te_version` (None: absent)."""
    problems = []
    if capability is not None and tuple(capability) < MIN_FP8_CAPABILITY:
        problems.append(RecipeProblem(
            "scaling", f"FP8 needs compute capability {dotted(MIN_FP8_CAPABILITY)}+, this GPU "
                       f"has {dotted(tuple(capability))}",
            "run on Ada/Hopper or newer, or use te_swap: {backend: emulate} for FP8 numerics"))
    if recipe.scaling == "current" and te_version is not None \
            and tuple(te_version) < MIN_TE_CURRENT_SCALING:
        problems.append(RecipeProblem(
            "scaling", f"current scaling needs TransformerEngine >= "
                       f"{dotted(MIN_TE_CURRENT_SCALING)}, found {dotted(tuple(te_version))}",
            "upgrade TransformerEngine or use scaling: delayed"))
    return problems


#: LLM-Foundry's `te_layernorm_mlp_init` runs `module.fc2_weight.div_(div_is_residual)` with no
#: `div_is_residual` in scope (it takes `**kwargs` and deletes them), so initialising any
#: te.LayerNormMLP raises NameError. Every init scheme but `default_` reaches it through
#: `generic_param_init_fn_`. Introduced by the param-init registry (PR #1096, commit 676ad7f9,
#: first released in 0.8.0); unchanged in every release up to 0.22.0 (0.21.0's and 0.22.0's
#: wheels: line 466) and on main (8c8dd48f, 0.22.0.dev0): no release fixes it.
TE_LN_MLP_INIT_FAILS_FROM: Version = (0, 8, 0)
TE_LN_MLP_INIT_SOURCE = "llmfoundry/models/utils/param_init_fns.py:466 in 0.21.0-0.22.0"
#: MPT's init schemes (`model.init_config.name`) that skip the module init functions: `default_`
#: only calls each module's reset_parameters (param_init_fns.py torch_default_param_init_fn_).
INIT_SCHEMES_WITHOUT_MODULE_INITS = frozenset({"default_"})
#: `init_config_defaults['name']` (llmfoundry/models/utils/config_defaults.py).
MPT_DEFAULT_INIT_SCHEME = "kaiming_normal_"


def te_ln_mlp_init_fails(llmfoundry: str | None) -> bool | None:
    """Whether this LLM-Foundry raises NameError initialising a te.LayerNormMLP (None: unknown)."""
    version = parse_version(llmfoundry)
    return None if version is None else version >= TE_LN_MLP_INIT_FAILS_FROM


def backward_override_problems(value: str | None, te_version: Version | None,
                               scaling: str | None = None) -> list[RecipeProblem]:
    """What NVTE_BACKWARD_OVERRIDE=`value` breaks with TE `te_version` (None: unknown or absent,
    judged as TE from TE_BACKWARD_OVERRIDE_FROM, which the emulation models) for a recipe of
    `scaling` (None: any recipe, as the doctor judges a machine)."""
    if value is None or (te_version is not None
                         and tuple(te_version) < TE_BACKWARD_OVERRIDE_FROM):
        return []
    if value not in BACKWARD_OVERRIDE_VALUES:
        return [RecipeProblem(
            "backward_override", f"{BACKWARD_OVERRIDE_ENV}={value!r} is refused by "
            f"TransformerEngine >= {dotted(TE_BACKWARD_OVERRIDE_FROM)}: building any FP8 recipe "
            "fails ('Assertion failed' in a pydantic ValidationError)",
            f"unset {BACKWARD_OVERRIDE_ENV} or set it to {' or '.join(BACKWARD_OVERRIDE_VALUES)}")]
    if scaling == "current":
        return []
    return [RecipeProblem(
        "backward_override", f"{BACKWARD_OVERRIDE_ENV}={value!r} applies to current scaling only:"
        f" TransformerEngine >= {dotted(TE_BACKWARD_OVERRIDE_FROM)} refuses to build a "
        "DelayedScaling recipe ('Assertion failed' in a pydantic ValidationError), te_swap's "
        "default and TE's own default recipe included",
        f"use fp8_recipe: {{scaling: current}}, or unset {BACKWARD_OVERRIDE_ENV}")]


def backward_override_effect(value: str, te_version: Version | None) -> str:
    """What NVTE_BACKWARD_OVERRIDE=`value` does with TE `te_version` (None: TE absent or its
    version unknown), in words for the doctor."""
    since = dotted(TE_BACKWARD_OVERRIDE_FROM)
    te = "TransformerEngine " + (f">= {since}" if te_version is None
                                 else dotted(tuple(te_version)))
    if te_version is not None and tuple(te_version) < TE_BACKWARD_OVERRIDE_FROM:
        return f"ignored by {te} (read from {since}); the emulated backend reads it"
    if value not in BACKWARD_OVERRIDE_VALUES:
        return f"refused by {te} and the emulated backend: any FP8 recipe raises (it takes " \
            f"{' or '.join(BACKWARD_OVERRIDE_VALUES)})"
    operands = ("the weight and input as stored" if value == "high_precision"
                else "the weight and input's FP8 copies, dequantized")
    return (f"read by {te} and the emulated backend: current scaling's backward without FP8 "
            f"(gradients not cast; dgrad and wgrad from {operands}); delayed scaling and "
            "te.LayerNormMLP refuse it")


#: te.LayerNormMLP's parameters and the MPT block parameters each is made from (the block's
#: names; TE 1.12-2.20 register these in pytorch/module/layernorm_mlp.py, `register_parameter`).
LN_MLP_SOURCES = {"layer_norm_weight": "norm_2.weight", "layer_norm_bias": "norm_2.bias",
                  "fc1_weight": "ffn.up_proj.weight", "fc1_bias": "ffn.up_proj.bias",
                  "fc2_weight": "ffn.down_proj.weight", "fc2_bias": "ffn.down_proj.bias"}


#: te.LayerNormMLP's keywords under which its parameters are an MPT block's norm_2 + GELU MLP:
#: TE's defaults (`LayerNormMLP.__init__`, pytorch/module/layernorm_mlp.py:1276-1286 at v1.12,
#: 1956-1967 at v2.18, 1957-1980 in 2.20.2, the same signature in 2.18-2.20.2), `normalization`
#: and `activation` replaced by the block's (LN_MLP_NORMALIZATIONS; `swap.te_activation`: gelu
#: or relu).
#: LLM-Foundry's own `ffn_type: te_ln_mlp` passes the rest of `ffn_config` to TE
#: (llmfoundry/models/layers/ffn.py `build_te_ln_mlp`, 0.21-0.22), so its checkpoint may differ.
PLAIN_LN_MLP = {"activation": "gelu", "normalization": "LayerNorm", "zero_centered_gamma": False}

#: te.LayerNormMLP's `normalization`s, the same in every TE 1.12-2.20.2 (`assert normalization in
#: ["LayerNorm", "RMSNorm"]`, layernorm_mlp.py:1299 at v1.12, 1984 at v2.18, 1997 in 2.20.2):
#: LayerNorm `(x - E[x]) / sqrt(Var[x] + eps) * gamma + beta`, RMSNorm
#: `x / sqrt(mean(x^2) + eps) * gamma` with no `layer_norm_bias` (l. 253-259 at v2.18; formulas:
#: pytorch/module/layernorm.py:22-23, rmsnorm.py:23-29 at v2.18); `zero_centered_gamma` (False
#: here) puts `(1 + gamma)` in gamma's place (layernorm_mlp.py docstring, l. 1872-1878 at v2.18).
LN_MLP_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
