"""Where our files go: inside the run folder, whatever the run name or a relative path says.

Torch-free, one rule for every path option we write to (the `jsonl` logger's `path`,
`fp8_stats`' `dump_folder`): a relative path is taken inside the run folder, not the working
directory; one that leads out of it (`..`) is refused; an absolute path is the user's choice and
is used as written; a file option (the `jsonl` path) must name a file, not the run folder or
another folder. `{run_name}` is filled in as one folder name: a run name with `/` or made of
dots (`run_name: ../x`) cannot move a file elsewhere. The one exception, `fp8_stats`'
`te_debug_folder`, is opened in the callback's constructor, before any run folder is known.

Before this rule a relative path was taken in the working directory, and the `jsonl` default was
`runs/{run_name}/metrics.jsonl`: a YAML with that written out (or any relative path that begins
with the run folder's last parts) names a file inside the run folder the old way. Taken inside
the run folder it would double it (`runs/X/runs/X/metrics.jsonl`), and a run upgraded mid-way
would leave its metrics in two files, each read as the whole run; such a path is taken the old
way (`repeated_run_folder`, whatever the working directory), and the run warns once naming the
key and the fix (`say_repeated`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path, PurePath

log = logging.getLogger(__name__)

#: fp8_stats' dump folder where `dump_folder` is not given, inside the run folder (the run writes
#: its dumps there, the report looks there).
DUMP_FOLDER = "fp8_dumps"
#: The hyperparameter fp8_stats names the folder its dumps went to in, on every logger (rank 0, at
#: each FIT_START with `dump_steps`): relative to the `jsonl` logger's folder, else the run
#: folder, POSIX-style; absolute where the dumps lie outside it. A plain Composer run logs no
#: config holding `dump_folder`, so the report finds its dumps from this alone.
DUMP_FOLDER_KEY = "fp8/dump_folder"
#: One dump of fp8_stats: a step's tensors of one rank (`monitor.FP8Monitor._write_dump`).
DUMP_FILE = "step{step:07d}-rank{rank}.safetensors"
#: Every dump `DUMP_FILE` names, as a glob.
EVERY_DUMP = "step[0-9]*-rank[0-9]*.safetensors"
#: The (key, template, run folder) whose repeated run folder was said: once, not at every fit.
_SAID: set[tuple[str, str, str]] = set()


class PathError(ValueError):
    """A path option that would write outside the run folder; one line naming the key."""


def safe_run_name(run_name: str) -> str:
    """`run_name` as one folder name: path separators become `_`, and so do the dots of a name
    made only of dots (`.`, `..`). Anything else is kept, so a usual name is the folder name
    Composer gives a `{run_name}` in `save_folder`."""
    name = re.sub(r"[/\\\x00]", "_", str(run_name))
    return "_" * max(len(name), 1) if set(name) <= {"."} else name


def run_folder(save_folder: str | None, run_name: str) -> Path:
    """The run folder: the parent of a local checkpoint `save_folder` (its placeholders already
    filled in), else `runs/<run name>` in the working directory."""
    if save_folder and "://" not in save_folder:
        return Path(save_folder).parent
    return Path("runs") / safe_run_name(run_name)


def path_problem(template: str, file: bool = False) -> str | None:
    """Why a path template would write outside the run folder (None: it would not); with `file`,
    also why it names no file (a folder: `.`, `x/..`, `/`, a trailing `/`), where the run folder
    itself would become the metrics file. Its placeholders are bare `{run_name}`s:
    `options.PathTemplate` refuses anything else first."""
    relative = template.format_map({"run_name": "run"})
    absolute = PurePath(relative).is_absolute()
    normal = os.path.normpath(relative)
    if not absolute and (normal == ".." or normal.startswith(".." + os.sep)):
        return f"{template!r} leads out of the run folder ('..')"
    if file and not absolute and normal == ".":
        return f"{template!r} is the run folder itself, not a file in it"
    if file and (relative.endswith(os.sep) or os.path.basename(relative) in ("", ".", "..")):
        return f"{template!r} names a folder, not a file"
    return None


def check_path(template: str, key: str, file: bool = False) -> None:
    """PathError naming `key` where `path_problem` finds one."""
    problem = path_problem(template, file)
    if problem:
        raise PathError(f"{key}: {problem} (fix: {path_fix(file)})")


def path_fix(file: bool = False) -> str:
    """The fix for a `path_problem`, here and in `options.PathTemplate`'s finding."""
    return ("a file inside the run folder, or an absolute file path" if file
            else "a path inside the run folder, or an absolute path")


