"""`foundry-fp8` command line; `SUBCOMMANDS` below is the one list of its subcommands.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Those modules import torch only inside `run`, so `foundry-fp8 lint` stays fast and GPU-free.

`main` makes the output side of every subcommand safe, so none prints a traceback for it:
text the terminal's encoding cannot show is written as backslash escapes (`\\xe9`, and a file
name's undecodable byte as `\\xff`); an output that stops reading (`| head -1`) ends the command
quietly with exit 141, as a tool killed by SIGPIPE reports in a shell; a stdout that cannot be
written (`> /dev/full`, or closed: `>&-`) stops the command with one line on stderr naming it,
exit 2, as GNU tools report a write error (a closed output nothing is written to is no error, as
for them); a stderr that cannot be written does not stop it: the rest of it is discarded, and a
command that would exit 0 exits 2 (141 for a pipe that stopped reading).
Ctrl-C is one line on stderr and exit 130, not a KeyboardInterrupt traceback; a dependency
the running Python lacks (a checkout script run outside the venv) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import difflib
import errno
import importlib
import io
import os
import shlex
import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from foundry_fp8 import __version__
from foundry_fp8.packages import DISTRIBUTION, is_ours

SUBCOMMANDS = {
    "lint": ("foundry_fp8.lint.cli", "check LLM-Foundry train YAMLs and Accelerate configs for FP8 mistakes"),
    "report": ("foundry_fp8.report", "plot a run's fp8_stats metrics (PNG heatmaps, time series) and summarise them in markdown"),
    "bench": ("foundry_fp8.tools.bench", "MPT-1B training throughput: FP8 variants against BF16"),
    "doctor": ("foundry_fp8.doctor", "the environment FP8 training needs (GPU, torch, TE), and what is wrong"),
    "tiny-data": ("foundry_fp8.tools.tiny_data", "build a tiny local tokenizer and text dataset for a CPU try (nothing downloaded)"),
}

#: What each subcommand's own exit statuses mean, shown in its --help (the ones every
#: subcommand shares follow: `_SHARED_EXITS`).
EXITS = {
    "lint": "0 no error finding (warnings and infos do not fail), 1 an error finding, 2 a path "
            "that cannot be linted or a usage error",
    "report": "0 the report was written (flagged layers do not fail it), 2 the run cannot be "
              "read, the report cannot be written (the run folder or --out) or a usage error",
    "bench": "0 every variant that can run here ran, 1 a variant failed or none ran, 2 options, "
             "YAMLs, --out or the machine (no GPU without --tiny, too little memory for the "
             "sizes asked) refused before any training",
    "doctor": "0 nothing is broken (no GPU or no TE is reported, not failed), 1 an error "
              "finding, or with --strict a warning too, 2 a usage error",
    "tiny-data": "0 built or reused, 2 a file in the way, a ROOT that cannot be written or a "
                 "usage error",
}

#: The exit status of an output that stopped reading: 128 + SIGPIPE, what a shell reports for a
#: command that SIGPIPE ended (`set -o pipefail`), so it is not mistaken for lint's exit 1.
EXIT_BROKEN_PIPE = 141
#: The exit status of a command Ctrl-C stopped: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130
#: The exit statuses every subcommand shares, after its own in its --help.
_SHARED_EXITS = (f"{EXIT_INTERRUPTED} interrupted (Ctrl-C), {EXIT_BROKEN_PIPE} the output was "
                 "closed early (| head), 2 also when stdout cannot be written")


def _exit_status_help(statuses: str) -> str:
    """An epilog naming the exit statuses, wrapped here: a subcommand with a raw description
    (tiny-data) shows its epilog as given."""
    return textwrap.fill(f"exit status: {statuses}; {_SHARED_EXITS}.", width=78)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error also names the arguments that start with '-' and
    are paths here (`lint -weird.yaml` said only 'the following arguments are required: paths'):
    argparse takes them for options. `./` before one makes it a path both where a path argument
    goes and as an option's value (`report --out ./-outdir`), where `--` does not help."""

    dashed_paths: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        if self.dashed_paths:
            from foundry_fp8.health.table import one_line

            names = ", ".join(one_line(path) for path in self.dashed_paths)
            fixed = shlex.quote(os.path.join(".", self.dashed_paths[0]))
            message += (f" ({names}: a path starting with '-' reads as an option; put ./ "
                        f"before it: {one_line(fixed)})")
        super().error(message)


