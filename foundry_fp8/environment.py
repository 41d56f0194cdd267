"""Version and capability rules for FP8 training: pure functions over a `Snapshot`.

`foundry-fp8 doctor` gathers the snapshot (foundry_fp8.doctor) and `fp8_lint` calls
`run_environment_findings` with the run's config; both judge it here, so a rule is written once.
Nothing here imports torch or TransformerEngine. The version facts live in
`foundry_fp8.te.facts`; in short:

- FP8 GEMMs need compute capability 8.9+ (`te.facts.environment_problems`, shared with `te_swap`);
  on Ada (8.9) TE also wants torch built for CUDA >= 12.1 (TE `_compute_fp8_support`,
  transformer_engine/pytorch/quantization.py; the same check since TE 1.0 in pytorch/fp8.py).
- pip-installed TE asserts, on `import transformer_engine.pytorch`, that `transformer-engine`,
  `transformer-engine-torch` and `transformer-engine-cu12/cu13` have one version
  (TE `load_framework_extension`, transformer_engine/common/__init__.py).
- TE activation recompute kept wrong backward scales before TE 1.12 (TE issue #1190, fixed by
  TE PR #1254, first released in v1.12).
- Current scaling needs TE >= 2.2 (`te.facts.environment_problems`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from foundry_fp8.lint.rules import (
    Finding,
    LintContext,
    Rule,
    _native_te_layers,
    _section,
    _te_swap,
)
from foundry_fp8.recipe import FP8Recipe, RecipeError, RecipeProblem
from foundry_fp8.te.facts import (
    ADA,
    MIN_CUDA_FOR_ADA_FP8,
    MIN_TE_FOR_RECOMPUTE,
    dotted,
    environment_problems,
    parse_version,
)

NO_GPU = "no GPU: FP8 training needs an H100/Ada; the emulated backend works here"


@dataclass(frozen=True)
class Snapshot:
    """What FP8 training depends on, as found on one machine. None means absent or unknown.

    `te_import_error` is only meaningful when `te_import_checked` (the doctor imports TE in a
    subprocess; the `fp8_lint` callback does not spend that time).
    """

    python: str
    torch: str | None = None
    torch_cuda: str | None = None
    cudnn: str | None = None
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    te: str | None = None
    te_torch: str | None = None
    te_core: str | None = None
    te_core_package: str | None = None
    te_import_checked: bool = False
    te_import_error: str | None = None
    composer: str | None = None
    llmfoundry: str | None = None
    flash_attn: str | None = None
    accelerate: str | None = None
    deepspeed: str | None = None

    @property
    def has_gpu(self) -> bool:
        return self.capability is not None

    @property
    def te_version(self) -> tuple[int, ...] | None:
        return parse_version(self.te)


def context(snapshot: Snapshot, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What environment rules read: the snapshot, and the run's resolved config (or None)."""
    return {"snapshot": snapshot, "config": config}


def _capability_problems(snapshot: Snapshot) -> list[RecipeProblem]:
    return environment_problems(FP8Recipe(), snapshot.capability, None)


def uses_te(config: Mapping[str, Any]) -> bool:
    """Does this run need real TE (TE layers, or te_swap with its default `te` backend)?"""
    swap = _te_swap(config)
    return _native_te_layers(config) or (swap is not None and swap.get("backend") == "te")


