"""What FP8 training depends on, as found on this machine: a `Snapshot` (what is installed, what
the GPU is). Read from package metadata and files, never by importing torch or TE into this
process: the GPU comes from torch when the process already imported it (a training run), else
from `nvidia-smi`; TE's import is tried in a subprocess with a time limit (a TE extension built
for another torch can crash the interpreter). No probe can fail: an unknown value is None.

The rules that judge a snapshot (FP82xx) live in `foundry_fp8.lint.rules.environment`; the
doctor CLI and the `fp8_lint` callback both call them. Nothing here imports the linter; the
version facts the rules compare with live in `foundry_fp8.te.facts`.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from importlib import metadata, util
from pathlib import Path
from typing import Any

from foundry_fp8.te.facts import parse_version

#: Seconds allowed for `import transformer_engine.pytorch` in the subprocess (it loads CUDA).
TE_IMPORT_TIMEOUT_S = 120
#: Seconds allowed for `nvidia-smi` (a hung driver must not hang the doctor).
NVIDIA_SMI_TIMEOUT_S = 20
TE_CORE_PACKAGES = ("transformer-engine-cu12", "transformer-engine-cu13")
CUDNN_PACKAGES = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")


@dataclass(frozen=True)
class Snapshot:
    """What FP8 training depends on, as found on one machine. None means absent or unknown.

    `te_import_error` is only meaningful when `te_import_checked` (the doctor imports TE in a
    subprocess; the `fp8_lint` callback does not spend that time). `flash_attn_cross_entropy`:
    flash-attn's `flash_attn/losses/cross_entropy.py` is installed (what MPT's default loss
    imports).
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
    flash_attn_cross_entropy: bool = False
    accelerate: str | None = None
    deepspeed: str | None = None

    @property
    def has_gpu(self) -> bool:
        return self.capability is not None

    @property
    def te_version(self) -> tuple[int, ...] | None:
        return parse_version(self.te)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except Exception:  # not installed, or a broken dist-info: neither may stop the probe
        return None


def _package_dir(name: str) -> Path | None:
    """Where a top-level package is, without importing it."""
    try:
        spec = util.find_spec(name)
    except Exception:
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _torch_cuda() -> str | None:
    """torch's CUDA build, read from torch/version.py (`cuda = '12.6'`) without importing it."""
    if "torch" in sys.modules:
        return getattr(getattr(sys.modules["torch"], "version", None), "cuda", None)
    folder = _package_dir("torch")
    try:
        text = (folder / "version.py").read_text() if folder else ""
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def _gpu_from_torch() -> dict[str, Any]:
    torch = sys.modules["torch"]
    try:
        if not torch.cuda.is_available():
            return {}
        return {"gpu_name": torch.cuda.get_device_name(0),
                "capability": tuple(torch.cuda.get_device_capability(0))}
    except Exception as e:  # a driver problem is worth showing, not dying of
        return {"gpu_name": f"unknown ({type(e).__name__}: {e})"}


def _gpu_from_nvidia_smi() -> dict[str, Any]:
    """The first GPU `nvidia-smi` lists (name, compute capability); {} without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        done = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, errors="replace",
                              timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (subprocess.TimeoutExpired, OSError) as e:
        return {"gpu_name": f"unknown (nvidia-smi: {type(e).__name__})"}
    line = next((ln for ln in done.stdout.splitlines() if ln.strip()), "")
    name, _, cap = line.rpartition(",")
    version = parse_version(cap.strip())
    if done.returncode != 0 or not version or len(version) < 2:
        return {"gpu_name": f"unknown (nvidia-smi: {line or done.stderr.strip()[:80]})"} \
            if done.returncode != 0 else {}
    return {"gpu_name": name.strip(), "capability": (version[0], version[1])}


def _cudnn() -> str | None:
    if "torch" in sys.modules:
        try:
            backends = sys.modules["torch"].backends.cudnn
            found = backends.version() if backends.is_available() else None
            return str(found) if found else None
        except Exception:
            return None
    return next((v for p in CUDNN_PACKAGES if (v := _version(p))), None)


def te_import_error(timeout_s: float = TE_IMPORT_TIMEOUT_S) -> str | None:
    """Why `import transformer_engine.pytorch` fails in a fresh interpreter (None: it imports).
    torch is imported first, as in every training script: TE's core library finds NCCL only
    through the libraries torch loads, so TE imported alone can fail on a healthy install."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch, transformer_engine.pytorch"],
                              capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout_s:.0f} s"
    except OSError as e:
        return f"could not start Python: {e}"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def gather_snapshot(probe_te_import: bool = True, probe_gpu: bool = True) -> Snapshot:
    """This machine's snapshot. `probe_te_import` spends a subprocess importing TE;
    `probe_gpu` asks torch (when already imported) or nvidia-smi for the GPU."""
    core_package = next((p for p in TE_CORE_PACKAGES if _version(p)), None)
    te = _version("transformer-engine")
    if te is None and _package_dir("transformer_engine") is not None:
        te = "unknown (no package metadata)"
    flash = _package_dir("flash_attn")
    gpu = {} if not probe_gpu else \
        _gpu_from_torch() if "torch" in sys.modules else _gpu_from_nvidia_smi()
    snapshot = Snapshot(
        python=platform.python_version(), torch=_version("torch"), torch_cuda=_torch_cuda(),
        cudnn=_cudnn(), te=te, te_torch=_version("transformer-engine-torch"),
        te_core=_version(core_package) if core_package else None, te_core_package=core_package,
        composer=_version("mosaicml"), llmfoundry=_version("llm-foundry"),
        flash_attn=_version("flash-attn"),
        flash_attn_cross_entropy=bool(flash and (flash / "losses" / "cross_entropy.py").is_file()),
        accelerate=_version("accelerate"), deepspeed=_version("deepspeed"), **gpu)
    if probe_te_import and te is not None:
        snapshot = replace(snapshot, te_import_checked=True, te_import_error=te_import_error())
    return snapshot