def _option_action(parser: argparse.ArgumentParser, arg: str) -> argparse.Action | None:
    """The option of `parser` that `arg` names, whole or abbreviated as argparse takes it (one
    long option it begins); None where it names none, or several."""
    if (action := parser._option_string_actions.get(arg)) is not None:
        return action
    if not (arg.startswith("--") and parser.allow_abbrev):
        return None
    found = {id(a): a for o, a in parser._option_string_actions.items() if o.startswith(arg)}
    return next(iter(found.values())) if len(found) == 1 else None


def _dashed_paths(argv: list[str], parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The arguments before any `--` that start with '-' and are paths to `parser`: they name
    something that exists, or they follow an option of its that takes a path (`report --out
    -outdir`: argparse says only "expected one argument", whether -outdir exists or not). An
    option of its is none (`--out --layers x`: --out's value is missing)."""
    before = argv[:argv.index("--")] if "--" in argv else argv

    def takes_path(option: str) -> bool:
        action = _option_action(parser, option)
        return action is not None and action.type is Path and action.nargs is None

    return tuple(a for n, a in enumerate(before)
                 if a.startswith("-") and a != "-" and _option_action(parser, a) is None
                 and (os.path.lexists(a) or (n > 0 and takes_path(before[n - 1]))))


def _subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [group] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="foundry-fp8",
        description=f"FP8 training tools for Composer and LLM-Foundry: {', '.join(SUBCOMMANDS)}.",
        epilog=_exit_status_help("0 success, 1 findings or failures (what counts: COMMAND "
                                 "--help), 2 a usage or input error, or no COMMAND"))
    parser.add_argument("--version", action="version", version=f"foundry-fp8 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text,
                                    epilog=_exit_status_help(EXITS[name]))
        importlib.import_module(module).add_arguments(sub_parser)
    return parser


class OutputError(Exception):
    """stdout or stderr could not be written. Not an OSError: a subcommand's `except OSError`
    around its own files must not take it for theirs."""

    def __init__(self, name: str, stream: Any, error: OSError):
        super().__init__(f"{name}: {error.strerror or error}")
        self.name, self.stream, self.error = name, stream, error


class _Guarded:
    """A text stream whose write errors become `OutputError`; everything else is the stream's."""

    def __init__(self, stream: Any, name: str):
        self._stream, self._name = stream, name

    def _failed(self, error: OSError) -> None:
        raise OutputError(self._name, self._stream, error) from error

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._failed(error)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._failed(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Diagnostics(_Guarded):
    """stderr: a write error does not stop the command (a benchmark whose progress bar cannot
    be shown still runs and saves its results); what follows is discarded, and `lost` keeps
    the error for the exit status, as GNU tools check stderr at exit (gnulib close_stdout)."""

    lost: OSError | None = None

    def _failed(self, error: OSError) -> None:
        if self.lost is None:
            self.lost = error
            with contextlib.suppress(OSError, ValueError):  # no descriptor: nothing buffered
                _devnull_onto(self._stream.fileno())
        self._stream = open(os.devnull, "w", encoding="utf-8")  # what follows goes nowhere


def _devnull_onto(fd: int) -> None:
    """Descriptor `fd` writes to /dev/null from now on (when it was closed, the open takes its
    number itself)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


class _Closed(io.TextIOBase):
    """The stream of a descriptor closed at start: writing text to it fails as writing to a
    closed descriptor does (EBADF), so the command says so instead of exiting 0 having printed
    nothing."""

    def write(self, text: str) -> int:
        if text:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return 0


def _escaped(error: UnicodeError) -> tuple[str, int]:
    """Encoding error handler: a file name's undecodable byte (held as a lone surrogate,
    PEP 383) as `\\xff`, the byte it was; any other character as backslashreplace writes it."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    chunk = error.object[error.start:error.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in chunk):
        return "".join(f"\\x{ord(c) - 0xDC00:02x}" for c in chunk), error.end
    return codecs.backslashreplace_errors(error)


codecs.register_error("foundry_fp8.escaped", _escaped)


def _usable(stream: Any, fd: int, name: str) -> Any:
    """`stream` made safe to print to: None (the descriptor was closed at start) becomes a
    stream whose writes fail (`_Closed`), with /dev/null on `fd` so no file opened later takes
    its number; an encoding error writes the character escaped."""
    if stream is None:
        try:
            os.fstat(fd)
        except OSError:
            _devnull_onto(fd)
        stream = _Closed()
    try:
        stream.reconfigure(errors="foundry_fp8.escaped")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper, or already closed
        pass
    return _Diagnostics(stream, name) if name == "stderr" else _Guarded(stream, name)


def _where(stream: Any) -> str:
    """The file behind `stream` (`/dev/full`), or '' when it cannot be told."""
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        return ""


def _exit_status(error: OSError) -> int:
    return EXIT_BROKEN_PIPE if error.errno == errno.EPIPE else 2


def _output_failed(failure: OutputError) -> int:
    """Say once, on stderr, that stdout could not be written; then point it at /dev/null, so
    what is still buffered goes there at exit rather than into a second error."""
    if failure.error.errno != errno.EPIPE:
        from foundry_fp8.health.table import one_line

        target = _where(failure.stream)
        where = f" ({one_line(target)})" if target else ""
        sys.stderr.write(f"foundry-fp8: cannot write to stdout{where}: "
                         f"{failure.error.strerror or failure.error}\n")
        sys.stderr.flush()  # a full or closed stderr too: `_Diagnostics` keeps it quiet
    try:
        _devnull_onto(failure.stream.fileno())
    except (OSError, ValueError):  # no descriptor (a test's capture): nothing buffered at exit
        pass
    return _exit_status(failure.error)


def interrupted_by(error: BaseException, outer: BaseException | None = None) -> bool:
    """Whether `error` comes of a Ctrl-C: a KeyboardInterrupt or Composer's SystemExit(130), or
    an exception raised from or while handling one. A Ctrl-C during an extension module's
    import reaches Python as ImportError("initialization failed") from the KeyboardInterrupt:
    pybind11 wraps whatever its module init raised (torch/include/pybind11/detail/common.h:409,
    PYBIND11_MODULE), and the half-imported module then fails later imports in other ways.
    `outer` is the exception the caller was already handling where the guarded code began
    (`sys.exc_info()[1]` there): every exception raised inside has it as its last `__context__`,
    so the walk stops at it; a wrapper's own `except KeyboardInterrupt:` that calls `main` to
    write a report does not make a real error in that report a Ctrl-C."""
    seen: set[int] = {id(outer)} if outer is not None else set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt) or (
                isinstance(current, SystemExit) and current.code == EXIT_INTERRUPTED):
            return True
        pending += [current.__cause__, current.__context__]
    return False