def _trailing_parts(folder: PurePath) -> list[tuple[str, ...]]:
    """`folder`'s parts as written (normalized) and, for an absolute real path, as `resolve()`d:
    a run folder is recognized by how it ends, a symlinked one too (`/home -> /gpfs`). A relative
    folder's parts are only those written: the parts `resolve()` adds name the working directory,
    which the old rule (a relative path taken there) never repeated, so matching them would move
    a path that was never doubled (`main/m.jsonl` run from /work/main with the run folder `.`)."""
    found = [PurePath(os.path.normpath(folder)).parts]
    if isinstance(folder, Path) and folder.is_absolute():
        try:
            found.append(folder.resolve().parts)
        except (OSError, RuntimeError):  # a symlink loop
            pass
    return found


def repeated_run_folder(template: str, folder: PurePath, run_name: str,
                        key: str) -> tuple[PurePath, str, str] | None:
    """Where relative `template` (`{run_name}` filled in as `run_name`) begins with the last
    parts of the run folder `folder` (`runs/X/...` for `runs/X` or `/proj/runs/X`, `X/...` for
    a run folder `X`; the most parts that match, two at least unless that is the whole folder): the rest of it, inside `folder`, what happens (what it would
    resolve to, where it goes instead) and the fix naming `key`'s last part; None otherwise (an
    absolute path, no such beginning). Independent of the working directory, so the run, lint
    and the report (run from anywhere) agree."""
    filled = template.format_map({"run_name": safe_run_name(run_name)})
    if PurePath(filled).is_absolute():
        return None
    parts = PurePath(os.path.normpath(filled)).parts
    # two parts at least (`runs/X`), or the whole folder as written (`X` for a run folder `X`):
    # a template beginning with the run name alone (`{run_name}/dumps` for `runs/X`) named
    # ./X/dumps before, never the run folder, so it is not a repeat
    forms = _trailing_parts(folder)  # the first is the folder as written
    size = max((n for own in forms for n in range(1, len(parts) + 1)
                if n <= len(own) and own[-n:] == parts[:n] and (n >= 2 or n == len(forms[0]))),
               default=0)
    if not size:
        return None
    own = PurePath(*parts[:size])
    rest = PurePath(*parts[size:]) if len(parts) > size else PurePath(".")
    # the template's own parts after the repeat, `{run_name}` kept, for the fix
    fix = PurePath(*PurePath(os.path.normpath(template)).parts[size:] or (".",))
    return (rest, f"{template!r} begins with the run folder {own}, inside which a relative "
            f"path is taken (no longer in the working directory), so it would write "
            f"{folder / filled}, apart from the run's other files; taken as {folder / rest}, "
            "the path it named before", f"`{key.rsplit('.', 1)[-1]}: {fix}`")


def say_repeated(template: str, folder: Path, run_name: str, key: str) -> None:
    """The run's one warning for a `repeated_run_folder` (the jsonl logger at INIT, fp8_stats
    at FIT_START wherever dump_folder is set), once per key, template and folder, not at every fit; `in_run_folder` says nothing,
    so a reader of a finished run (`foundry-fp8 report`) is not told what the run was told."""
    repeated = repeated_run_folder(template, folder, run_name, key)
    if repeated is not None and (key, template, str(folder)) not in _SAID:
        _SAID.add((key, template, str(folder)))
        log.warning("%s: %s (fix: %s)", key, repeated[1], repeated[2])


def written_forms(folder: Path) -> list[Path]:
    """The ways a run may have written its run folder, found later at `folder` (from any working
    directory): `folder` absolute, then each relative tail, longest first (`proj/runs/X`,
    `runs/X`, `X`). `repeated_run_folder` judges the folder as the run wrote it (`X/...`
    repeats a run folder written `X`, not one written `runs/X`), which a reader cannot see."""
    where = folder.absolute()
    parts = where.parts[1:]  # less the root
    return [where, *(Path(*parts[n:]) for n in range(1, len(parts)))]


def in_run_folder(template: str, folder: Path, run_name: str, key: str,
                  file: bool = False) -> Path:
    """`template` with `{run_name}` filled in safely, inside `folder` when relative. Raises
    PathError naming `key` for a relative path that leads out of `folder` (`file`: or one that
    names no file). A relative path that begins with `folder` itself is taken as the rest of it
    inside `folder`; the run warns of it (`say_repeated`)."""
    check_path(template, key, file)
    repeated = repeated_run_folder(template, folder, run_name, key)
    if repeated is not None:
        if file and str(repeated[0]) == ".":
            raise PathError(f"{key}: {template!r} is the run folder itself, not a file in it "
                            f"(fix: {path_fix(file)})")
        return folder / repeated[0]
    path = Path(template.format_map({"run_name": safe_run_name(run_name)}))
    return path if path.is_absolute() else folder / path
