"""Where our files go: inside the run folder, whatever the run name or a relative path says.

Torch-free, one rule for every path option we write to (the `jsonl` logger's `path`,
`fp8_stats`' `dump_folder`): a relative path is taken inside the run folder, not the working
directory; one that leads out of it (`..`) is refused; an absolute path is the user's choice and
is used as written; a file option (the `jsonl` path) must name a file, not the run folder or
another folder. `{run_name}` is filled in as one folder name: a run name with `/` or made of
dots (`run_name: ../x`) cannot move a file elsewhere. The one exception, `fp8_stats`'
`te_debug_folder`, is opened in the callback's constructor, before any run folder is known.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePath


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


def in_run_folder(template: str, folder: Path, run_name: str, key: str,
                  file: bool = False) -> Path:
    """`template` with `{run_name}` filled in safely, inside `folder` when relative. Raises
    PathError naming `key` for a relative path that leads out of `folder` (`file`: or one that
    names no file)."""
    check_path(template, key, file)
    path = Path(template.format_map({"run_name": safe_run_name(run_name)}))
    return path if path.is_absolute() else folder / path