def _interrupted() -> int:
    """Ctrl-C: one line where a traceback would go (a user who pressed it needs no stack)."""
    sys.stderr.write("foundry-fp8: interrupted\n")
    sys.stderr.flush()
    return EXIT_INTERRUPTED


#: How alike a misspelt option must be to one the subcommand has to be named as its likely
#: meaning (difflib's ratio): `--fromat`/`--format` 0.88, `--otu`/`--out` 0.8; `--bogus` is
#: 0.67 like `--out` and names nothing.
_NEAR = 0.75


def _refuse_unknown(parser: argparse.ArgumentParser, command: str | None,
                    unknown: list[str]) -> None:
    """argparse's own `unrecognized arguments` error, but from the subcommand's parser, so its
    usage line shows that subcommand's options (the top-level one shows none of them), with
    the nearest option named for a misspelt one (`--fromat`: did you mean --format?)."""
    if command is not None:
        parser = _subcommand_parsers(parser)[command]
    options = [o for action in parser._actions for o in action.option_strings]
    guesses = [close[0] for word in unknown if word.startswith("-")
               for close in [difflib.get_close_matches(word.split("=", 1)[0], options, n=1,
                                                         cutoff=_NEAR)]
               if close]
    hint = f" (did you mean {', '.join(dict.fromkeys(guesses))}?)" if guesses else ""
    parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _not_installed(missing: ModuleNotFoundError) -> int:
    """A dependency this Python lacks: the checkout's scripts (`python benchmarks/...`), or
    `python -m foundry_fp8.cli`, run with a Python other than the environment foundry-fp8 is
    installed in, or foundry-fp8 installed with `--no-deps`. One line naming the module, that
    Python and `_remedy`'s advice, not a traceback; a module of ours that does not import is
    re-raised (a bug: the traceback is the report)."""
    if is_ours(missing):
        raise missing
    sys.stderr.write(f"foundry-fp8: no module {missing.name!r} in {sys.executable}: "
                     f"{_remedy(os.path.dirname(os.path.abspath(__file__)))}\n")
    sys.stderr.flush()
    return 2


