"""Version and capability rules (FP82xx) over a `foundry_fp8.environment.Snapshot`, with or
without a run's config. `foundry-fp8 doctor` judges the machine alone; `fp8_lint` judges the
run's config on the machine it runs on. Facts, with where they were read:

- FP8 GEMMs need compute capability 8.9+ (`te.facts.environment_problems`, shared with `te_swap`);
  on Ada (8.9) TE also wants torch built for CUDA >= 12.1 (TE `_compute_fp8_support`,
  transformer_engine/pytorch/quantization.py; the same check since TE 1.0 in pytorch/fp8.py).
- torch's CPU build (`cuda = None` in torch/version.py) cannot use a GPU nvidia-smi lists, and
  TE's torch extension is a CUDAExtension (TE build_tools/pytorch.py): FP8212.
- pip-installed TE asserts, on `import transformer_engine.pytorch`, that `transformer-engine`,
  `transformer-engine-torch` and `transformer-engine-cu12/cu13` have one version
  (TE `load_framework_extension`, transformer_engine/common/__init__.py).
- TE activation recompute kept wrong backward scales before `MIN_TE_FOR_RECOMPUTE` (TE issue
  #1190, fixed by TE PR #1254).
- Current scaling needs TE >= `MIN_TE_CURRENT_SCALING` (`te.facts.environment_problems`).
- NVTE_BACKWARD_OVERRIDE: from TE `TE_BACKWARD_OVERRIDE_FROM` a value TE does not take, or any
  value with delayed scaling, fails building the recipe (`te.facts.backward_override_problems`).
- Composer from `AUTO_MICROBATCH_CHECKED_FROM` with a torch outside `UNSHARD_WITH_SYNC_TORCH`
  cannot auto micro-batch under FSDP (`foundry_fp8.lint.known`, shared with the config rule
  FP8031).

- torch, Composer and LLM-Foundry must be installed, within the ranges the installed foundry-fp8
  requires (setup.cfg's install_requires, read back from its package metadata): FP8214.
- flash-attn that is installed but does not import after torch (the doctor's probe) is absent
  to LLM-Foundry, which says nothing: FP8216.
- A folder that shadows one of them (`Snapshot.shadowed`) is what runs: its installed version,
  and for torch the CUDA build read from the shadow, are judged by no rule but FP8215.

The TE version facts themselves live in `foundry_fp8.te.facts`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from foundry_fp8.environment import CUDNN_PACKAGES, STACK, UNVERSIONED, Snapshot
from foundry_fp8.lint.config import has_fp8_layers, native_te_layers, te_swap, uses_te
from foundry_fp8.lint.known import (
    AUTO_MICROBATCH_SOURCE,
    UNSHARD_TORCH_RANGE,
    auto_microbatch_fsdp_fails,
)
from foundry_fp8.lint.registry import Finding, Hit, LintContext, rule, run_rules, section
from foundry_fp8.packages import Requirement, parse_requirement
from foundry_fp8.recipe import FP8Recipe, RecipeError, RecipeProblem
from foundry_fp8.te.facts import (
    ADA,
    BACKWARD_OVERRIDE_ENV,
    BACKWARD_OVERRIDE_VALUES,
    MIN_CUDA_FOR_ADA_FP8,
    MIN_FP8_CAPABILITY,
    MIN_TE,
    MIN_TE_CURRENT_SCALING,
    MIN_TE_FOR_RECOMPUTE,
    TE_BACKWARD_OVERRIDE_FROM,
    TE_CORE_CHECK,
    TE_INSTALL_HINT,
    TE_MIN_CUDNN,
    TE_MIN_CUDNN_FROM,
    TE_NEWEST_READ,
    TE_REQUIREMENT,
    backward_override_problems,
    dotted,
    environment_problems,
    parse_version,
)

NO_GPU = "no GPU: FP8 training needs an H100/Ada; the emulated backend works here"
DRIVER_FIX = ("fix the NVIDIA driver until `nvidia-smi` lists the GPU (the message says what it "
              "did); meanwhile use te_swap: {backend: emulate}")
#: The start of a fix that names torch's CUDA build (FP8203, FP8212): the CUDA follows.
TORCH_FOR_CUDA = "install a torch build for CUDA"
#: That fix bounded by the driver (FP8212, FP8213).
TORCH_FOR_DRIVER = f"{TORCH_FOR_CUDA} the driver supports (nvidia-smi's `CUDA Version` or older)"
TE_SRC = "TransformerEngine (NVIDIA/TransformerEngine main, also read at v1.0-v2.18 tags)"


@dataclass(frozen=True)
class Environment:
    """What environment rules read: the snapshot, and the run's resolved config (or None).
    `pinned`: the snapshot holds only the TE an MCLI run config pins (`foundry-fp8 lint`), not
    a machine's."""

    snapshot: Snapshot
    config: Mapping[str, Any] | None = None
    pinned: bool = False


#: The emulated backend's fix for a run whose model builds TE layers itself (fc_type te,
#: te_ln_mlp): those need TE whatever te_swap's backend, so te_swap alone cannot emulate them.
NATIVE_TE_FIX = ("here set model.fc_type: torch (ffn_type: mptmlp for te_ln_mlp) and use "
                 "te_swap: {backend: emulate}, which emulates FP8 in the linears it converts")


def _shadow(snapshot: Snapshot, field: str) -> str | None:
    """The folder Python imports `field`'s package from where it shadows the installed
    distribution (`Snapshot.shadowed`), else None. Its installed version then says nothing of
    what runs, nor, for torch, the CUDA build read from the shadow's torch/version.py (none in
    a source tree: a GPU node's torch looked like a CPU build), so rules do not judge them."""
    return dict(snapshot.shadowed).get(field)


def judged_version(snapshot: Snapshot, field: str) -> str | None:
    """`field`'s installed version as the rules judge it: none (unknown) where a folder shadows
    it (`_shadow`), as for torch's CUDA build (`_torch_cuda`)."""
    return None if _shadow(snapshot, field) else getattr(snapshot, field)


def what_runs(snapshot: Snapshot, field: str) -> str:
    """`field` as a message names what runs: its installed version, the folder shadowing it, or
    that it is not installed."""
    if (folder := _shadow(snapshot, field)) is not None:
        return f"from the folder {folder} (it shadows the installed {getattr(snapshot, field)})"
    return getattr(snapshot, field) or "not installed"


def _torch_cuda(snapshot: Snapshot) -> tuple[int, ...] | None:
    """torch's CUDA version as the rules judge it: none where a folder shadows the installed
    torch (`_shadow`), whose version.py says nothing of the build that runs."""
    return None if _shadow(snapshot, "torch") else parse_version(snapshot.torch_cuda)


def _run_fix(env: Environment, fix: str) -> str | None:
    """`fix` for a run whose model builds its own TE layers; None (the rule's) otherwise."""
    return fix if env.config is not None and native_te_layers(env.config) else None


