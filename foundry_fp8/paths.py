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
with the run folder's own relative path) names a file inside the run folder the old way. Taken
inside the run folder it would double it (`runs/X/runs/X/metrics.jsonl`), and a run upgraded
mid-way would leave its metrics in two files, each read as the whole run; such a path is taken
the old way, with one warning naming the key and the fix (`repeated_run_folder`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path, PurePath

log = logging.getLogger(__name__)

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


def _relative(folder: PurePath) -> PurePath | None:
    """`folder` relative to the working directory (None: outside it), normalized."""
    if folder.is_absolute():
        try:
            folder = PurePath(os.path.relpath(folder))
        except ValueError:  # another drive (Windows)
            return None
    normal = PurePath(os.path.normpath(folder))
    return None if normal.parts[:1] == ("..",) else normal


def repeated_run_folder(template: str, folder: PurePath, run_name: str,
                        key: str) -> tuple[PurePath, str, str] | None:
    """Where relative `template` begins with the run folder `folder` (relative to the working
    directory; `{run_name}` filled in as `run_name`): the rest of it, inside `folder`, what
    happens (what it would resolve to, where it goes instead) and the fix naming `key`'s last
    part; None otherwise (an absolute path, a run folder that is the working directory or lies
    outside it)."""
    filled = template.format_map({"run_name": safe_run_name(run_name)})
    own = _relative(folder)
    if PurePath(filled).is_absolute() or own is None or not own.parts:
        return None
    parts = PurePath(os.path.normpath(filled)).parts
    if parts[:len(own.parts)] != own.parts:
        return None
    rest = PurePath(*parts[len(own.parts):]) if len(parts) > len(own.parts) else PurePath(".")
    # the template's own parts after the repeat, `{run_name}` kept, for the fix
    fix = PurePath(*PurePath(os.path.normpath(template)).parts[len(own.parts):] or ("."))
    return (rest, f"{template!r} begins with the run folder {own}, inside which a relative "
            f"path is taken (no longer in the working directory), so it would write "
            f"{folder / filled}, apart from the run's other files; taken as {folder / rest}, "
            "the path it named before", f"`{key.rsplit('.', 1)[-1]}: {fix}`")


def in_run_folder(template: str, folder: Path, run_name: str, key: str,
                  file: bool = False) -> Path:
    """`template` with `{run_name}` filled in safely, inside `folder` when relative. Raises
    PathError naming `key` for a relative path that leads out of `folder` (`file`: or one that
    names no file). A relative path that begins with `folder` itself is taken as the rest of it
    inside `folder`, with one warning (`repeated_run_folder`)."""
    check_path(template, key, file)
    repeated = repeated_run_folder(template, folder, run_name, key)
    if repeated is not None:
        rest, said, fix = repeated
        if file and str(rest) == ".":
            raise PathError(f"{key}: {template!r} is the run folder itself, not a file in it "
                            f"(fix: {path_fix(file)})")
        if (key, template, str(folder)) not in _SAID:
            _SAID.add((key, template, str(folder)))
            log.warning("%s: %s (fix: %s)", key, said, fix)
        return folder / rest
    path = Path(template.format_map({"run_name": safe_run_name(run_name)}))
    return path if path.is_absolute() else folder / path
