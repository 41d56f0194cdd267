"""What FP8 training depends on, as found on this machine: a `Snapshot` (what is installed, what
the GPU is). Read from package metadata and files, never by importing torch or TE into this
process: the GPU comes from torch when the process already imported it (a training run), else
from `nvidia-smi`; TE's import is tried in a subprocess with a time limit (a TE extension built
for another torch can crash the interpreter). No probe can fail: an unknown value is None. A
program the probe runs (`run_probe`) is stopped, with everything it started, past its time limit
or past `PROBE_OUTPUT_LIMIT` bytes of output, and the snapshot says which.

The rules that judge a snapshot (FP82xx) live in `foundry_fp8.lint.rules.environment`; the
doctor CLI and the `fp8_lint` callback both call them. Nothing here imports the linter; the
version facts the rules compare with live in `foundry_fp8.te.facts`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata, util
from pathlib import Path
from typing import IO, Any, NamedTuple

from foundry_fp8.packages import DISTRIBUTION, parse_requirement
from foundry_fp8.te.facts import BACKWARD_OVERRIDE_ENV, parse_version

#: Seconds allowed for `import transformer_engine.pytorch` in the subprocess (it loads CUDA).
TE_IMPORT_TIMEOUT_S = 120
#: Seconds allowed for `nvidia-smi` (a hung driver must not hang the doctor).
NVIDIA_SMI_TIMEOUT_S = 20
#: Bytes of output (stdout and stderr together) read from a probe's program before it is stopped:
#: nvidia-smi's query prints a line per GPU, a failing TE import a traceback; one printing
#: endlessly must not fill the memory.
PROBE_OUTPUT_LIMIT = 1 << 20
#: Seconds a killed probe gets to exit, and its output pipes to close, before the probe gives up
#: on it (a process stuck in the GPU driver does not die even of SIGKILL).
_KILL_GRACE_S = 5
#: The most characters of a program's line a message quotes (a C++ symbol can be long).
_QUOTED_CHARS = 500
TE_CORE_PACKAGES = ("transformer-engine-cu12", "transformer-engine-cu13")
CUDNN_PACKAGES = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")
#: The newest CUDA the driver supports, as plain `nvidia-smi` prints it in its header:
#: `Driver Version: 550.40.07      CUDA Version: 12.4` (Frogging-Family/nvidia-all PR #212), from
#: driver 610 `KMD Version: 610.43.02     CUDA UMD Version: 13.3` (sgl-project/sglang issue
#: #27487; the rename is in NVIDIA's nvidia-smi release notes, docs.nvidia.com/deploy/nvidia-smi,
#: as quoted in PrismML-Eng/Bonsai-demo PR #122); `nvidia-smi -q` writes `CUDA Version : 11.0`.
#: No `--query-gpu` field holds it (`--help-query-gpu`, driver 470: driver_version only).
_DRIVER_CUDA = re.compile(r"\bCUDA (?:UMD )?Version\s*:\s*(\d+\.\d+)")


@dataclass(frozen=True)
class Snapshot:
    """What FP8 training depends on, as found on one machine. None means absent or unknown.

    `te_import_error` is only meaningful when `te_import_checked` (the doctor imports TE in a
    subprocess; the `fp8_lint` callback does not spend that time). `te_import_raised`: the class
    name of the exception that import raised (None: it imported, or it did not raise, or the
    probe itself failed: stopped at its time or output limit, Python not started), which is
    what `import llmfoundry` would meet. `te_import_died`: how the interpreter ended during
    that import without raising, in `_exit_status`'s words ("was killed by signal SIGSEGV", a
    TE built for another torch or CPU; "exited with status 0"), which `import llmfoundry`
    meets too; None otherwise, and when the probe stopped it. `flash_attn_cross_entropy`:
    flash-attn's `flash_attn/losses/cross_entropy.py` is installed (what MPT's default loss
    imports). `flash_attn_import_error`: why `import flash_attn` fails after torch in a fresh
    interpreter though flash-attn is installed (a build for another torch: "undefined symbol"),
    meaningful only when `flash_attn_import_checked` (the doctor, with the TE probe);
    LLM-Foundry's `is_flash_v2_installed` then answers False and says nothing. `gpu_error`: why the GPU could not be read although a probe ran (nvidia-smi timed
    out, failed or printed no GPU; torch.cuda raised), a driver problem rather than no GPU; None
    when it was read, or when there is nothing to ask (no nvidia-smi: no driver, so no GPU).
    `cuda_visible_devices`: that variable as the probe found it (None: unset). `gpu_hidden`:
    nvidia-smi lists a GPU (`gpu_name`), but CUDA_VISIBLE_DEVICES leaves CUDA none of them, so
    torch and TE see no GPU (`capability` is then None): nvidia-smi ignores the variable.
    With several GPUs, or CUDA_VISIBLE_DEVICES set, `gpu_name` and `capability` are those of the
    least capable GPU CUDA sees (FP8 needs every GPU a run uses), and `gpu_seen` says which GPUs
    CUDA sees (None: the one GPU nvidia-smi lists). `nvte_backward_override`: TE's
    NVTE_BACKWARD_OVERRIDE as found (None: unset; `te.facts.backward_override_problems`).
    `driver_cuda`: the newest CUDA the NVIDIA driver supports (nvidia-smi's header, `CUDA
    Version: 12.4`); None when unread (no nvidia-smi, or the GPU read from torch).
    `te_pure_wheel`: the transformer-engine distribution is a pure-Python wheel (its WHEEL file
    says `Root-Is-Purelib: true`), TE's own test for its PyPI metapackage
    (`_is_package_installed_from_wheel`, transformer_engine/common/__init__.py:37-56 to
    2.19.0, 61-79 in 2.20.2).
    `stack_ranges`: (distribution, requirement) for each of `STACK` as the installed foundry-fp8
    requires it (its Requires-Dist, written from setup.cfg's install_requires, the ranges' one
    home: `mosaicml[wandb]<0.33,>=0.31.0`); empty when foundry-fp8's own metadata is not found
    (a bare source tree on sys.path), and then nothing is judged against them. A checkout's
    `foundry_fp8.egg-info` counts: `pip install -e` wrote it from the same setup.cfg (unlike
    `cli._installed_here`, which asks whether this Python has foundry-fp8 installed).
    `te`, `torch`, `composer` and `llmfoundry` are `UNVERSIONED` for a package that has no
    package metadata but is found all the same (a source tree on PYTHONPATH, a vendored copy).
    `shadowed`: (package, folder) for each of `STACK` Python imports from another folder than
    its installed distribution's (`_shadowing`): the version above is not what runs.
    """

    python: str
    torch: str | None = None
    torch_cuda: str | None = None
    driver_cuda: str | None = None
    cudnn: str | None = None
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    gpu_error: str | None = None
    te: str | None = None
    te_torch: str | None = None
    te_core: str | None = None
    te_core_package: str | None = None
    te_import_checked: bool = False
    te_import_error: str | None = None
    te_import_raised: str | None = None
    te_import_died: str | None = None
    composer: str | None = None
    llmfoundry: str | None = None
    flash_attn: str | None = None
    flash_attn_cross_entropy: bool = False
    flash_attn_import_checked: bool = False
    flash_attn_import_error: str | None = None
    accelerate: str | None = None
    deepspeed: str | None = None
    cuda_visible_devices: str | None = None
    gpu_hidden: bool = False
    gpu_seen: str | None = None
    te_pure_wheel: bool = False
    nvte_backward_override: str | None = None
    stack_ranges: tuple[tuple[str, str], ...] = ()
    shadowed: tuple[tuple[str, str], ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.capability is not None

    @property
    def te_version(self) -> tuple[int, ...] | None:
        return parse_version(self.te)

    def stack_floor(self, distribution: str) -> tuple[int, ...] | None:
        """The lower bound (`>=`, `>`, `~=` or `==`) the installed foundry-fp8 sets on
        `distribution`, from `stack_ranges`: no version it installs with is older. None when
        unknown (no ranges, or no such bound)."""
        bounds = [parse_version(version) for name, text in self.stack_ranges
                  if name == distribution and (requirement := parse_requirement(text))
                  for op, version in requirement.clauses if op in (">=", ">", "~=", "==")]
        return max((b for b in bounds if b is not None), default=None)


#: A package's version where the package is found but has no package metadata, so no version.
UNVERSIONED = "unknown (no package metadata)"


class StackPackage(NamedTuple):
    """One package of `STACK`: `field`, the Snapshot field holding its installed version, is
    also the top-level package it imports as; `label` names it in the doctor's table and in
    FP8214's messages alike."""

    field: str
    label: str


#: The training stack foundry-fp8 plugs into, by distribution (FP8214 judges it against
#: `stack_ranges`).
STACK = {"torch": StackPackage("torch", "torch"),
         "mosaicml": StackPackage("composer", "Composer (mosaicml)"),
         "llm-foundry": StackPackage("llmfoundry", "LLM-Foundry")}


def _stack_ranges() -> tuple[tuple[str, str], ...]:
    """`Snapshot.stack_ranges`: the installed foundry-fp8's readable requirements of `STACK`,
    without environment markers (those are extras')."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except Exception:  # no metadata (a bare source tree), or broken: nothing to judge by
        return ()
    read = ((parse_requirement(text), text.strip()) for text in requires)
    return tuple((r.distribution, text) for r, text in read
                 if r is not None and r.marker is None and r.distribution in STACK)


def _stack_version(distribution: str, package: str) -> str | None:
    """The installed version of one of `STACK` (`UNVERSIONED` for a package found without
    metadata). find_spec imports nothing for a top-level name: the doctor stays torch-free."""
    version = _version(distribution)
    if version is not None:
        return version
    try:
        return UNVERSIONED if util.find_spec(package) is not None else None
    except (ImportError, ValueError):  # a broken finder, or a __spec__-less module
        return None


def _shadowing(distribution: str, package: str) -> str | None:
    """The folder Python imports `package` from where it is not the installed `distribution`'s
    (a `package` folder on PYTHONPATH, or beside the script run, ahead of site-packages): the
    metadata's version is then not what runs, and torch/version.py is read from the shadow
    (without one, torch looked like a CPU build). None where they agree or either is not found
    (an editable install keeps no package folder where its metadata is)."""
    imported = _package_dir(package)
    try:
        installed = Path(metadata.distribution(distribution).locate_file(package))
        if imported is None or not installed.is_dir() or imported.resolve() == installed.resolve():
            return None
    except Exception:  # not installed, a broken dist-info, a loop of links: no verdict
        return None
    return str(imported)


#: A package's own version line in its `__init__.py` (`__version__ = "1.8.1"`, Accelerate's).
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def imported_version(distribution: str, package: str) -> str | None:
    """The version of the `package` Python imports here: where a folder shadows the installed
    `distribution` (`_shadowing`), that folder's `__init__.py` `__version__` line (None without
    one), since that folder runs; else the installed version."""
    folder = _shadowing(distribution, package)
    if folder is None:
        return _version(distribution)
    try:
        found = _VERSION_LINE.search((Path(folder) / "__init__.py").read_text("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    return found.group(1) if found else None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except Exception:  # not installed, or a broken dist-info: neither may stop the probe
        return None


def _pure_wheel(name: str) -> bool:
    """Whether distribution `name` was installed from a pure-Python wheel, read as TE reads its
    own: the `Root-Is-Purelib` line of its WHEEL file."""
    try:
        wheel = metadata.distribution(name).read_text("WHEEL") or ""
    except Exception:  # not installed, or a broken dist-info: neither may stop the probe
        return False
    return any(line.partition(":")[2].strip().lower() == "true" for line in wheel.splitlines()
               if line.startswith("Root-Is-Purelib:"))


def _package_dir(name: str) -> Path | None:
    """Where a top-level package is, without importing it."""
    try:
        spec = util.find_spec(name)
    except Exception:
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _torch_cuda() -> str | None:
    """torch's CUDA build, read from torch/version.py (`cuda = '12.6'`) without importing it;
    None where that file cannot be read, or is not the UTF-8 Python reads sources as."""
    if "torch" in sys.modules:
        return getattr(getattr(sys.modules["torch"], "version", None), "cuda", None)
    folder = _package_dir("torch")
    try:
        text = (folder / "version.py").read_text(encoding="utf-8") if folder else ""
    except (OSError, UnicodeDecodeError):
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
        return {"gpu_error": f"torch.cuda raised {type(e).__name__}: {_quoted(str(e))}"}


@dataclass(frozen=True)
class ProbeRun:
    """What a probe's program did: its exit status (None when the probe stopped it), its output
    (at most PROBE_OUTPUT_LIMIT bytes in all, undecodable bytes replaced), and `stopped`: why the
    probe stopped it ("did not finish within 20 s", "printed more than 1 MiB of output"), or
    None."""

    returncode: int | None
    stdout: str
    stderr: str
    stopped: str | None = None


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


#: Where a container's memory limit is read: cgroup v2, then v1 ("max", or a huge number, where
#: none is set).
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"),
                        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def memory_limit() -> int | None:
    """The most RAM this process can have, in bytes: the machine's physical memory, or its
    container's cgroup limit where smaller (a job given 16 GB of a 1 TB node is killed at 16).
    None where neither can be read."""
    try:
        limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (ValueError, OSError, AttributeError):  # no such sysconf name on this system
        limits = []
    for path in CGROUP_MEMORY_LIMITS:
        try:
            limits.append(int(path.read_text()))
        except (OSError, ValueError):  # absent, unreadable, or "max"
            continue
    return min((n for n in limits if n > 0), default=None)


def _kill(process: subprocess.Popen) -> None:
    """Kill `process` and what it started (its own session, so its process group), and reap it
    unless it does not die within _KILL_GRACE_S (stuck in the kernel): then it is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # after its exit too: a child may hold its pipes
    except (AttributeError, OSError):  # no process groups here, or none left
        if process.poll() is None:
            try:
                process.kill()
            except OSError:
                pass
    try:
        process.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def run_probe(argv: list[str], timeout_s: float, limit: int | None = None) -> ProbeRun:
    """Run `argv` (stdin empty), keeping at most `limit` bytes of its output (default
    PROBE_OUTPUT_LIMIT); stop it, with everything it started, past `timeout_s` or past `limit`,
    and once it exits (a child left behind must not hold the probe). Raises OSError when it
    cannot start. Never waits much longer than `timeout_s` + 2 * _KILL_GRACE_S."""
    limit = PROBE_OUTPUT_LIMIT if limit is None else limit
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    lock, over = threading.Lock(), threading.Event()

    def read(name: str, stream: IO[bytes]) -> None:
        try:
            while not over.is_set():
                chunk = os.read(stream.fileno(), 1 << 16)
                if not chunk:
                    return
                with lock:
                    room = limit - len(kept["stdout"]) - len(kept["stderr"])
                    kept[name] += chunk[:max(room, 0)]
                    if len(chunk) > room:
                        over.set()
        except (OSError, ValueError):
            return

    readers = {name: threading.Thread(target=read, args=(name, stream), daemon=True)
               for name, stream in (("stdout", process.stdout), ("stderr", process.stderr))}
    for reader in readers.values():
        reader.start()
    deadline, stopped = time.monotonic() + timeout_s, None
    try:
        while not over.is_set() and process.poll() is None:
            if time.monotonic() >= deadline:
                stopped = f"did not finish within {timeout_s:g} s"
                break
            over.wait(0.02)
    finally:  # KeyboardInterrupt too: nothing the probe started outlives it
        _kill(process)
    until = time.monotonic() + _KILL_GRACE_S
    for name, reader in readers.items():
        reader.join(timeout=max(0.0, until - time.monotonic()))
        if not reader.is_alive():  # one still reading (a process that escaped) keeps its pipe
            getattr(process, name).close()
    if over.is_set():
        stopped = f"printed more than {_size(limit)} of output"
    with lock:
        out, err = (kept[name].decode("utf-8", errors="replace") for name in ("stdout", "stderr"))
    return ProbeRun(None if stopped else process.returncode, out, err, stopped)


def _quoted(text: str) -> str:
    """`text` as one short printable line (a message quotes a program's words with it)."""
    line = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))
    return line if len(line) <= _QUOTED_CHARS else line[:_QUOTED_CHARS - 3] + "..."


def _first_line(text: str) -> str:
    return _quoted(next((line for line in text.splitlines() if line.strip()), ""))


def _exit_status(returncode: int) -> str:
    if returncode == 0:
        return "exited with status 0"
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"failed with exit status {returncode}"


def _cuda_ordinals(value: str) -> list[int]:
    """CUDA_VISIBLE_DEVICES's ordinals as torch reads them (torch/cuda/__init__.py
    `_parse_visible_devices`, torch 2.7): each entry read as a leading integer (`1gpu` is 1);
    the list ends at the first entry that is none or negative (`""` and `-1` hide every GPU);
    a repeated ordinal hides them all."""
    ordinals: list[int] = []
    for entry in value.split(","):
        found = re.match(r"[+-]?\d+", entry.strip())
        ordinal = int(found.group()) if found else -1
        if ordinal in ordinals:
            return []
        if ordinal < 0:
            break
        ordinals.append(ordinal)
    return ordinals


def hides_every_gpu(value: str) -> bool:
    """Whether CUDA_VISIBLE_DEVICES=`value` leaves CUDA no GPU whatever the machine has
    (`_cuda_ordinals`: `""`, `-1`, a first entry that is no ordinal, a repeated ordinal); UUID
    entries (`GPU-`, `MIG-`) need nvidia-smi's list to tell."""
    return not value.startswith(("GPU-", "MIG-")) and not _cuda_ordinals(value)


def _uuid_indices(value: str, uuids: list[str]) -> list[int]:
    """nvidia-smi's indices of CUDA_VISIBLE_DEVICES's `GPU-` entries, as torch maps them
    (`parse_list_with_prefix` and `_transform_uuid_to_ordinals`, torch 2.7): an entry names the
    one GPU whose UUID it begins; the list ends at an entry without the prefix or naming none
    or several; a repeated entry or GPU hides them all."""
    entries: list[str] = []
    for entry in value.split(","):
        if entry in entries:
            return []
        if not entry.startswith("GPU-"):
            break
        entries.append(entry)
    indices: list[int] = []
    for entry in entries:
        named = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
        if len(named) != 1:
            break
        if named[0] in indices:
            return []
        indices.append(named[0])
    return indices


def visible_gpus(value: str | None, listed: int) -> int:
    """How many of the `listed` GPUs CUDA sees under CUDA_VISIBLE_DEVICES=`value`, by torch's
    reading (`_cuda_ordinals`, trimmed at the first ordinal past the last GPU as torch's
    `_device_count_nvml` does: `0,5,0` on one GPU is none, `0,5` one). UUID entries (`GPU-`,
    `MIG-`) count as all visible: `_gpu_from_nvidia_smi` maps them."""
    if value is None or value.startswith(("GPU-", "MIG-")):
        return listed
    ordinals = _cuda_ordinals(value)
    return next((i for i, ordinal in enumerate(ordinals) if ordinal >= listed), len(ordinals))


def _described(gpus: list[tuple[str, tuple[int, int]]]) -> str:
    """'2 x NVIDIA H100 (compute capability 9.0), NVIDIA A100 (...)', in the order given."""
    counts: dict[tuple[str, tuple[int, int]], int] = {}
    for gpu in gpus:
        counts[gpu] = counts.get(gpu, 0) + 1
    return ", ".join(f"{f'{n} x ' if n > 1 else ''}{name} (compute capability {cap[0]}.{cap[1]})"
                     for (name, cap), n in counts.items())


def _uuids(exe: str, timeout_s: float) -> list[str] | None:
    """nvidia-smi's GPU UUIDs in its index order; None when they cannot be read."""
    try:
        done = run_probe([exe, "--query-gpu=uuid", "--format=csv,noheader"], timeout_s)
    except OSError:
        return None
    uuids = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("GPU-")]
    return uuids if done.returncode == 0 else None


def _seen(exe: str, gpus: list[tuple[str, tuple[int, int]]], hiding: str | None,
          timeout_s: float) -> tuple[list[tuple[str, tuple[int, int]]], str | None]:
    """The GPUs CUDA sees of nvidia-smi's `gpus` (its index order, PCI bus order) under
    CUDA_VISIBLE_DEVICES=`hiding`, in CUDA's order, and how the selection was read (None: every
    GPU, in an order that does not matter); `GPU-` entries need nvidia-smi's UUIDs, asked
    within `timeout_s`. Ordinals count in CUDA_DEVICE_ORDER's order: CUDA's
    default FASTEST_FIRST differs from nvidia-smi's PCI order unless the GPUs are all alike, so
    on a mixed machine an ordinal names one of them, unknown which (every one is returned)."""
    if hiding is None:
        return gpus, None
    told = f"CUDA_VISIBLE_DEVICES={_quoted(hiding)!r}"
    if hiding.startswith("MIG-"):
        return gpus, f"a MIG instance ({told}) of {'' if len(set(gpus)) == 1 else 'one of '}" \
            f"{_described(sorted(set(gpus)))}"
    if hiding.startswith("GPU-"):
        uuids = _uuids(exe, timeout_s)
        if uuids is None or len(uuids) != len(gpus):
            return gpus, (f"{_described(sorted(set(gpus)))}, unknown which: {told} not matched "
                          "(nvidia-smi --query-gpu=uuid printed no UUID per GPU)")
        indices = _uuid_indices(hiding, uuids)
    else:
        ordinals = _cuda_ordinals(hiding)
        indices = ordinals[:visible_gpus(hiding, len(gpus))]
        pci = os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        if not pci and len(set(gpus)) > 1 and indices:
            if len(indices) == len(gpus):  # every GPU, in an order nvidia-smi does not tell
                return gpus, f"{_described(gpus)}: every GPU, by {told}"
            return gpus, (f"{'one' if len(indices) == 1 else len(indices)} of "
                          f"{_described(sorted(set(gpus)))}, unknown which: {told} counts in "
                          "CUDA's default FASTEST_FIRST order, not nvidia-smi's (set "
                          "CUDA_DEVICE_ORDER=PCI_BUS_ID to count as nvidia-smi does)")
    seen = [gpus[i] for i in indices]
    which = ", ".join(map(str, indices))
    return seen, f"{_described(seen)}: nvidia-smi's GPU{'s' * (len(indices) > 1)} {which} " \
        f"of {len(gpus)}, by {told}"


def _driver_cuda(exe: str, timeout_s: float) -> str | None:
    """The driver's CUDA from plain `nvidia-smi`'s header (`_DRIVER_CUDA`), asked within
    `timeout_s`; None when it cannot be read (the GPU query before it already judged the
    driver, so this adds no `gpu_error`)."""
    try:
        done = run_probe([exe], timeout_s)
    except OSError:
        return None
    found = _DRIVER_CUDA.search(done.stdout) if done.returncode == 0 else None
    return found.group(1) if found else None


def _gpu_from_nvidia_smi(exe: str) -> dict[str, Any]:
    """The GPUs `nvidia-smi` (at `exe`) lists that CUDA sees (`_seen`): the name and compute
    capability of the least capable (what FP8 needs of every GPU a run uses) and, in
    `gpu_seen`, which they are; {} when it lists none; `gpu_error` when it cannot be read (a
    driver problem, not an absent GPU); `driver_cuda` from a second, plain `nvidia-smi`
    (`_driver_cuda`) once a GPU is listed, every query within NVIDIA_SMI_TIMEOUT_S."""
    started = time.monotonic()
    try:
        done = run_probe([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                         NVIDIA_SMI_TIMEOUT_S)
    except OSError as e:
        return {"gpu_error": f"nvidia-smi could not be started: {_quoted(str(e))}"}
    if done.stopped:
        return {"gpu_error": f"nvidia-smi {done.stopped}, so it was stopped"}
    if done.returncode != 0:
        said = _first_line(done.stderr) or _first_line(done.stdout)  # the real one: stdout
        return {"gpu_error": f"nvidia-smi {_exit_status(done.returncode)}"
                             + (f": {said}" if said else "")}
    gpus: list[tuple[str, tuple[int, int]]] = []
    lines = [text.strip() for text in done.stdout.splitlines() if text.strip()]
    rows = [line for line in lines if "," in line]  # not nvidia-smi's own WARNING lines
    for line in rows or lines[:1]:
        name, _, cap = line.rpartition(",")
        version = parse_version(cap.strip())
        if not name.strip() or not version or len(version) < 2:
            return {"gpu_error": f"nvidia-smi printed no GPU name and compute capability but "
                                 f"{_quoted(line)!r}"}
        gpus.append((name.strip(), (version[0], version[1])))
    if not gpus:
        return {}  # a driver that lists no GPU
    hiding = os.environ.get("CUDA_VISIBLE_DEVICES")
    left = NVIDIA_SMI_TIMEOUT_S - (time.monotonic() - started)  # both queries within the limit
    seen, how = _seen(exe, gpus, hiding, max(left, 1.0))
    left = NVIDIA_SMI_TIMEOUT_S - (time.monotonic() - started)
    driver = {"driver_cuda": _driver_cuda(exe, max(left, 1.0))}
    if not seen:  # nvidia-smi lists what CUDA will not see
        return {**driver, "gpu_name": gpus[0][0], "gpu_hidden": True,
                "gpu_error": f"nvidia-smi lists {len(gpus)} GPU(s), but CUDA_VISIBLE_DEVICES="
                             f"{_quoted(hiding or '')!r} hides every one from CUDA"}
    name, capability = min(seen, key=lambda gpu: gpu[1])
    if how is None and len(seen) > 1:
        how = _described(seen)
    return {**driver, "gpu_name": name, "capability": capability, "gpu_seen": how}


def _cudnn() -> str | None:
    if "torch" in sys.modules:
        try:
            backends = sys.modules["torch"].backends.cudnn
            found = backends.version() if backends.is_available() else None
            return str(found) if found else None
        except Exception:
            return None
    return next((v for p in CUDNN_PACKAGES if (v := _version(p))), None)


#: What the TE import probe writes on stdout, each on a line of its own (to the file
#: descriptor, whatever TE does to sys.stdout): _STARTED before the import, _IMPORTED after it,
#: _RAISED and the exception's class name when it raises (its last stderr line is then the
#: exception's own). _STARTED alone: the interpreter ended inside the import (a signal,
#: os._exit, C's exit()).
_STARTED = "foundry-fp8 probe: importing"
_IMPORTED = "foundry-fp8 probe: imported"
_RAISED = "foundry-fp8 probe: the import raised "


def _import_script(modules: str) -> str:
    """The probe's program: `import {modules}` between the markers above."""
    return (f"import os\nos.write(1, b'{_STARTED}\\n')\n"
            f"try:\n    import {modules}\n"
            "except BaseException as e:\n"
            f"    os.write(1, ('\\n' + {_RAISED!r} + type(e).__name__ + '\\n').encode())\n"
            f"    raise\nos.write(1, b'\\n{_IMPORTED}\\n')\n")


_TE_IMPORT = _import_script("torch, transformer_engine.pytorch")
#: LLM-Foundry's is_flash_v2_installed imports flash_attn with torch already imported.
_FLASH_ATTN_IMPORT = _import_script("torch, flash_attn")


def flash_attn_import_error(timeout_s: float | None = None) -> str | None:
    """Why `import flash_attn` fails in a fresh interpreter after torch (None: it imports), as
    `te_import_error` judges TE's, within the same limits."""
    return _import_error(_FLASH_ATTN_IMPORT, timeout_s, None, None)


def te_import_error(timeout_s: float | None = None,
                    raised: Callable[[str], None] | None = None,
                    died: Callable[[str], None] | None = None) -> str | None:
    """Why `import transformer_engine.pytorch` fails in a fresh interpreter (None: it imports),
    within `timeout_s` (default TE_IMPORT_TIMEOUT_S) and PROBE_OUTPUT_LIMIT bytes of output;
    `raised` is told the class name of the exception the import raised, when it raised one;
    `died` how the interpreter ended inside the import without raising (`_exit_status`'s
    words); neither when the probe failed (stopped, or Python not started).
    torch is imported first, as in every training script: TE's core library finds NCCL only
    through the libraries torch loads, so TE imported alone can fail on a healthy install."""
    return _import_error(_TE_IMPORT, timeout_s, raised, died)


def _import_error(script: str, timeout_s: float | None,
                  raised: Callable[[str], None] | None,
                  died: Callable[[str], None] | None) -> str | None:
    """`te_import_error`'s reading of one import probe `script` (`_import_script`)."""
    timeout_s = TE_IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        done = run_probe([sys.executable, "-c", script], timeout_s)
    except OSError as e:
        return f"could not start Python: {_quoted(str(e))}"
    if done.stopped:
        return f"{done.stopped} (the doctor's limit), so it was stopped"
    said = done.stdout.splitlines()
    if done.returncode == 0 and _IMPORTED in said:
        return None
    name = next((line[len(_RAISED):] for line in reversed(said) if line.startswith(_RAISED)),
                None)
    if name and raised is not None:
        raised(name)
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    if name is None and _STARTED in said:  # it ended without raising: inside, or at exit
        how, inside = _exit_status(done.returncode), _IMPORTED not in said
        if inside and died is not None:
            died(how)
        where = "during the import" if inside else "after the import finished"
        return _quoted(f"Python {how} {where}" + (f": {lines[-1]}" if lines else ""))
    if not lines:
        return f"Python {_exit_status(done.returncode)}"
    return _quoted(lines[-1] + nvte_not_integer(lines[-1]))


#: The end of Python's error for int() of a string that is no integer: its repr follows.
_NOT_INT = "invalid literal for int() with base 10: "


def nvte_not_integer(error: str) -> str:
    """Which NVTE_* variable TE read as an integer, when `error` (a failed TE import's last
    line, or a bench variant's that imported TE) is int()'s on that variable's value: TE reads
    several with int() as it imports (NVTE_DEBUG, NVTE_DEBUG_LEVEL, NVTE_FLASH_ATTN:
    pytorch/attention/dot_product_attention/utils.py:65-68; NVTE_TORCH_COMPILE:
    pytorch/jit.py:41; TE main d0067d0), so `NVTE_DEBUG=true` fails it."""
    literal = error.rpartition(_NOT_INT)[2] if _NOT_INT in error else None
    names = sorted(name for name, value in os.environ.items()
                   if name.startswith("NVTE_") and repr(value) == literal)
    return f" ({', '.join(names)}: TE reads {'it' if len(names) == 1 else 'them'} as an " \
        "integer)" if names else ""


def gather_snapshot(probe_te_import: bool = True, probe_gpu: bool = True,
                    progress: Callable[[str], None] | None = None) -> Snapshot:
    """This machine's snapshot. `probe_te_import` spends a subprocess importing TE, and one
    importing flash-attn where it is installed; `probe_gpu` asks torch (when already imported)
    or nvidia-smi for the GPU. `progress` is told once, before them, which programs will run and for how long at most (the doctor shows
    it on a terminal)."""
    core_package = next((p for p in TE_CORE_PACKAGES if _version(p)), None)
    te = _version("transformer-engine")
    if te is None and _package_dir("transformer_engine") is not None:
        te = UNVERSIONED
    flash = _package_dir("flash_attn")
    smi = shutil.which("nvidia-smi") if probe_gpu and "torch" not in sys.modules else None
    flash_attn = _version("flash-attn")
    probe_flash_attn = probe_te_import and flash_attn is not None
    probe_te_import = probe_te_import and te is not None
    slow = ([f"nvidia-smi (up to {NVIDIA_SMI_TIMEOUT_S:g} s)"] if smi else []) + \
        ([f"the TransformerEngine import (up to {TE_IMPORT_TIMEOUT_S:g} s)"]
         if probe_te_import else []) + \
        ([f"the flash-attn import (up to {TE_IMPORT_TIMEOUT_S:g} s)"] if probe_flash_attn else [])
    if slow and progress is not None:
        progress(f"checking {' and '.join(slow)}")
    gpu = {} if not probe_gpu else \
        _gpu_from_torch() if "torch" in sys.modules else _gpu_from_nvidia_smi(smi) if smi else {}
    stack = {package.field: _stack_version(distribution, package.field)
             for distribution, package in STACK.items()}
    snapshot = Snapshot(
        python=platform.python_version(), torch_cuda=_torch_cuda(),
        cudnn=_cudnn(), te=te, te_torch=_version("transformer-engine-torch"),
        te_core=_version(core_package) if core_package else None, te_core_package=core_package,
        flash_attn=flash_attn,
        flash_attn_cross_entropy=bool(flash and (flash / "losses" / "cross_entropy.py").is_file()),
        accelerate=_version("accelerate"), deepspeed=_version("deepspeed"),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        nvte_backward_override=os.environ.get(BACKWARD_OVERRIDE_ENV),
        te_pure_wheel=te is not None and _pure_wheel("transformer-engine"),
        stack_ranges=_stack_ranges(), **stack, **gpu,
        shadowed=tuple((package.field, folder) for distribution, package in STACK.items()
                       if (folder := _shadowing(distribution, package.field)) is not None))
    if probe_te_import:
        names: list[str] = []
        ends: list[str] = []
        error = te_import_error(raised=names.append, died=ends.append)
        snapshot = replace(snapshot, te_import_checked=True, te_import_error=error,
                           te_import_raised=names[0] if names else None,
                           te_import_died=ends[0] if ends else None)
    if probe_flash_attn:
        snapshot = replace(snapshot, flash_attn_import_checked=True,
                           flash_attn_import_error=flash_attn_import_error())
    return snapshot