def _capability_problems(snapshot: Snapshot) -> list[RecipeProblem]:
    return environment_problems(FP8Recipe(), snapshot.capability, None)


@rule("FP8201", "warning", "no GPU found (FP8 training needs one; the emulated backend works)",
      why="FP8 GEMMs run only on GPUs; te_swap's `backend: emulate` gives FP8 numerics "
      "anywhere. No nvidia-smi, or one that lists no GPU, means no GPU; an nvidia-smi that timed "
      "out, failed or printed no GPU (or a torch.cuda that raised) is named in the message, as "
      "a driver problem to fix. An error in `fp8_lint` for a run that asks for TE layers.",
      source="foundry_fp8/composer/te_swap.py (_check_te_environment); foundry_fp8/emulate.py; "
      "foundry_fp8/environment.py (_gpu_from_nvidia_smi)",
      fix="train FP8 on an H100/H200 or Ada GPU; here use te_swap: {backend: emulate}",
      family="environment")
def no_gpu(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    if snapshot.has_gpu:
        return
    if snapshot.gpu_hidden:
        yield Hit("gpu", f"no GPU visible to CUDA: {snapshot.gpu_error}, so torch and TE see "
                  "none", fix="unset CUDA_VISIBLE_DEVICES, or list the GPUs to train on in it "
                  "(CUDA_VISIBLE_DEVICES=0)")
    elif snapshot.gpu_error:
        yield Hit("gpu", f"no GPU found: {snapshot.gpu_error}; if this machine has a GPU, its "
                  "driver needs fixing (the emulated backend works meanwhile)", fix=DRIVER_FIX)
    elif breaks_every_run(snapshot):
        yield Hit("gpu", "no GPU: FP8 training needs an H100/Ada; the emulated backend works "
                  "here once TransformerEngine imports or is uninstalled (FP8206)",
                  fix=_run_fix(env, "train FP8 on an H100/H200 or Ada GPU; " + NATIVE_TE_FIX))
    else:
        yield Hit("gpu", NO_GPU, fix=_run_fix(env, "train FP8 on an H100/H200 or Ada GPU; "
                                              + NATIVE_TE_FIX))


@rule("FP8202", "warning", f"GPU compute capability below {dotted(MIN_FP8_CAPABILITY)}",
      why=f"TE refuses FP8 below compute capability {dotted(MIN_FP8_CAPABILITY)} (Ada); shared "
      "with te_swap through "
      "te.facts.environment_problems. An error in `fp8_lint` for a run that asks for TE.",
      source=f"{TE_SRC} transformer_engine/pytorch/quantization.py _compute_fp8_support "
      "(pytorch/fp8.py before 2.x)",
      fix="run on Ada/Hopper or newer, or use te_swap: {backend: emulate}", family="environment")
def gpu_capability(env: Environment, _: LintContext) -> Iterator[Hit]:
    for problem in _capability_problems(env.snapshot):
        yield Hit("gpu", f"{env.snapshot.gpu_name or 'this GPU'}: {problem.message}",
                  fix=problem.fix)


@rule("FP8203", "warning", "Ada GPU with torch built for CUDA older than "
      f"{dotted(MIN_CUDA_FOR_ADA_FP8)}",
      why=f"On compute capability {dotted(ADA)} TE also needs CUDA {dotted(MIN_CUDA_FOR_ADA_FP8)}+ "
      "(and cuBLASLt 12.1.3+) for FP8; the same check since TE 1.0.",
      source=f"{TE_SRC} transformer_engine/pytorch/quantization.py _compute_fp8_support",
      fix=f"{TORCH_FOR_CUDA} {dotted(MIN_CUDA_FOR_ADA_FP8)} or newer", family="environment")
def ada_cuda(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    cuda = _torch_cuda(snapshot)
    if snapshot.capability is not None and tuple(snapshot.capability) == ADA and cuda \
            and cuda[:2] < MIN_CUDA_FOR_ADA_FP8:
        yield Hit("torch_cuda", f"TransformerEngine refuses FP8 on Ada ({dotted(ADA)}) when torch "
                  f"is built for CUDA {snapshot.torch_cuda}; it needs CUDA "
                  f"{dotted(MIN_CUDA_FOR_ADA_FP8)} or newer")


@rule("FP8204", "warning", "TransformerEngine missing or unusable where it is needed (absent, "
      "without its torch extension, older than te_swap's floor)",
      why="A GPU that can run FP8, or a run with TE layers, without a TE that imports: only the "
      "emulated backend works. `pip install transformer-engine` without `[pytorch]` installs a "
      "metapackage with no core library and no torch extension, and `transformer-engine[core]` "
      "the core library alone: `import transformer_engine.pytorch` fails for both, and with "
      "torch installed `import llmfoundry` with it (an error: no run starts, BF16 included). A "
      "TE older than te_swap's floor stops te_swap's `backend: te` at the run's start (the "
      "doctor's check, and `foundry-fp8 lint`'s on the TE an MCLI run config pins). An error "
      "in `fp8_lint` for a run that asks for TE.",
      source=f"setup.cfg extra `te` ({TE_REQUIREMENT}); TE 2.20.2 "
      "transformer_engine/common/__init__.py:154-156, 267-275",
      fix=f"{TE_INSTALL_HINT}, or use te_swap: {{backend: emulate}}",
      family="environment")
def te_missing(env: Environment, _: LintContext) -> Iterator[Hit]:
    """TE absent where it matters: a run that needs it, or a GPU that could run FP8; on a
    pinned TE, only what a run that uses TE would meet."""
    snapshot = env.snapshot
    if env.pinned and not uses_te(env.config or {}):
        return
    te = snapshot.te_version
    swap = te_swap(env.config or {})
    swaps_to_te = swap is not None and swap.get("backend") == "te"
    if (env.config is None or (env.pinned and swaps_to_te)) and te is not None and te < MIN_TE:
        yield Hit("transformer_engine", f"TransformerEngine {snapshot.te} is older than "
                  f"{dotted(MIN_TE)}, the oldest te_swap's `backend: te` takes: te_swap stops "
                  "such a run at its start (its `backend: emulate` works)",
                  fix=f"{TE_INSTALL_HINT}, or use te_swap: {{backend: emulate}}")
    if snapshot.te is not None and snapshot.te_pure_wheel and snapshot.te_torch is None \
            and (snapshot.te_core is None or snapshot.torch is not None):
        yield _no_torch_extension(snapshot)
    if snapshot.te is not None or env.pinned:  # a pin of TE's parts alone: TE may be elsewhere
        return
    if env.config is not None:
        yield Hit("transformer_engine", "this run uses TransformerEngine layers, but TE is not "
                  "installed", fix=_run_fix(env, f"{TE_INSTALL_HINT}, or "
                                            + NATIVE_TE_FIX))
    elif snapshot.has_gpu and not _capability_problems(snapshot):
        yield Hit("transformer_engine", "this GPU can run FP8, but TransformerEngine is not "
                  "installed: only the emulated backend works")


def _no_torch_extension(snapshot: Snapshot) -> Hit:
    """TE from PyPI without `[pytorch]`: the metapackage alone, or with its core package
    (`transformer-engine[core]`). `import transformer_engine.pytorch` raises: for the metapackage
    alone from TE 2.9 "Found empty `transformer-engine` meta package installed" (TE 2.20.2
    transformer_engine/common/__init__.py:267-275), with the core package FileNotFoundError
    "Could not find shared object file for Transformer Engine torch lib." (:154-156, from
    load_framework_extension :215). With torch installed `import llmfoundry` raises it too
    (`breaks_every_run`), so no run starts: an error."""
    if snapshot.te_core is None:
        what = ("is its metapackage alone (`pip install transformer-engine` without `[pytorch]`): "
                "no core library and no torch extension, so `import transformer_engine.pytorch` "
                "fails (from TE 2.9: 'Found empty `transformer-engine` meta package installed')")
    else:
        what = (f"has its core library ({snapshot.te_core_package} {snapshot.te_core}) but no "
                "torch extension (`transformer-engine[core]` without `[pytorch]`), so `import "
                "transformer_engine.pytorch` fails ('Could not find shared object file for "
                "Transformer Engine torch lib.')")
    every = ("; with torch installed `import llmfoundry` fails with it (its hf_checkpointer "
             "catches only ModuleNotFoundError): no training starts here, BF16 and the emulated "
             "backend included") if snapshot.torch is not None else ""
    return Hit("transformer_engine", f"TransformerEngine {snapshot.te} {what}{every}",
               severity="error" if snapshot.torch is not None else None,
               fix=_install_torch_extension(snapshot))


def _install_torch_extension(snapshot: Snapshot) -> str:
    """TE's own install line for its torch extension at the installed version (from 2.9 it
    pulls the core package for torch's CUDA major: TE 2.20.2 pytorch/setup.py:170-173)."""
    return f"pip install --no-build-isolation 'transformer-engine[pytorch]=={snapshot.te}'"


@rule("FP8205", "error", "TransformerEngine pip packages of different versions, the torch "
      "extension without the core package, or a core package for another CUDA than torch's",
      why="On `import transformer_engine.pytorch`, TE asserts that transformer-engine, "
      "transformer-engine-torch and transformer-engine-cu12/cu13 are all installed and have one "
      "version (read from package metadata, so also with `--no-te-import`); the metapackage's "
      "and the core package's wheels both carry TE's Python files (whichever was installed "
      "last runs), so either's version can be the one that checks. The core package must be "
      "built for torch's CUDA major: the torch extension requires transformer-engine-cu{torch's "
      "major} (from TE 2.9), and the cu13 core library needs libcudart.so.13 and "
      "libcublas.so.13, which torch for CUDA 12 does not bring (a warning where TE imported "
      "all the same, through a CUDA on the loader path).",
      source=f"{TE_SRC} transformer_engine/common/__init__.py load_framework_extension (TE "
      "2.20.2 :192-212), sanity_checks_for_pypi_installation (:249-265); TE 2.20.2 "
      "transformer_engine/pytorch/setup.py:170-173",
      fix="pip install --no-build-isolation 'transformer-engine[pytorch]==VERSION' so that all "
      "of them have one VERSION; a core package for torch's CUDA major", family="environment")
def te_packages(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    mismatch = _core_cuda_mismatch(snapshot)
    if mismatch is not None:
        core, torch = mismatch
        said = f"{snapshot.te_core_package} {snapshot.te_core} is TransformerEngine's core " \
            f"library for CUDA {core}, but torch {snapshot.torch} is built for CUDA " \
            f"{snapshot.torch_cuda}: the library needs libcudart.so.{core} and " \
            f"libcublas.so.{core}, which torch's CUDA {torch} does not bring"
        if snapshot.te_import_checked and snapshot.te_import_error is None:
            yield Hit("transformer_engine", f"{said}; TE imports here (a CUDA {core} on the "
                      "loader path), with two CUDA runtimes in one process, outside what TE's "
                      "torch extension requires", severity="warning",
                      fix=_core_swap(snapshot, core, torch))
        else:
            yield Hit("transformer_engine", f"{said}, so `import transformer_engine.pytorch` "
                      "fails ('cannot open shared object file') unless a CUDA "
                      f"{core} toolkit is on the loader path",
                      fix=_core_swap(snapshot, core, torch))
    if snapshot.te is not None and snapshot.te_torch is not None and snapshot.te_core is None:
        core = _core_package_for(snapshot)
        yield Hit("transformer_engine", f"transformer-engine-torch {snapshot.te_torch} is "
                  "installed without TE's core package (transformer-engine-cu12 or -cu13): "
                  "`import transformer_engine.pytorch` fails TE's check (\"Could not find TE "
                  "core package\")",
                  fix=f"pip install --no-build-isolation '{core}=={snapshot.te_torch}'")
        return
    found = _te_distributions(snapshot)
    # Either wheel's Python files may be the ones installed last (both carry them: TE 2.20.2's
    # RECORDs of transformer-engine and transformer-engine-cu13 list transformer_engine/
    # __init__.py), so a core package from 2.9 checks the metapackage's version too.
    newest = max(parse_version(snapshot.te) or (), parse_version(snapshot.te_core) or ())
    core_checked = snapshot.te_core is not None and newest >= TE_CORE_CHECK
    if (snapshot.te_torch is not None or core_checked) and len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {v}" for name, v in found.items())
        yield Hit("transformer_engine", f"TransformerEngine packages differ in version ({listed}):"
                  " `import transformer_engine.pytorch` fails TE's version check")


#: The core package's name: its CUDA major (TE 2.20.2 common/__init__.py:165).
_CORE_CUDA = re.compile(r"transformer-engine-cu(\d+)")


def _core_cuda_mismatch(snapshot: Snapshot) -> tuple[int, int] | None:
    """(the core package's CUDA major, torch's) where they differ; None where they agree or
    either is unknown. TE's torch extension requires transformer_engine_cu{torch's major} (TE
    2.20.2 pytorch/setup.py:170-173; cu12 only before 2.9), and the cu13 core library needs
    libcudart.so.13 and libcublas.so.13, found through no RUNPATH (readelf -d of TE 2.20.2's
    wheel_lib/libtransformer_engine.so)."""
    core = _CORE_CUDA.fullmatch(snapshot.te_core_package or "")
    torch = _torch_cuda(snapshot)
    if core is None or not torch or int(core[1]) == torch[0]:
        return None
    return int(core[1]), torch[0]


def _core_swap(snapshot: Snapshot, core: int, torch: int) -> str:
    """Swap the core package for torch's CUDA major. Uninstall first, then reinstall: each core
    package writes TE's Python files (as the metapackage does) and
    transformer_engine/wheel_lib/libtransformer_engine.so (TE 2.20.2 transformer_engine_cu13's
    RECORD), so uninstalling one deletes what the other wrote, and pip skips a plain install
    of what it still lists."""
    wanted = _core_package_for(snapshot)
    if wanted == snapshot.te_core_package:  # no core package for torch's CUDA at this TE
        upgrade = f", or upgrade TransformerEngine to {dotted(TE_CORE_CHECK)} or newer (the " \
            f"first with a core package for CUDA {torch})" if torch == 13 else ""
        return f"{TORCH_FOR_CUDA} {core}{upgrade}"
    return (f"pip uninstall -y {snapshot.te_core_package}, then pip install --force-reinstall "
            f"--no-deps '{wanted}=={snapshot.te_core}'")


@rule("FP8206", "error", "TransformerEngine's torch extension does not import",
      why="TE's torch extension is compiled against one torch; with another torch (or a broken "
      "CUDA setup) `import transformer_engine.pytorch` fails. The doctor imports it in a "
      "subprocess so that a crash cannot take the doctor down; fp8_lint does not import it. "
      f"The fix follows the error: from TE {dotted(TE_MIN_CUDNN_FROM)} a cuDNN older than "
      f"{dotted(TE_MIN_CUDNN)} (torch 2.7's own pin is older), a CUDA library missing for a "
      "core package of another CUDA than torch's (FP8205), the torch extension never installed "
      "(FP8204).",
      source=f"{TE_SRC} transformer_engine/common/__init__.py load_framework_extension; "
      "transformer_engine/pytorch/__init__.py; TE 2.20.2 common/__init__.py:22-42, 154-156",
      fix="rebuild TE's torch extension against the installed torch, or uninstall TE to train "
      "with te_swap: {backend: emulate}", family="environment")
def te_import(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    error = snapshot.te_import_error
    if snapshot.te is not None and snapshot.te_import_checked and error:
        setting = "NVTE_" in error and "as an integer)" in error
        how = (f"imports it too and dies the same way (Python {snapshot.te_import_died})"
               if snapshot.te_import_died else
               "raises it too (its hf_checkpointer catches only ModuleNotFoundError)")
        every = (f"; `import llmfoundry` {how}, so no training starts here, BF16 and the "
                 "emulated backend included") if breaks_every_run(snapshot) else ""
        yield Hit("transformer_engine", f"`import transformer_engine.pytorch` fails: "
                  f"{error} (installed torch: {snapshot.torch or '?'}){every}",
                  fix="set the NVTE_ variable(s) named to an integer (0 or 1), or unset them"
                  if setting else _import_fix(snapshot, error))


#: TE's words when the cuDNN it loaded is older than it needs (TE 2.20.2
#: transformer_engine/common/__init__.py:39-41), and the dynamic loader's for a missing library.
_REQUIRES_CUDNN = "Transformer Engine requires cuDNN"
_NO_LIBRARY = re.compile(r"lib[\w.+-]*\.so(\.\d+)*: cannot open shared object file")
#: TE's words when the torch extension's library is not found (TE 2.20.2
#: transformer_engine/common/__init__.py:154-156 with library "torch").
_NO_TORCH_LIBRARY = "Could not find shared object file for Transformer Engine torch lib"


def _import_fix(snapshot: Snapshot, error: str) -> str:
    """The fix for a failed TE import, by what its error says: a cuDNN older than TE wants; a
    CUDA library missing where the core package is for another CUDA than torch's (FP8205); the
    torch extension never installed (`transformer-engine[core]`, FP8204); TE's files gone;
    else an extension built against another torch."""
    mismatch = _core_cuda_mismatch(snapshot)
    if _REQUIRES_CUDNN in error:
        return _cudnn_fix(snapshot)
    if mismatch is not None and _NO_LIBRARY.search(error):
        return _core_swap(snapshot, *mismatch)
    if _NO_TORCH_LIBRARY in error and snapshot.te_torch is None and snapshot.te_core \
            and snapshot.te_pure_wheel:
        return _install_torch_extension(snapshot)
    return _reinstall_te(snapshot) if _te_files_gone(error) else _rebuild_te(snapshot)


def _cudnn_fix(snapshot: Snapshot) -> str:
    """A cuDNN TE takes, or a TE that does not ask for it. TE loads cuDNN from CUDNN_HOME,
    CUDNN_PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda, then LD_LIBRARY_PATH, before pip's
    nvidia-cudnn package (TE 2.20.2 common/__init__.py:381-413 _load_cuda_library_from_system, :416-433); torch 2.7 pins
    nvidia-cudnn-cu12==9.5.1.17, so pip reports the newer one as a conflict with torch's pin."""
    major = _torch_cuda_major(snapshot)
    package = next((p for p in CUDNN_PACKAGES if p.endswith(f"cu{major}")), CUDNN_PACKAGES[0])
    return (f"install cuDNN {dotted(TE_MIN_CUDNN)} or newer where TE loads it first (CUDNN_HOME,"
            " CUDNN_PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda, LD_LIBRARY_PATH; else the pip "
            f"package: pip install '{package}>="
            f"{dotted(TE_MIN_CUDNN)}', beyond the pin of torch), or use a TransformerEngine "
            f"older than {dotted(TE_MIN_CUDNN_FROM)}: pip install --no-build-isolation "
            f"'{TE_REQUIREMENT}'")


#: LLM-Foundry imports TE when it is imported and catches only ModuleNotFoundError
#: (llmfoundry/callbacks/hf_checkpointer.py:54-58 in 0.21.0 and 0.22.0), Composer only
#: ImportError (composer/core/precision.py:15-19 in 0.31.0 and 0.32.1): a TE whose import
#: raises anything else (an undefined symbol, a version assert, NVTE_DEBUG=true's ValueError,
#: a missing CUDA library) stops `import llmfoundry`, so every run in this environment; so does
#: an import that ends the interpreter without raising (`Snapshot.te_import_died`: a SIGSEGV or
#: SIGILL from a TE built for another torch or CPU), which no except clause catches. Not the
#: doctor's probe failing (a timeout, its output limit, Python not starting).
def breaks_every_run(snapshot: Snapshot) -> bool:
    """Whether this TE's failing import stops every LLM-Foundry run here (not only TE's)."""
    return bool(snapshot.te is not None and snapshot.te_import_checked
                and (snapshot.te_import_raised not in (None, "ModuleNotFoundError")
                     or snapshot.te_import_died is not None))


def _rebuild_te(snapshot: Snapshot) -> str:
    """Rebuild the torch extension: a plain `pip install` of the installed version does
    nothing ("Requirement already satisfied"), and pip reuses the wheel it built before, against
    the old torch, from its wheel cache (pip's docs, Caching: Locally built wheels)."""
    names = " ".join(_te_distributions(snapshot))
    uninstall = f"; or pip uninstall -y {names} and train with te_swap: {{backend: emulate}}"
    if snapshot.te_torch is None:  # a source build: no pip package to rebuild
        return "rebuild TransformerEngine from its source against the installed torch" + uninstall
    return ("rebuild TE's torch extension against the installed torch: pip install "
            "--force-reinstall --no-deps --no-cache-dir --no-build-isolation "
            f'"transformer-engine-torch=={snapshot.te_torch}"' + uninstall)


#: What `import transformer_engine.pytorch` says when pip lists TE but its files are gone (a
#: half-finished uninstall, a deleted site-packages folder): Python finds no package, or TE
#: finds no compiled library (transformer_engine/common/__init__.py `_get_shared_object_file`,
#: "Could not find shared object file"; before TE 1.13 `next(glob(...))` raised StopIteration).
_FILES_GONE = re.compile(r"No module named '?transformer_engine[\w.]*'?|Could not find shared "
                         r"object file|^'?StopIteration")


def _te_files_gone(error: str) -> bool:
    return _FILES_GONE.search(error) is not None


def _torch_cuda_major(snapshot: Snapshot) -> int:
    """torch's CUDA major, 12 where unknown (the CUDA the CPU-side defaults assume)."""
    return (parse_version(snapshot.torch_cuda) or (12,))[0]


def _core_package_for(snapshot: Snapshot) -> str:
    """The core package TE's torch extension wants: before TE 2.9 always the CUDA 12 one; from
    2.9 the one for torch's CUDA major (TE transformer_engine/pytorch/setup.py, v2.9-v2.18)."""
    major = _torch_cuda_major(snapshot)
    newer = (parse_version(snapshot.te_torch or snapshot.te_core) or ()) >= TE_CORE_CHECK
    return f"transformer-engine-cu{major if newer and major in (12, 13) else 12}"


def _te_distributions(snapshot: Snapshot) -> dict[str, str]:
    """TE's installed distributions (metapackage, torch extension, core) and their versions."""
    return {name: v for name, v in (("transformer-engine", snapshot.te),
                                    ("transformer-engine-torch", snapshot.te_torch),
                                    (snapshot.te_core_package, snapshot.te_core))
            if name and v is not None}


def _reinstall_te(snapshot: Snapshot) -> str:
    """Reinstall, not rebuild: with the files gone there is nothing to rebuild against torch, and
    pip, which still lists the packages, skips a plain install of the same version."""
    names = list(_te_distributions(snapshot))
    install = f'pip install --no-build-isolation "transformer-engine[pytorch]=={snapshot.te}"' \
        if parse_version(snapshot.te) else TE_INSTALL_HINT
    return (f"reinstall TransformerEngine, whose files are gone while pip still lists it: pip "
            f"uninstall -y {' '.join(names)}, then {install}")


@rule("FP8207", "error", f"TransformerEngine older than {dotted(MIN_TE_FOR_RECOMPUTE)} with "
      "activation checkpointing",
      why="FP8 activation recompute kept wrong backward scales (TE issue #1190); fixed by TE PR "
      f"#1254, first released in TE v{dotted(MIN_TE_FOR_RECOMPUTE)}. Checked by fp8_lint "
      "against the installed TE.",
      source="https://github.com/NVIDIA/TransformerEngine/issues/1190; "
      "https://github.com/NVIDIA/TransformerEngine/pull/1254 (git tag --contains: "
      f"v{dotted(MIN_TE_FOR_RECOMPUTE)})",
      fix=f"upgrade TransformerEngine to {dotted(MIN_TE_FOR_RECOMPUTE)} or newer, or turn off "
      "fsdp_config.activation_checkpointing", family="environment")
def recompute_te(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    te = snapshot.te_version
    if section(env.config, "fsdp_config").get("activation_checkpointing") and te is not None \
            and te < MIN_TE_FOR_RECOMPUTE:
        yield Hit("fsdp_config.activation_checkpointing", f"TransformerEngine {snapshot.te} "
                  "recomputes FP8 layers with wrong backward scales under activation "
                  f"checkpointing (TE issue #1190, fixed in TE {dotted(MIN_TE_FOR_RECOMPUTE)})",
                  fix=f"upgrade TransformerEngine to {dotted(MIN_TE_FOR_RECOMPUTE)} or newer, or "
                  "turn off fsdp_config.activation_checkpointing")


@rule("FP8208", "error", "current scaling with TransformerEngine older than "
      f"{dotted(MIN_TE_CURRENT_SCALING)}",
      why=f"TE's Float8CurrentScaling exists from TE {dotted(MIN_TE_CURRENT_SCALING)}; checked "
      "by fp8_lint against the installed TE (te.facts.environment_problems, shared with "
      "te_swap).",
      source=f"{TE_SRC} transformer_engine/common/recipe/__init__.py "
      f"(v{dotted(MIN_TE_CURRENT_SCALING)})",
      fix="upgrade TransformerEngine or use scaling: delayed", family="environment")
def recipe_te(env: Environment, _: LintContext) -> Iterator[Hit]:
    options = section(section(env.config, "algorithms"), "te_swap").get("fp8_recipe")
    if env.config is None or env.snapshot.te_version is None or not isinstance(options, Mapping):
        return
    try:
        recipe = FP8Recipe.from_options(options)
    except (RecipeError, TypeError):
        return  # a broken recipe is the linter's FP8008
    for problem in environment_problems(recipe, None, env.snapshot.te_version):
        yield Hit(f"algorithms.te_swap.fp8_recipe.{problem.key}", problem.message,
                  fix=problem.fix)


@rule("FP8209", "info", "Composer and torch whose Trainer cannot auto micro-batch under FSDP",
      why="The doctor's view of FP8031's fact: this Composer defines unshard_with_sync only for "
      f"torch{UNSHARD_TORCH_RANGE} (its own torch pin), so with the installed torch any run with "
      "device_train_microbatch_size: auto and FSDP raises NameError when the Trainer is built. "
      "Info: FP8 training itself is not affected; `fp8_lint` and `foundry-fp8 lint` judge the "
      "run's config (FP8031) instead.",
      source=f"Composer {AUTO_MICROBATCH_SOURCE}: patch_unshard_for_automicrobatching",
      fix="give device_train_microbatch_size an integer in FSDP runs, or install "
      f"torch{UNSHARD_TORCH_RANGE}", family="environment")
def auto_microbatch_torch(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    if _shadow(snapshot, "composer") or _shadow(snapshot, "torch"):
        return  # FP8215
    if env.config is None and auto_microbatch_fsdp_fails(snapshot.composer, snapshot.torch):
        yield Hit("composer", f"Composer {snapshot.composer} with torch {snapshot.torch}: "
                  "device_train_microbatch_size: auto under FSDP raises NameError "
                  f"'unshard_with_sync' (defined for torch{UNSHARD_TORCH_RANGE} only)")


@rule("FP8210", "warning", "TransformerEngine installed, its version unreadable",
      why="The checks that depend on TE's version (FP8207: >= "
      f"{dotted(MIN_TE_FOR_RECOMPUTE)} for activation recompute, FP8208: >= "
      f"{dotted(MIN_TE_CURRENT_SCALING)} for current scaling) cannot run, so a machine they "
      "would fail must not "
      "pass `doctor --strict` as ready. The doctor's only: a run is not stopped for it.",
      source="importlib.metadata version of the transformer-engine distribution",
      fix="reinstall TransformerEngine from a release (pip install 'transformer-engine[pytorch]')"
      " so that its package metadata carries a version", family="environment")
def te_version_unknown(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    if env.config is None and snapshot.te is not None and snapshot.te_version is None:
        yield Hit("transformer_engine", f"TransformerEngine's version {snapshot.te!r} is not "
                  "a version: the TE version checks were skipped")


#: Rules that set each hit's severity for a run themselves (`environment_findings` does not make
#: them errors) and that judge runs on the emulated backend too, which reads the same variable.
_RUN_SEVERITY_OWN = frozenset({"FP8211"})


def _run_scaling(config: Mapping[str, Any]) -> str | None:
    """The scaling a run's FP8 layers use: te_swap's recipe, else delayed (LLM-Foundry's own TE
    layers run under Composer's fp8_autocast, whose default recipe is DelayedScaling:
    composer/core/precision.py get_precision_context); None where the recipe does not parse."""
    options = section(section(config, "algorithms"), "te_swap").get("fp8_recipe")
    try:
        return FP8Recipe.from_options(options if isinstance(options, Mapping) else {}).scaling
    except (RecipeError, TypeError):
        return None  # a broken recipe is the linter's FP8008


@rule("FP8211", "error", f"{BACKWARD_OVERRIDE_ENV} set to a value TransformerEngine refuses, "
      "or with delayed scaling",
      why=f"From TE {dotted(TE_BACKWARD_OVERRIDE_FROM)} every recipe class reads "
      f"{BACKWARD_OVERRIDE_ENV} when TE is imported and asserts it is unset or one of "
      f"{', '.join(BACKWARD_OVERRIDE_VALUES)} (an empty value too is refused), and DelayedScaling"
      " asserts it unset: such a run fails building its recipe. The emulated backend judges it "
      "as that TE does; an older TE ignores it (info). The doctor, which does not know the "
      "recipe, warns about an accepted value (delayed scaling refuses it); `fp8_lint` errs "
      "where the run's recipe is delayed.",
      source=f"{TE_SRC} transformer_engine/common/recipe/__init__.py (v2.15: l. 14, 219-228, "
      "270; te.facts.TE_BACKWARD_OVERRIDE_FROM)",
      fix=f"unset {BACKWARD_OVERRIDE_ENV}, or set it to {' or '.join(BACKWARD_OVERRIDE_VALUES)} "
      "with fp8_recipe: {scaling: current}", family="environment")
def backward_override(env: Environment, _: LintContext) -> Iterator[Hit]:
    value = env.snapshot.nvte_backward_override
    config = env.config
    if value is None or (config is not None and not has_fp8_layers(config)):
        return
    te = env.snapshot.te_version
    emulated = config is not None and not uses_te(config)  # judged as TE >= 2.15 (`emulate`)
    old_te = not emulated and te is not None and te < TE_BACKWARD_OVERRIDE_FROM
    if old_te:
        emulates = "" if value in BACKWARD_OVERRIDE_VALUES else \
            " (the emulated backend reads it and refuses this value)"
        yield Hit(BACKWARD_OVERRIDE_ENV, f"{BACKWARD_OVERRIDE_ENV}={value!r} is ignored by "
                  f"TransformerEngine {env.snapshot.te} (read from "
                  f"{dotted(TE_BACKWARD_OVERRIDE_FROM)}){emulates}", severity="info",
                  fix=f"unset {BACKWARD_OVERRIDE_ENV}, or upgrade TransformerEngine to "
                  f"{dotted(TE_BACKWARD_OVERRIDE_FROM)} or newer for it to apply")
        return
    scaling = None if config is None else _run_scaling(config)
    for problem in backward_override_problems(value, None if emulated else te, scaling):
        accepted = value in BACKWARD_OVERRIDE_VALUES
        yield Hit(BACKWARD_OVERRIDE_ENV, problem.message, fix=problem.fix,
                  severity="warning" if accepted and scaling is None else "error")


@rule("FP8212", "error", "a GPU, but torch built without CUDA (its CPU build)",
      why="torch's CPU build (torch/version.py `cuda = None`) cannot use the GPU nvidia-smi "
      "lists: torch.cuda.is_available() is False, TE's torch extension neither builds nor runs "
      "against it, and te_swap's `backend: te` finds no GPU; only the emulated backend runs, on "
      "the CPU. The doctor's: a training run reads the GPU from torch, which sees none "
      "(FP8201). The driver's CUDA (nvidia-smi's `CUDA Version`) bounds the CUDA torch may be "
      "built for.",
      source="torch/version.py (`cuda`); TE build_tools/pytorch.py (a CUDAExtension: it needs "
      "torch's CUDA build)",
      fix=f"{TORCH_FOR_DRIVER}: PyPI's Linux wheel, or pip install torch --index-url "
      "https://download.pytorch.org/whl/cuXYZ (cuXYZ that CUDA, as cu126); then rebuild TE "
      "against it if its import fails",
      family="environment")
def torch_without_cuda(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    # An UNVERSIONED torch (a source tree) may lack a built version.py: no CUDA line is no
    # verdict there, only in an installed build, whose version.py pip's wheel always has; nor
    # where a folder shadows the installed torch (FP8215): the version.py read is the shadow's.
    if snapshot.has_gpu and parse_version(snapshot.torch) and snapshot.torch_cuda is None \
            and not _shadow(snapshot, "torch"):
        yield Hit("torch_cuda", f"{snapshot.gpu_name or 'this GPU'} is here, but torch "
                  f"{snapshot.torch} is built without CUDA (its CPU build): torch and "
                  "TransformerEngine cannot use the GPU")


#: Where the driver's CUDA bounds torch's build. NVIDIA's "CUDA Compatibility" guide, Minor Version
#: Compatibility (docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html):
#: from CUDA 11 an application built with any toolkit of one major release runs on a driver of
#: that major (12.x: driver >= 525, which reports CUDA 12.0 or newer), "with limited feature-set":
#: PTX a newer toolkit wrote does not JIT on the older driver. torch's wheels bundle their CUDA
#: runtime and ship SASS for the FP8 GPUs, and TE's NVRTC kernels are compiled to a cubin for
#: them (TE transformer_engine/common/util/rtc.cpp KernelManager::compile: PTX only for an arch
#: NVRTC lacks), so a newer minor only is an info. A newer major has no such guarantee (the
#: forward-compatibility package aside): torch fails at its first CUDA call, "The NVIDIA driver
#: on your system is too old".
_CUDA_COMPAT_SRC = "NVIDIA CUDA Compatibility guide (docs.nvidia.com/deploy/cuda-compatibility)"


@rule("FP8213", "error", "torch built for a newer CUDA major than the NVIDIA driver supports",
      why="The driver supports CUDA up to the version nvidia-smi's header prints (`CUDA "
      "Version`, from driver 610 `CUDA UMD Version`); torch built for a newer CUDA major fails "
      "at its first CUDA call (\"The NVIDIA driver on your system is too old\"). A newer minor "
      "of the same major runs (CUDA minor version compatibility, with torch's bundled CUDA "
      "runtime): an info. The doctor's: a run reads the GPU from torch, not nvidia-smi.",
      source=f"{_CUDA_COMPAT_SRC}, Minor Version Compatibility; nvidia-smi's header; "
      "torch/version.py (`cuda`)",
      fix=f"{TORCH_FOR_DRIVER}, or upgrade the NVIDIA driver", family="environment")
def torch_newer_than_driver(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    torch, driver = _torch_cuda(snapshot), parse_version(snapshot.driver_cuda)
    if env.config is not None or not torch or not driver or len(torch) < 2 or len(driver) < 2:
        return
    said = f"torch {snapshot.torch} is built for CUDA {snapshot.torch_cuda}, but the NVIDIA " \
        f"driver supports CUDA {snapshot.driver_cuda} at most (nvidia-smi)"
    if torch[0] > driver[0]:
        yield Hit("torch_cuda", f"{said}: torch fails at its first CUDA call (\"The NVIDIA "
                  "driver on your system is too old\")")
    elif torch[0] == driver[0] and torch[1] > driver[1]:
        yield Hit("torch_cuda", f"{said}: it runs by CUDA minor version compatibility (same "
                  f"major {torch[0]}), but PTX built by CUDA {snapshot.torch_cuda} does not JIT "
                  "on this driver", severity="info",
                  fix="nothing for torch's and TE's own kernels on an FP8 GPU; upgrade the "
                  "NVIDIA driver for code that JIT-compiles PTX")


def _shown(requirement: Requirement) -> str:
    """`requirement` as a message writes it, lower bounds first: `mosaicml[wandb]>=0.31.0,<0.33`
    (pip's metadata writes `<0.33,>=0.31.0`)."""
    extras = f"[{','.join(requirement.extras)}]" if requirement.extras else ""
    ordered = sorted(requirement.clauses, key=lambda c: not c[0].startswith(">"))
    return requirement.name + extras + ",".join(op + v for op, v in ordered)


def _satisfies(version: tuple[int, ...], op: str, bound: str) -> bool | None:
    """PEP 440's comparison of a release with one clause (`==2.7.*` included), zero-padded as
    PEP 440 pads releases; None for a bound that is not a release. Pre-release, dev and local
    tags are not read (`version` is the release alone), unlike PEP 440, on purpose: NGC's torch
    `2.7.0a0+79aa17489c.nv25.04` is NVIDIA's build of the 2.7.0 release, which `>=2.7.0` means
    (packaging, a pre-release before its release, would call it outside)."""
    wildcard = bound.endswith(".*")
    want = parse_version(bound.removesuffix(".*"))
    if want is None:
        return None
    if wildcard:
        same = version[:len(want)] + (0,) * (len(want) - len(version)) == want
        return same if op == "==" else not same if op == "!=" else None
    width = max(len(version), len(want))
    have, want = version + (0,) * (width - len(version)), want + (0,) * (width - len(want))
    if op == "~=":  # >= bound, == its prefix without the last part
        prefix = len(parse_version(bound) or ()) - 1
        return have >= want and have[:prefix] == want[:prefix]
    return {"==": have == want, "!=": have != want, "<": have < want, "<=": have <= want,
            ">": have > want, ">=": have >= want}[op]


@rule("FP8214", "error", "torch, Composer or LLM-Foundry missing, or outside the versions "
      "foundry-fp8 supports",
      why="te_swap, the callbacks and the emulated backend are Composer and LLM-Foundry plugins "
      "on torch: with one of them missing (`pip install --no-deps`, an image without them) no "
      "run can use foundry-fp8, an error. A version outside the range foundry-fp8 requires was "
      "never tested (te_swap, fp8_state and the sdpa attention use their internals), a "
      "warning, as for a TE older than te_swap's floor (FP8204); so is one that imports "
      "but has no package metadata (a source tree on PYTHONPATH), whose version is unknown. "
      "A pre-release or local build counts as its release: NGC's torch "
      "2.7.0a0+79aa17489c.nv25.04 is 2.7.0 (PEP 440 puts 2.7.0a0 before 2.7.0). The ranges "
      "are read from foundry-fp8's package metadata (a checkout's egg-info counts: `pip "
      "install -e` wrote it from setup.cfg); without any (a bare source tree) nothing is "
      "judged. The doctor's: a run has all three, and pip resolved their "
      "versions.",
      source="setup.cfg install_requires (the installed foundry-fp8's Requires-Dist); "
      "foundry_fp8/environment.py STACK",
      fix="pip install the requirement the message names", family="environment")
def training_stack(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    if env.config is not None:
        return
    for distribution, text in snapshot.stack_ranges:
        requirement = parse_requirement(text)
        if requirement is None:
            continue
        wanted, clauses = _shown(requirement), requirement.clauses
        field, name = STACK[distribution]
        installed = getattr(snapshot, field)
        if _shadow(snapshot, field):
            continue  # FP8215: the installed version is not what runs
        if installed is None:
            yield Hit(field, f"{name} is not installed: foundry-fp8 needs "
                      f"{wanted}, and no training run can use it without", fix=f"pip install "
                      f"'{wanted}'")
            continue
        version = parse_version(installed)
        if version is None:
            what = "is importable but without package metadata (a source tree on PYTHONPATH, " \
                "a vendored copy)" if installed == UNVERSIONED else f"has version {installed}"
            yield Hit(field, f"{name} {what}: its version cannot be judged "
                      f"against {wanted}", severity="warning",
                      fix=f"pip install '{wanted}' (a source tree: `pip install -e` it)")
        elif False in [_satisfies(version, op, bound) for op, bound in clauses]:
            yield Hit(field, f"{name} {installed} is outside the versions "
                      f"foundry-fp8 supports ({wanted}): untested, and te_swap, fp8_state and "
                      "the sdpa attention use its internals", severity="warning",
                      fix=f"pip install '{wanted}'")


@rule("FP8215", "error", "torch, Composer or LLM-Foundry imported from a folder that shadows "
      "the installed one (PYTHONPATH, or the script's folder)",
      why="A `torch`, `composer` or `llmfoundry` folder on PYTHONPATH, or in the folder of the "
      "script run, comes before site-packages on Python's path: Python imports it, not the "
      "installed distribution, so the installed version says nothing of what runs, nor, for "
      "torch, the CUDA build read from the shadow's torch/version.py (a source tree has none: "
      "a GPU node's torch looked like a CPU build). The checks of that version and CUDA build "
      "(FP8203, FP8205's CUDA match, FP8209, FP8212-FP8214) are not judged while it is there. A "
      "shadowed torch is an error: on a training node it is almost always an accident (a "
      "stray copy, a source tree), and TE's torch extension was built against the installed "
      "torch; a Composer or LLM-Foundry folder (pure Python, often a checkout worked on) is a "
      "warning. The doctor's: a run imports whatever Python finds.",
      source="foundry_fp8/environment.py (_shadowing: importlib.util.find_spec against the "
      "installed distribution's files); Python's sys.path (the script's folder, then "
      "PYTHONPATH, before site-packages)",
      fix="remove the folder holding it from PYTHONPATH, or move it out of the script's folder "
      "(a checkout meant to run: `pip install -e` it)", family="environment")
def shadowed_stack(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    if env.config is not None:
        return
    labels = {package.field: package.label for package in STACK.values()}
    for field, folder in snapshot.shadowed:
        above = str(Path(folder).parent)
        judged = "its version and CUDA build are" if field == "torch" else "its version is"
        yield Hit(field, f"Python imports {labels[field]} from {folder}, not the installed "
                  f"{labels[field]} {getattr(snapshot, field)}: the {labels[field]} that runs is "
                  f"that folder's, so {judged} not judged",
                  severity=None if field == "torch" else "warning",
                  fix=f"remove {above} from PYTHONPATH, or move {folder} out of the script's "
                  "folder" + ("" if field == "torch" else " (a checkout meant to run: `pip "
                              "install -e` it)"))


@rule("FP8216", "error", "flash-attn installed, but `import flash_attn` fails",
      why="`import llmfoundry` raises ImportError ('The flash_attn package is not installed "
      "correctly') where importing flash_attn raises an ImportError naming an undefined symbol "
      "(a build for another torch): no LLM-Foundry run starts, BF16 included (an error). Any "
      "other failure (a build for another CUDA: 'libcudart.so.12: cannot open shared object "
      "file') passes that check, and is_flash_v2_installed(), which catches every exception, "
      "takes flash-attn for absent without a word: MPT's default attn_impl flash builds and its "
      "first forward raises NameError 'bert_padding', its default loss_fn raises 'Fused Cross "
      "Entropy is not installed', an hf_causal_lm's use_flash_attention_2 'flash-attention 2 "
      "is not installed' (a warning: attn_impl torch with torch_crossentropy runs). The import "
      "is tried in a subprocess after torch, as the doctor tries TE's (`--no-te-import` skips "
      "both). The doctor's.",
      source="LLM-Foundry 0.22.0 llmfoundry/__init__.py:12-27 (the undefined-symbol check), "
      "llmfoundry/models/layers/attention.py:36-42 is_flash_v2_installed (bare except), "
      "llmfoundry/models/mpt/modeling_mpt.py:32-38; foundry_fp8/environment.py "
      "flash_attn_import_error",
      fix="rebuild flash-attn against the installed torch (pip install --force-reinstall "
      "--no-deps --no-cache-dir --no-build-isolation flash-attn==V), or uninstall it and set "
      "model.attn_config.attn_impl: torch and model.loss_fn: torch_crossentropy",
      family="environment")
def flash_attn_import(env: Environment, _: LintContext) -> Iterator[Hit]:
    snapshot = env.snapshot
    error = snapshot.flash_attn_import_error
    if env.config is not None or not error:
        return
    version = snapshot.flash_attn
    fix = ("rebuild it against the installed torch: pip install --force-reinstall --no-deps "
           f"--no-cache-dir --no-build-isolation flash-attn=={version} (or uninstall it and set "
           "attn_config.attn_impl: torch, loss_fn: torch_crossentropy)")
    said = f"flash-attn {version} is installed, but `import flash_attn` fails after torch: {error}"
    if "ImportError" in error and "undefined symbol" in error:  # llmfoundry/__init__.py's test
        yield Hit("flash_attn", f"{said}; `import llmfoundry` raises ImportError ('The "
                  "flash_attn package is not installed correctly'): no LLM-Foundry run starts "
                  "here, BF16 included", fix=fix)
    else:
        yield Hit("flash_attn", f"{said}; LLM-Foundry then takes it for absent without a word: "
                  "MPT's default attn_impl flash fails at the first forward (NameError "
                  "'bert_padding'), its default fused_crossentropy loss and "
                  "use_flash_attention_2 when the model is built", severity="warning", fix=fix)


def environment_findings(snapshot: Snapshot,
                         config: Mapping[str, Any] | None = None) -> list[Finding]:
    """Findings for this environment; with a run's `config`, for that run.

    Without a config (the doctor) hardware limits are warnings: the emulated backend runs
    anywhere. With a config, a run that uses only the emulated backend gets only FP8211 (which
    the emulation reads as TE does), and a run that needs real TE gets every finding as an
    error, since it cannot do what it asks, except FP8211's, whose severity is its own.
    """
    findings = run_rules("environment", Environment(snapshot, config), LintContext(scope="run"))
    if config is None:
        return findings
    te = uses_te(config)
    return [f if f.rule in _RUN_SEVERITY_OWN else replace(f, severity="error")
            for f in findings if te or f.rule in _RUN_SEVERITY_OWN]


@rule("FP8217", "warning", "TransformerEngine newer than the releases foundry-fp8's TE facts "
      f"were read from ({dotted(TE_NEWEST_READ[:2])}, newest {dotted(TE_NEWEST_READ)})",
      why="te_swap's `backend: te`, fp8_state and fp8_guard read TE internals that are no "
      "public API (a module's fp8_meta and its scaling tensors, `_extra_state`'s layout, the "
      "autocast's state and when it updates scales); TE changed them between minor releases "
      "before (pytorch/fp8.py became quantization.py in 2.9, the guard on pickled "
      "`_extra_state` came in 2.16.1), and a release after the newest one read was never checked: a warning, as it "
      "may work. The emulated backend reads none of them. The doctor's only: a run is not "
      "stopped for it.",
      source="foundry_fp8/te/facts.py TE_NEWEST_READ; tests/test_s31_upstream_te_sources.py "
      "(our TE facts against the installed TE's own sources)",
      fix="install a TE release up to the one named (pip install --no-build-isolation "
      f"'transformer-engine[pytorch]=={dotted(TE_NEWEST_READ)}'), or check the run's FP8 state "
      "with `pytest -m gpu` on this TE first", family="environment")
def te_newer_than_read(env: Environment, _: LintContext) -> Iterator[Hit]:
    te = env.snapshot.te_version
    if env.config is None and te is not None and te[:2] > TE_NEWEST_READ[:2]:
        yield Hit("transformer_engine", f"TransformerEngine {env.snapshot.te} is newer than "
                  f"{dotted(TE_NEWEST_READ)}, the newest release foundry-fp8's TE facts were "
                  "read from: te_swap's `backend: te`, fp8_state and fp8_guard read TE "
                  "internals (fp8_meta, `_extra_state`, the autocast state) that may have "
                  "changed; the emulated backend does not use them")