#: What a checkout of this repository holds beside the package and an installed copy (a wheel
#: in site-packages) does not.
CHECKOUT_MARK = "setup.cfg"


def _installed_here(checkout: str) -> bool:
    """Whether this Python has foundry-fp8 installed: its metadata on sys.path (a wheel's, or
    an editable install's dist-info in site-packages). The checkout's own `*.egg-info`, on
    sys.path when a script or `python -m` runs there, is no install."""
    return any(os.path.abspath(str(dist.locate_file(""))) != checkout
               for dist in metadata.distributions(name=DISTRIBUTION))


def _remedy(package: str) -> str:
    """What to do about a missing dependency. Code run from a checkout (its scripts, `python -m`
    there) with a Python that has no foundry-fp8 was started with a Python other than the
    venv's; an installed copy (the wheel, or `pip install -e . --no-deps`) was installed
    without its dependencies, so `pip check` names them all."""
    checkout = os.path.dirname(package)
    if (os.path.isfile(os.path.join(checkout, CHECKOUT_MARK))
            and not _installed_here(checkout)):
        return ("run it with the Python of the environment foundry-fp8 is installed in "
                "(activate its venv), or install it into this one (pip install -e <checkout>)")
    return (f"foundry-fp8 is installed here ({package}) without all its dependencies (pip "
            f"install --no-deps?): `{sys.executable} -m pip check` names them; install them, or "
            "install foundry-fp8 again without --no-deps")


@contextlib.contextmanager
def missing_dependency_is_one_line() -> Iterator[None]:
    """For the checkout's benchmark scripts: their imports and run, a dependency this Python
    lacks ends them as it ends `main` (one line, exit 2), not in a ModuleNotFoundError traceback.
    Importing this module needs no dependency, so it works where they are missing."""
    try:
        yield
    except ModuleNotFoundError as missing:
        raise SystemExit(_not_installed(missing)) from None


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    for each in (parser, *_subcommand_parsers(parser).values()):
        each.dashed_paths = _dashed_paths(given, each)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    outer = sys.exc_info()[1]  # a caller's, when it calls main inside its own `except`
    saved = sys.stdout, sys.stderr
    errors = [getattr(stream, "errors", None) for stream in saved]  # given back at the end
    sys.stdout = _usable(sys.stdout, 1, "stdout")
    sys.stderr = diagnostics = _usable(sys.stderr, 2, "stderr")
    try:
        try:
            code = _dispatch(argv)
        finally:  # argparse's --help and usage errors exit; their text is flushed here too
            sys.stdout.flush()
            sys.stderr.flush()
    except OutputError as failure:
        code = _output_failed(failure)
    except BaseException as error:  # Composer, once imported, turns SIGINT into sys.exit(130)
        if interrupted_by(error, outer):
            code = _interrupted()
        elif isinstance(error, ModuleNotFoundError):
            code = _not_installed(error)
        else:
            raise
    finally:
        sys.stdout, sys.stderr = saved
        for stream, error in zip(saved, errors, strict=True):
            if error is not None:
                try:
                    stream.reconfigure(errors=error)
                except (AttributeError, ValueError, OSError):
                    pass
    if code == 0 and diagnostics.lost is not None:  # the command's own failure says more
        code = _exit_status(diagnostics.lost)
    return code


if __name__ == "__main__":
    sys.exit(main())