def no_gpu(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot = env["snapshot"]
    if not snapshot.has_gpu:
        yield Finding("FP8201", "warning", "gpu", NO_GPU,
                      "train FP8 on an H100/H200 or Ada GPU; here use te_swap: {backend: emulate}")


def gpu_capability(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot = env["snapshot"]
    for problem in _capability_problems(snapshot):
        yield Finding("FP8202", "warning", "gpu", f"{snapshot.gpu_name or 'this GPU'}: "
                      f"{problem.message}", problem.fix)


def ada_cuda(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot = env["snapshot"]
    cuda = parse_version(snapshot.torch_cuda)
    if snapshot.capability is not None and tuple(snapshot.capability) == ADA and cuda \
            and cuda[:2] < MIN_CUDA_FOR_ADA_FP8:
        yield Finding("FP8203", "warning", "torch_cuda",
                      f"TransformerEngine refuses FP8 on Ada ({dotted(ADA)}) when torch is built "
                      f"for CUDA {snapshot.torch_cuda}; it needs CUDA "
                      f"{dotted(MIN_CUDA_FOR_ADA_FP8)} or newer",
                      f"install a torch build for CUDA {dotted(MIN_CUDA_FOR_ADA_FP8)} or newer")


def te_missing(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    """TE absent where it matters: a run that needs it, or a GPU that could run FP8."""
    snapshot, config = env["snapshot"], env["config"]
    if snapshot.te is not None:
        return
    if config is not None:
        yield Finding("FP8204", "warning", "transformer_engine",
                      "this run uses TransformerEngine layers, but TE is not installed",
                      "pip install 'foundry-fp8[te]', or use te_swap: {backend: emulate}")
    elif snapshot.has_gpu and not _capability_problems(snapshot):
        yield Finding("FP8204", "warning", "transformer_engine",
                      "this GPU can run FP8, but TransformerEngine is not installed: only the "
                      "emulated backend works", "pip install 'foundry-fp8[te]'")


def te_packages(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot = env["snapshot"]
    found = {name: v for name, v in (("transformer-engine", snapshot.te),
                                     ("transformer-engine-torch", snapshot.te_torch),
                                     (snapshot.te_core_package, snapshot.te_core))
             if name and v is not None}
    if snapshot.te_torch is not None and len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {v}" for name, v in found.items())
        yield Finding("FP8205", "error", "transformer_engine",
                      f"TransformerEngine packages differ in version ({listed}): "
                      "`import transformer_engine.pytorch` fails TE's version check",
                      "pip install --no-build-isolation 'transformer-engine[pytorch]==VERSION' "
                      "so that all of them have one VERSION")


def te_import(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot = env["snapshot"]
    if snapshot.te is not None and snapshot.te_import_checked and snapshot.te_import_error:
        yield Finding("FP8206", "error", "transformer_engine",
                      f"`import transformer_engine.pytorch` fails: {snapshot.te_import_error}",
                      f"rebuild TE's torch extension against the installed torch "
                      f"{snapshot.torch or '?'} (pip install --no-build-isolation "
                      "'transformer-engine[pytorch]'), or install wheels built for it")


def recompute_te(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot, config = env["snapshot"], env["config"]
    te = snapshot.te_version
    if _section(config, "fsdp_config").get("activation_checkpointing") and te is not None \
            and te < MIN_TE_FOR_RECOMPUTE:
        yield Finding("FP8207", "error", "fsdp_config.activation_checkpointing",
                      f"TransformerEngine {snapshot.te} recomputes FP8 layers with wrong backward "
                      "scales under activation checkpointing (TE issue #1190, fixed in TE "
                      f"{dotted(MIN_TE_FOR_RECOMPUTE)})",
                      f"upgrade TransformerEngine to {dotted(MIN_TE_FOR_RECOMPUTE)} or newer, or "
                      "turn off fsdp_config.activation_checkpointing")


def recipe_te(env: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    snapshot, config = env["snapshot"], env["config"]
    options = _section(_section(config, "algorithms"), "te_swap").get("fp8_recipe")
    if config is None or snapshot.te_version is None or not isinstance(options, Mapping):
        return
    try:
        recipe = FP8Recipe.from_options(options)
    except (RecipeError, TypeError):
        return  # a broken recipe is the linter's FP8008
    for problem in environment_problems(recipe, None, snapshot.te_version):
        yield Finding("FP8208", "error", f"algorithms.te_swap.fp8_recipe.{problem.key}",
                      problem.message, problem.fix)


TE_SRC = "TransformerEngine (NVIDIA/TransformerEngine main, also read at v1.0-v2.18 tags)"

#: Version and capability rules (ids FP82xx). Checks read `context(snapshot, config)`; FP8207 and
#: FP8208 need the run's config and say nothing in `foundry-fp8 doctor`.
ENVIRONMENT_RULES = [
    Rule("FP8201", "warning", "no GPU (FP8 training needs one; the emulated backend works)",
         "FP8 GEMMs run only on GPUs; te_swap's `backend: emulate` gives FP8 numerics anywhere. "
         "An error in `fp8_lint` for a run that asks for TE layers.",
         "foundry_fp8/composer/te_swap.py (_check_te_environment); foundry_fp8/emulate.py",
         "train FP8 on an H100/H200 or Ada GPU; here use te_swap: {backend: emulate}", no_gpu),
    Rule("FP8202", "warning", "GPU compute capability below 8.9",
         "TE refuses FP8 below compute capability 8.9 (Ada); shared with te_swap through "
         "te.facts.environment_problems. An error in `fp8_lint` for a run that asks for TE.",
         f"{TE_SRC} transformer_engine/pytorch/quantization.py _compute_fp8_support "
         "(pytorch/fp8.py before 2.x)",
         "run on Ada/Hopper or newer, or use te_swap: {backend: emulate}", gpu_capability),
    Rule("FP8203", "warning", "Ada GPU with torch built for CUDA older than 12.1",
         "On compute capability 8.9 TE also needs CUDA 12.1+ (and cuBLASLt 12.1.3+) for FP8; "
         "the same check since TE 1.0.",
         f"{TE_SRC} transformer_engine/pytorch/quantization.py _compute_fp8_support",
         "install a torch build for CUDA 12.1 or newer", ada_cuda),
    Rule("FP8204", "warning", "TransformerEngine missing where it is needed",
         "A GPU that can run FP8, or a run with TE layers, without TE: only the emulated "
         "backend works. An error in `fp8_lint` for a run that asks for TE.",
         "setup.cfg extra `te` (transformer-engine[pytorch]>=1.12)",
         "pip install 'foundry-fp8[te]'", te_missing),
    Rule("FP8205", "error", "TransformerEngine pip packages of different versions",
         "On `import transformer_engine.pytorch`, TE asserts that transformer-engine, "
         "transformer-engine-torch and transformer-engine-cu12/cu13 have one version.",
         f"{TE_SRC} transformer_engine/common/__init__.py load_framework_extension",
         "pip install --no-build-isolation 'transformer-engine[pytorch]==VERSION'", te_packages),
    Rule("FP8206", "error", "TransformerEngine's torch extension does not import",
         "TE's torch extension is compiled against one torch; with another torch (or a broken "
         "CUDA setup) `import transformer_engine.pytorch` fails. The doctor imports it in a "
         "subprocess so that a crash cannot take the doctor down; fp8_lint does not import it.",
         f"{TE_SRC} transformer_engine/common/__init__.py load_framework_extension; "
         "transformer_engine/pytorch/__init__.py",
         "rebuild TE against the installed torch (pip install --no-build-isolation "
         "'transformer-engine[pytorch]')", te_import),
    Rule("FP8207", "error", "TransformerEngine older than 1.12 with activation checkpointing",
         "FP8 activation recompute kept wrong backward scales (TE issue #1190); fixed by TE PR "
         "#1254, first released in TE v1.12. Checked by fp8_lint against the installed TE.",
         "https://github.com/NVIDIA/TransformerEngine/issues/1190; "
         "https://github.com/NVIDIA/TransformerEngine/pull/1254 (git tag --contains: v1.12)",
         "upgrade TransformerEngine to 1.12 or newer, or turn off activation checkpointing",
         recompute_te),
    Rule("FP8208", "error", "current scaling with TransformerEngine older than 2.2",
         "TE's Float8CurrentScaling exists from TE 2.2; checked by fp8_lint against the "
         "installed TE (te.facts.environment_problems, shared with te_swap).",
         f"{TE_SRC} transformer_engine/common/recipe/__init__.py (v2.2)",
         "upgrade TransformerEngine or use scaling: delayed", recipe_te),
]


def environment_findings(snapshot: Snapshot,
                         config: Mapping[str, Any] | None = None) -> list[Finding]:
    """Findings for this environment; with a run's `config`, for that run.

    Without a config (the doctor) hardware limits are warnings: the emulated backend runs
    anywhere. With a config, a run that uses only the emulated backend gets nothing, and a run
    that needs real TE gets every finding as an error, since it cannot do what it asks.
    """
    env, lint = context(snapshot, config), LintContext(scope="run")
    findings = [finding for rule in ENVIRONMENT_RULES for finding in rule.check(env, lint)]
    if config is None:
        return findings
    if not uses_te(config):
        return []
    return [replace(f, severity="error") for f in findings]
