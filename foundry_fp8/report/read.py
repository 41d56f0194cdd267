"""Reading a run for the report: its `metrics.jsonl` (the `health.keys` layout and fp8_guard's
series), the thresholds its `fp8_stats` ran with, the FP8 formats of its recipes and
fp8_guard's fallbacks (hparams.json); bad input is one line (ReportError)."""

from __future__ import annotations

import codecs
import itertools
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from foundry_fp8 import __version__, jsonl, wandb_history
from foundry_fp8.cli import interrupted_by
from foundry_fp8.guard import (
    FALLBACK_LAYERS,
    FALLBACK_PREFIX,
    FP8_FLOPS_SHARE,
    IN_FALLBACK_PREFIX,
    KEPT_DECISIONS,
    OLDER_PREFIX,
    REFUSED_PREFIX,
    REPROMOTION_PREFIX,
    Fallback,
    Refusal,
    Repromotion,
    Summary,
)
from foundry_fp8.health import DEFAULT_THRESHOLDS, RunMetrics, Thresholds, collect
from foundry_fp8.health.keys import (
    HIGH_PRECISION,
    LAYER_ORDER,
    LAYOUT,
    LOSS,
    MODULES_CONVERTED,
    MODULES_IN_FP8,
    OLDER_LAYOUT,
    OLDER_LAYOUT_LAST,
    OLDER_LAYOUT_UNTIL,
    SUMMARIES,
    SUMMARY_PREFIX,
    TENSORS,
    full_forms,
    layer_order,
    older_layout,
    summary_key,
)
from foundry_fp8.health.plots import recipe_formats
from foundry_fp8.health.rules import DelayedRecipe, model_blocks
from foundry_fp8.health.thresholds import RANGES
from foundry_fp8.jsonl import JsonlError, file_kind, hparams_of, json_kind, number, read_jsonl
from foundry_fp8.options import OptionError, SwapConfig, build
from foundry_fp8.paths import (
    DUMP_FOLDER,
    DUMP_FOLDER_KEY,
    PathError,
    in_run_folder,
    written_forms,
)
from foundry_fp8.recipe import FP8Recipe


class ReportError(Exception):
    """A one-line reason the report cannot be made (exit 2)."""


class NoStatistics(ReportError):
    """The run logged no per-layer FP8 series: no report, but `--baseline` still compares its
    loss."""


def _not_a_limit(raw: Any, value: float | None, valid: str) -> str:
    """Why a run's limit is refused: out of range, or no number (a string, NaN, an integer no
    float holds; before, those were dropped without a word)."""
    if value is not None and math.isfinite(value):
        return f"{value:g} is out of range ({valid})"
    if value is not None:
        return f"is {value:g}, not a limit"
    if isinstance(raw, int) and not isinstance(raw, bool):
        return "is an integer too large for a float"
    return f"is {json_kind(raw)}, not a limit"


def thresholds_from_hparams(hparams: Mapping[str, Any], source: str = "hparams.json",
                            warn: Callable[[str], None] | None = None, where: Path | str = ""
                            ) -> Thresholds:
    """The run's own `fp8_stats` thresholds (from the `jsonl` logger's hparams.json, or the
    `source` the hyperparameters were read from), so the report flags what the run warned
    about. A value out of range (a hand-edited file, another version's) is refused alone, one
    `warn` line naming `where` and the key: silently, one bad key dropped all of the run's
    limits for the defaults."""
    cfg = _fp8_stats_options(hparams)
    if cfg is None:
        return Thresholds()
    given: dict[str, float] = {}
    refused: list[str] = []
    for key in ("max_underflow_pct", "max_overflow_pct", "min_cos_sim"):
        if (raw := cfg.get(key)) is None:
            continue  # not given: fp8_stats' default is the run's own
        ok, valid = RANGES[key]
        if (v := number(raw)) is not None and math.isfinite(v) and ok(v):
            given[key] = v
            continue
        refused.append(key)
        if warn is not None:
            warn(f"{where}: callbacks.fp8_stats.{key} {_not_a_limit(raw, v, valid)}; the report "
                 f"uses fp8_stats' default {getattr(DEFAULT_THRESHOLDS, key):g} instead")
    # the report's line of thresholds says which are not the run's
    instead = f"; its {', '.join(refused)} refused: the default" if refused else ""
    return Thresholds(**given, source=f"the run's fp8_stats settings ({source}{instead})")


def _swap_options(hparams: Mapping[str, Any]) -> Mapping[str, Any]:
    """`algorithms.te_swap` of the run's config in the hyperparameters ({} where none)."""
    algorithms = hparams.get("algorithms")
    swap = algorithms.get("te_swap") if isinstance(algorithms, Mapping) else None
    return swap if isinstance(swap, Mapping) else {}


def swap_exclude(hparams: Mapping[str, Any]) -> str | None:
    """te_swap's own `exclude` (the run's config in the hyperparameters), which a change that
    keeps more layers out must keep: te_swap reads one regex."""
    exclude = _swap_options(hparams).get("exclude")
    return exclude if isinstance(exclude, str) and exclude else None


#: te_swap's options besides `exclude` that keep layers out of FP8 by their names
#: (`filters.filter_reason`).
NAME_FILTERS = ("keep_first_blocks", "keep_last_blocks", "include")


@dataclass(frozen=True)
class SwapFilters:
    """te_swap's layer filters in the run's config: its `exclude`, which a change keeping more
    layers out must keep, and its other name filters (`NAME_FILTERS`, with the model's block
    count as te_swap counts it), whose layers the report does not advise to keep out again."""

    exclude: str | None = None
    others: SwapConfig | None = None  # None: the run set none of them
    n_blocks: int = 0
    # te_swap's count of the layers it put in FP8 (`MODULES_IN_FP8`; 0: not logged): more than
    # fp8_stats' keys name where its `layers` watched some of them only
    converted: int = 0


def swap_filters(hparams: Mapping[str, Any], layers: Sequence[str]) -> SwapFilters:
    """The run's te_swap filters (`SwapFilters`); `layers`: the run's, whose blocks count where
    fp8_stats recorded no model order (`fp8/layers`). A value te_swap's options refuse (an
    edited file) is left out, as no run took it."""
    swap, given = _swap_options(hparams), {}
    # an older run's te_swap logged its converted modules only (LayerNorms among them)
    converted = hparams.get(MODULES_IN_FP8, hparams.get(MODULES_CONVERTED))
    converted = converted if isinstance(converted, int) and not isinstance(converted, bool) else 0
    for key in NAME_FILTERS:
        try:
            SwapConfig(**{key: swap[key]})
        except (KeyError, OptionError):
            continue
        given[key] = swap[key]
    if not given:
        return SwapFilters(swap_exclude(hparams), converted=converted)
    blocks = model_blocks(layer_order(hparams) or layers)
    return SwapFilters(swap_exclude(hparams), SwapConfig(**given),
                       max(blocks) + 1 if blocks else 0, converted)


def recipes_from_hparams(hparams: Mapping[str, Any]
                         ) -> tuple[DelayedRecipe | None, DelayedRecipe | None]:
    """te_swap's recipe (`fp8/recipe`: its margin for the persistent-overflow advice) and
    fp8_stats' what-if `recipe`, as the rules read them (`HealthTracker`'s
    `margin`, `history_len`, `whatif_recipe`): None where not logged or not a recipe this
    version reads (te_swap's margin is then TE's default 0)."""
    swap, stats = hparams.get("fp8/recipe"), _fp8_stats_options(hparams)
    try:
        cast = FP8Recipe.from_options(swap) if isinstance(swap, Mapping) else None
    except (TypeError, ValueError):
        cast = None
    try:
        whatif = None if stats is None else _whatif_recipe(stats)
    except (TypeError, ValueError):
        whatif = None
    return (None if cast is None else DelayedRecipe.of(cast),
            None if whatif is None else DelayedRecipe.of(whatif))


def formats_from_hparams(hparams: Mapping[str, Any], tensors: Iterable[str]) -> dict[str, set[str]]:
    """Per tensor name, the FP8 formats the run cast its rows in, for the pictures' titles:
    those of te_swap's recipe (`fp8/recipe`, its layers in FP8) and of fp8_stats' what-if
    `recipe` (the run's `callbacks.fp8_stats`, every other layer). Empty where either is not
    known (no te_swap: the recipe of TE modules the model was built with is not logged; a run
    whose config holds no fp8_stats options): no format rather than a wrong one."""
    swap, stats = hparams.get("fp8/recipe"), _fp8_stats_options(hparams)
    if not isinstance(swap, Mapping) or stats is None:
        return {}
    try:
        recipes = [FP8Recipe.from_options(swap), _whatif_recipe(stats)]
    except (TypeError, ValueError):  # not a recipe this version reads
        return {}
    return recipe_formats(recipes, tensors)


def _whatif_recipe(options: Mapping[str, Any]) -> FP8Recipe:
    """fp8_stats' what-if `recipe` from its options (its default where not given)."""
    return build("fp8_stats", {k: options[k] for k in ("recipe",) if k in options}).monitor.recipe


def _fp8_stats_options(hparams: Mapping[str, Any]) -> Mapping[str, Any] | None:
    callbacks = hparams.get("callbacks")
    cfg = callbacks.get("fp8_stats") if isinstance(callbacks, Mapping) else None
    return cfg if isinstance(cfg, Mapping) else None


#: A run's hparams.json is its config and fp8_guard's records (kilobytes; a few MiB for
#: thousands of fallbacks): a larger file is not a run's, and is not read whole into memory.
MAX_HPARAMS_BYTES = 64 * 1024 * 1024
#: What the report goes on with when the run's hparams.json does not read.
WITHOUT_HPARAMS = ("the report goes on without it: fp8_stats' default thresholds, no fp8_guard "
                   "fallback record")


def read_hparams(path: Path, warn: Callable[[str], None] | None = None
                 ) -> Mapping[str, Any] | None:
    """hparams.json, or None when absent or unusable. A file there that does not read (a
    writer killed mid-write leaves it cut short or empty) is one `warn` line naming file (and
    line) and what the report goes on with: silently, its thresholds and fallbacks would just
    vanish from the report."""
    loaded = _load_hparams(path)
    if isinstance(loaded, str):
        if warn is not None:
            warn(f"{loaded}; {WITHOUT_HPARAMS}")
        return None
    return loaded


def _load_hparams(path: Path) -> Mapping[str, Any] | str | None:
    """hparams.json's object, why it is unusable (one line), or None when absent."""
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            return f"{path}: a folder, not the run's hparams.json"
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read
            return f"{path}: not a regular file"
        if st.st_size > MAX_HPARAMS_BYTES:
            return (f"{path}: {math.ceil(st.st_size / 2**20)} MiB, more than a run's "
                    f"hparams.json holds (the report reads up to {MAX_HPARAMS_BYTES // 2**20} MiB)")
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: cannot read ({e.strerror or e})"
    if not data.strip():
        return f"{path}: empty (a run killed while writing it leaves one)"
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        whole = data.rstrip()[-1:] in (b"}", b"]")
        cut = "" if whole else "; the file stops mid-document, cut short"
        return f"{path}:{e.lineno}:{e.colno}: not JSON ({e.msg}{cut})"
    except UnicodeDecodeError as e:
        return f"{path}: not JSON (not UTF-8 text at byte offset {e.start})"
    except ValueError as e:  # an integer of more digits than Python converts
        return f"{path}: not JSON the report reads ({str(e).partition(':')[0]})"
    except RecursionError:
        return f"{path}: not JSON the report reads (nested deeper than Python's JSON parser goes)"
    if not isinstance(value, Mapping):
        return f"{path}: {jsonl.json_kind(value)}, not a JSON object of hyperparameters"
    return value


#: The first build whose fp8_stats records the model's layer order (`keys.LAYER_ORDER`).
LAYER_ORDER_SINCE = "2026-11-30"


def in_model_order(run: RunMetrics, hparams: Mapping[str, Any] | None, where: Path | str,
                   unordered: str | None, warn: Callable[[str], None]) -> None:
    """`run.layers` in the model's order, from fp8_stats' record (`keys.layer_order`): the
    tables, groups, plots and a step's flags (`rules.cast_order`) follow it, and a run reads the
    same from every sink. Without one (a build before LAYER_ORDER_SINCE), the order logged
    where the sink keeps it (`unordered` None: the jsonl logger's file), else by name, numbers
    by value, said once: `unordered` names the sink (W&B's history rows come back with their
    keys in another order each, MLflow keeps none)."""
    order = layer_order(hparams or {})
    if order is None and unordered is None:
        return
    run.in_order(order)
    if order is None and len(run.layers) > 1:  # one layer has no order to lose
        warn(f"{where}: no record of the model's layer order (`{LAYER_ORDER}`, logged by "
             f"fp8_stats from foundry-fp8 builds of {LAYER_ORDER_SINCE} on), and {unordered} "
             "keeps none: layers are listed by name, numbers by value, so a step's flags may "
             "not name the tensor a fault began in first")


GuardSeries = dict[int, dict[str, float]]  # step -> fp8_guard's series logged at it


def _guard_series(records: Iterable[tuple[int, Mapping[str, Any]]],
                  into: GuardSeries) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """`records` unchanged, fp8_guard's numbers copied `into` on the way (one pass)."""
    for step, metrics in records:
        keys = [FALLBACK_LAYERS, FP8_FLOPS_SHARE, *(k for k in metrics
                                                    if k.startswith(IN_FALLBACK_PREFIX))]
        for key in keys:
            value = number(metrics.get(key))
            if value is not None and math.isfinite(value):  # a count, a share
                into.setdefault(step, {})[key] = value
        yield step, metrics


def _mode(path: Path, absent: str) -> int:
    """`path`'s file type and mode (symbolic links followed); ReportError (one line) where it
    has none: `not found (<absent>)`, a link to nothing, a folder we may not search."""
    try:
        return path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise ReportError(f"{path}: a symbolic link to {os.readlink(path)!r}, which does not "
                              "exist") from None
        raise ReportError(f"{path}: not found ({absent})") from None
    except OSError as e:  # a folder we may not search, a loop of links, a name too long
        raise ReportError(f"{path}: cannot read ({e.strerror or e})") from None


#: How a file's first bytes tell a PyTorch checkpoint: a zip archive (torch.save since torch
#: 1.6) or a pickle (protocol 2+ starts with PROTO, 0x80; the legacy format's magic number).
CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")
#: The first bytes of W&B's binary run file (`run-<id>.wandb`): wandb/sdk/internal/datastore.py
#: LEVELDBLOG_HEADER_IDENT.
WANDB_MAGIC = b":W&B"
#: How many folders up from a folder without metrics.jsonl the report looks for the run's (a W&B
#: run folder is `<run>/wandb/offline-run-.../files`).
PARENTS_SEARCHED = 3


def _run_above(path: Path) -> Path | None:
    """The nearest of the folders above `path` (PARENTS_SEARCHED of them) holding metrics.jsonl,
    as the user would type it (relative where `path` was). Absolute first: `.` has no parent."""
    absolute = Path(os.path.normpath(path.absolute()))  # the user's path, links kept
    above = next((parent for parent in absolute.parents[:PARENTS_SEARCHED]
                  if (parent / "metrics.jsonl").is_file()), None)
    if above is not None and not path.is_absolute():
        above = Path(os.path.relpath(above))
    return above


def _head(path: Path) -> bytes | None:
    """The first 4 bytes of a regular file (None where it does not read)."""
    try:
        with path.open("rb") as f:
            return f.read(4)
    except OSError:
        return None


def _not_metrics(path: Path) -> str | None:
    """What the regular file `path` plainly is instead of a metrics file, from its first bytes
    (read before any line is: a checkpoint of gigabytes has no line to read), and where the
    run's metrics file is when a folder above holds it."""
    head = _head(path)
    if head is None:
        return None  # the read itself says why
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # UTF-32's LE starts so too
        return (f"{path}: UTF-16 text (a copy made through PowerShell's `>` or `Out-File` is), "
                "not the UTF-8 the `jsonl` logger writes: report the run's own metrics.jsonl, or "
                "convert this one (iconv -f UTF-16 -t UTF-8)")
    if head.startswith(CHECKPOINT_MAGIC):
        what = f"a {'zip archive' if head.startswith(b'PK') else 'pickle'} (a checkpoint?)"
    elif head == WANDB_MAGIC:
        what = "W&B's binary run file"
    else:
        return None
    above = _run_above(path)
    where = (f"; the run's is in {above}: foundry-fp8 report {above}" if above is not None
             else " in the run folder")
    return f"{path}: {what}, not a metrics file: the report reads the `jsonl` logger's metrics.jsonl{where}"


def _no_metrics_here(folder: Path) -> str:
    """Why a folder without metrics.jsonl is not a run folder, and where the run's is when a
    folder above holds it (a W&B run folder, checkpoints/)."""
    wandb = next(folder.glob("run-*.wandb"), None) or (folder / "files" / "wandb-metadata.json")
    if (folder / "meta.yaml").exists() or folder.name == "mlruns" or (
            folder / "0" / "meta.yaml").exists():  # one with a run is read (report.mlflow_run)
        return (f"{folder}: an MLflow store holding no run (the report reads a run's folder, "
                "mlruns/<experiment id>/<run id>, or the `jsonl` logger's metrics.jsonl)")
    kind = "a W&B run folder" if wandb.exists() else None
    above = _run_above(folder)
    # a `loggers.jsonl.path` of another name, or runs' folders side by side (one per rank/node)
    named = sorted(itertools.islice(itertools.chain(folder.glob("*.jsonl"),
                                                    folder.glob("*/metrics.jsonl")), 100))
    where = (f"; the run's is in {above}: foundry-fp8 report {above}" if above is not None
             else "; add `loggers: {jsonl: {}}` to the YAML" if kind else
             f"; it holds {', '.join(str(p.relative_to(folder)) for p in named[:3])}"
             f"{', ...' if len(named) > 3 else ''}: name one, e.g. foundry-fp8 report "
             f"{named[0]}" if named else " (was the `jsonl` logger in the YAML?)")
    what = f" ({kind}: the report reads the `jsonl` logger's metrics.jsonl)" if kind else ""
    return f"{folder / 'metrics.jsonl'}: not found{what}{where}"


def metrics_file_of(run_folder: Path) -> Path:
    """The metrics file `foundry-fp8 report RUN` reads: RUN itself when a regular file, else
    RUN/metrics.jsonl; ReportError (one line) saying what stands there instead. Nothing is
    opened here but a regular file's first bytes: a FIFO would block the read forever."""
    mode = _mode(run_folder, "no run folder or metrics file there")
    if stat.S_ISREG(mode):
        if (instead := _not_metrics(run_folder)) is not None:
            raise ReportError(instead)
        return run_folder
    if not stat.S_ISDIR(mode):
        raise ReportError(f"{run_folder}: {file_kind(mode)}, not a run folder or a metrics file")
    metrics_file = run_folder / "metrics.jsonl"
    if not (metrics_file.exists() or metrics_file.is_symlink()):
        raise ReportError(_no_metrics_here(run_folder))
    mode = _mode(metrics_file, "was the `jsonl` logger in the YAML?")
    if not stat.S_ISREG(mode):
        raise ReportError(f"{metrics_file}: {file_kind(mode)}, not the run's metrics file")
    return metrics_file


def wandb_files(given: Path) -> list[Path] | None:
    """The `.wandb` files of the W&B offline run `foundry-fp8 report GIVEN` names, oldest
    attempt first: GIVEN's run (a `run-<id>.wandb` file) or the one run under the folder GIVEN
    that holds no metrics.jsonl. Every attempt of a resumed offline run (`resume: allow`, the
    same id) writes its own `offline-run-<time>-<id>` folder, so all of them are the run. None
    where GIVEN names no W&B run; ReportError (one line) for a folder holding several."""
    if given.is_dir():
        if (given / "metrics.jsonl").exists() or (given / "metrics.jsonl").is_symlink():
            return None  # the jsonl logger's file, or what metrics_file_of says about the link
        files = wandb_history.run_files(given)
    elif given.is_file() and given.name.endswith(".wandb"):  # its header W&B's reader's to judge
        files = [given]
    else:
        return None
    ids = sorted({path.name.removeprefix("run-").removesuffix(".wandb") for path in files})
    if len(ids) > 1:
        raise ReportError(f"{given}: {len(ids)} W&B runs ({', '.join(ids[:5])}"
                          f"{', ...' if len(ids) > 5 else ''}): name one run's .wandb file")
    if not ids:
        return None
    wandb_dir = files[-1].parent.parent  # `wandb/`, which holds every attempt's folder
    attempts = sorted(wandb_dir.glob(f"*-{ids[0]}/run-{ids[0]}.wandb"), key=_started)
    return attempts or files  # a run file outside W&B's layout (copied): itself


#: W&B's name for an attempt's folder: `{run_mode}-{timespec}-{run_id}`, run_mode `run` or
#: `offline-run`, timespec its start time as `%Y%m%d_%H%M%S` (wandb 0.18
#: sdk/wandb_settings.py:971 sync_dir, :935 run_mode, :991 timespec, :131 the format).
ATTEMPT_FOLDER = re.compile(r"(?:offline-)?run-(\d{8}_\d{6})-")


def _started(run_file: Path) -> tuple[str, str]:
    """Sort key of an attempt's `.wandb` file: its folder's start time, then its name (an
    online attempt's `run-` folder sorted by name alone came after every `offline-run-` one)."""
    name = run_file.parent.name
    found = ATTEMPT_FOLDER.match(name)
    return (found[1] if found else "", name)


@dataclass
class WandbRead:
    """The attempts' `.wandb` files as W&B's reader reads them, one history row at a time
    (`rows`): a long run's history held as dicts took gigabytes. Each run's config fills in and
    its steps are kept (`steps`) as its rows go by. Where W&B's reader raises on a file (it
    raises whatever its parsers do: an IndexError on bytes after the last record; an OSError
    where the file cannot be read), what it read before counts, as `wandb sync`
    sends each record as it reads it (wandb 0.18 sync/sync.py SyncThread.run), and `raised`
    says why it stopped; `failed` where it read no row of any file (each refused, `unread`, or
    raised at once): then nothing read counts, as for a file not read."""

    runs: list[wandb_history.WandbRun]
    steps: list[list[int]]  # per run, the steps of its history rows read so far
    failed: bool = False
    raised: dict[Path, str] = field(default_factory=dict)  # per file, why W&B's reader stopped

    @classmethod
    def of(cls, files: list[Path]) -> WandbRead:
        return cls([wandb_history.WandbRun(path) for path in files], [[] for _ in files])

    def rows(self, history: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, values) of every history row in order, `_`-keys left out (`history=False`:
        no values, `wandb_history.scan`). A Ctrl-C goes on up, also one an extension module's
        import wrapped in an ImportError (`cli.interrupted_by`): caught here, it was a run W&B
        "cannot read"."""
        outer = sys.exc_info()[1]
        for wandb_run, steps in zip(self.runs, self.steps, strict=True):
            try:
                for row in wandb_history.scan(wandb_run, history):
                    if (step := jsonl.step(row.get("_step"))) is not None:
                        steps.append(step)
                        yield step, {k: v for k, v in row.items() if not k.startswith("_")}
            except Exception as e:  # noqa: BLE001 - W&B's reader raises whatever its parsers do
                if interrupted_by(e, outer):
                    raise
                self.raised[wandb_run.path] = _reader_raised(wandb_run.path, e)
        self.failed |= bool(self.runs) and not any(self.steps) and all(
            r.unreadable is not None or r.path in self.raised for r in self.runs)

    def unread(self) -> list[str]:
        """One line per file whose header W&B's reader refused (`WandbRun.unreadable`), after
        `rows`: it reads nothing of such a file."""
        return [f"{r.path}: {r.unreadable}; W&B's own reader (`wandb sync` too) reads none of it"
                for r in self.runs if r.unreadable is not None]

    def stopped(self) -> list[str]:
        """One line per file W&B's reader raised on (`raised`), after `rows`: where it stopped."""
        return [f"{r.path}: W&B's own reader (`wandb sync` too) stops with {self.raised[r.path]}"
                + (f" after {len(steps)} history row(s), up to step {steps[-1]}" if steps else
                   ", having read no history row")
                for r, steps in zip(self.runs, self.steps, strict=True) if r.path in self.raised]

    def config(self) -> dict[str, Any] | None:
        """The attempts' config (`attempts_config`), their values left unread; None where W&B's
        reader cannot read them."""
        for _ in self.rows(history=False):
            pass
        return None if self.failed else attempts_config(self)


def _reader_raised(path: Path, error: Exception) -> str:
    """What W&B's reader raised on `path`, for a line: what stands there where it is no regular
    file (a FIFO). A file it may not open read-write is read from a private copy
    (`wandb_history.NOT_WRITABLE`): an OSError's own words say why that failed too."""
    why = error.strerror if isinstance(error, OSError) and error.strerror else error
    said = f"{type(error).__name__}: {why}"
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):
        return f"{said} ({file_kind(mode)}, not a run file)"
    return said


def load_wandb(given: Path, files: list[Path], warn: Callable[[str], None],
               losses: dict[int, float] | None = None, dumps: list[str] | None = None
               ) -> tuple[RunMetrics, GuardSeries, dict[str, Any]]:
    """The run's per-layer FP8 metrics, fp8_guard's series and the hyperparameters (its config)
    as W&B's own reader reads them from the attempts' `.wandb` files (`wandb_files(given)`), in
    order, once: what `wandb sync` uploads. Where they hold no FP8 statistics (W&B was not
    logging them, a file W&B's reader does not read), ReportError (one line) saying where the
    run's metrics.jsonl is, when a folder above holds it. `dumps` gets each attempt's
    `paths.DUMP_FOLDER_KEY`, latest first: the merged config keeps the latest attempt's alone,
    and an earlier attempt's dumps are in the folder it recorded."""
    read = WandbRead.of(files)
    guard: GuardSeries = {}
    older: dict[int, str] = {}
    run, restarts = _read(read.rows(), guard, losses, older)
    unread = read.unread()
    if len(unread) == len(files) and (given.is_file() or _run_above(given) is None):
        raise ReportError(unread[0])  # else: where the metrics.jsonl is (below)
    if read.failed and read.raised and (given.is_file() or _run_above(given) is None):
        raise ReportError(read.stopped()[0])  # else: where the metrics.jsonl is (below)
    if read.failed:  # as if no file was read
        run, restarts, read = RunMetrics(), [], WandbRead([], [])
        guard.clear()
        older.clear()
        if losses is not None:
            losses.clear()
    if restarts:
        warn(_restarts_said(files[-1], restarts))
    for said in unread if len(unread) < len(files) else ():
        warn(f"{said}; the report covers the other attempts")
    for said in read.stopped():
        warn(f"{said}; the report covers what it read")
    for said in map(_joined_said, read.runs):
        if said is not None:
            warn(said)
    ended = [r.complete or r.unreadable is not None or r.path in read.raised for r in read.runs]
    live = read.runs[-1] if read.runs and not ended[-1] else None
    if older:  # before a folder above's metrics.jsonl, which may be another run's
        if not run.values:
            raise NoStatistics(_older_said(given, older))
        if said := _older_said(given, older, run):
            warn(said)
    config = attempts_config(read)
    if dumps is not None:
        dumps[:] = recorded_dump_folders(r.config.get(DUMP_FOLDER_KEY) for r in read.runs[::-1])
    for wandb_run, steps, later, done in zip(read.runs[:-1], read.steps, read.steps[1:], ended,
                                             strict=False):
        if not done:
            warn(_killed_said(wandb_run.path, steps, later))
    shown = set(run.steps)
    for path in files:  # a row W&B dropped is in no .wandb file: only its own log says so
        if dropped := [s for s in wandb_history.dropped_steps(path) if s not in shown]:
            said = _dropped_said(path, dropped, config)
            if not run.values:
                raise NoStatistics(f"{given}: no FP8 statistics reached W&B: {said}")
            warn(f"{said}; the report covers the steps W&B kept, {run.steps[0]} to "
                 f"{run.steps[-1]}")
    if live is not None:  # W&B writes the exit record last (wandb.finish)
        rows = read.steps[-1]
        read_rows = f"{len(rows)} history row(s) read, up to step {max(rows)}" if rows else (
            "no history row read")
        unfinished = (f"{live.path}: damaged at byte {live.damaged_at} of "
                      f"{live.path.stat().st_size}, with more written after it: W&B's own reader "
                      f"(`wandb sync` too) stops there; {read_rows}"
                      if live.damaged_at is not None else
                      f"{live.path}: no exit record yet: the run is still being written (or was "
                      f"killed, or its disk filled); {read_rows}")
        if not run.values and _run_above(given) is None:  # else: where the metrics.jsonl is
            raise NoStatistics(f"{unfinished}, no FP8 statistics among them yet (fp8_stats logs "
                               "from its first `interval`)")
        if run.values:
            warn(f"{unfinished}; the report covers what was read, up to step {run.steps[-1]}")
    if not run.values and given.is_dir() and read.runs and _run_above(given) is None:
        raise NoStatistics(_wandb_empty(files[-1], config, sum(map(len, read.steps))))
    if not run.values:
        raise NoStatistics(_no_metrics_here(given) if given.is_dir() else
                           _not_metrics(given) or f"{given}: no FP8 statistics")
    return run, guard, config


def _wandb_empty(path: Path, config: Mapping[str, Any], rows: int) -> str:
    """Why a W&B run read whole holds no per-layer FP8 series, from its config (LLM-Foundry logs
    the run's YAML there), as `why_empty` says it of a metrics file: not that a metrics.jsonl is
    missing, which the report does not need."""
    said = f"{path}: {rows} history row(s) read with W&B's reader, no FP8 statistics"
    options = _fp8_stats_options(config)
    if config and options is None:
        return (f"{said}: the run had no `fp8_stats` callback (add `callbacks: {{fp8_stats: {{}}}}` "
                "to the YAML)")
    if options is not None:
        return (f"{said}: fp8_stats ran but logged no layer (callbacks.fp8_stats.layers: "
                f"{options.get('layers', '.*')!r} matched nothing, or the run ended before its "
                "first logging step)")
    return f"{said} (`{LAYOUT}` series): was `fp8_stats` in the YAML?"


def _joined_said(wandb_run: wandb_history.WandbRun) -> str | None:
    """One line on a run file joined from several (`WandbRun.joined`): W&B writes each attempt
    of a run to a file of its own."""
    if (other := wandb_run.joined) is None:
        return None
    if other != wandb_run.run_id:
        return (f"{wandb_run.path}: the records of run {other!r} follow those of run "
                f"{wandb_run.run_id!r} in this file (W&B writes one run per file: it was joined "
                "from several); the "
                f"report covers run {wandb_run.run_id!r} alone, report {other!r} from its own "
                "file")
    return (f"{wandb_run.path}: another attempt of run {other!r} follows its exit record in "
            "this file (W&B writes each attempt to a file of its own: it was joined); read as a "
            "later attempt, as `wandb sync` sends it")


def _killed_said(path: Path, steps: list[int], later: list[int]) -> str:
    """One line on an attempt with no exit record that a later one follows (killed): the steps
    after its last row in W&B, before the later attempt's first, are in neither file."""
    read = f"its rows up to step {steps[-1]}" if steps else "no history row"
    said = (f"{path}: no exit record, and a later attempt follows: killed; W&B holds {read}, the "
            f"next attempt logs from step {later[0]}" if later else
            f"{path}: no exit record, and a later attempt follows: killed; W&B holds {read}")
    after = steps[-1] + 1 if steps else 0
    if later and later[0] > after:
        said += (f"; steps {after} to {later[0] - 1} are in no attempt's W&B file (the run's "
                 "metrics.jsonl, where a `jsonl` logger wrote one, holds them)")
    return said


def _dropped_said(path: Path, dropped: list[int], config: Mapping[str, Any]) -> str:
    """One line on the history rows W&B dropped from the attempt `path` and where their FP8
    statistics are: the run's `jsonl` file, if it had one (in the older key layout where an
    older build logged it, which the report of that build reads)."""
    shown = ", ".join(map(str, dropped[:8])) + (", ..." if len(dropped) > 8 else "")
    loggers = config.get("loggers")
    jsonl_options = loggers.get("jsonl") if isinstance(loggers, Mapping) else None
    where = "no `jsonl` logger in its config holds them either"
    if isinstance(jsonl_options, Mapping):
        named = jsonl_options.get("path")
        where = (f"the run's `jsonl` logger file holds them (loggers.jsonl.path: {named!r}, "
                 "relative to the working directory the run started in, for older builds)"
                 if isinstance(named, str) else "the run's `jsonl` logger file holds them")
        where += (f": this report reads it, or where its keys are in the older layout "
                  f"({OLDER_LAYOUT}), the report of foundry-fp8 at commit {OLDER_LAYOUT_LAST} "
                  "or earlier does")
    return (f"{path}: W&B dropped the history rows of {len(dropped)} step(s), {shown} (its "
            f"{path.parent.name}/logs/debug-internal.log: "
            f"\"{wandb_history.DROPPED_ROW.decode()}\", a row logged below the current step, as "
            f"fp8_stats of older foundry-fp8 builds did); {where}")


#: fp8_guard's records among the hyperparameters: each decided at its `step`.
GUARD_RECORDS = (FALLBACK_PREFIX, REPROMOTION_PREFIX, REFUSED_PREFIX, OLDER_PREFIX)


def attempts_config(read: WandbRead) -> dict[str, Any]:
    """The attempts' configs merged, the latest attempt's value of each key winning, less
    fp8_guard's records an earlier attempt decided at or after the step a later one logs from
    again (`_attempts`): that attempt died and the run went on from its checkpoint without them
    (a restored fallback the later attempt logs again)."""
    config: dict[str, Any] = {}
    last = -1
    for wandb_run, steps in zip(read.runs, read.steps, strict=True):
        if steps and steps[0] < last:
            config = {key: value for key, value in config.items()
                      if not (key.startswith(GUARD_RECORDS) and isinstance(value, Mapping)
                              and (step := number(value.get("step"))) is not None
                              and step >= steps[0])}
        config.update(wandb_run.config)
        last = steps[-1] if steps else last
    return config


def load_run(metrics_file: Path, warn: Callable[[str], None],
             losses: dict[int, float] | None = None) -> tuple[RunMetrics, GuardSeries]:
    """The run's per-layer FP8 metrics and fp8_guard's series from `metrics_file` (a regular
    file: `metrics_file_of`), its training loss into `losses` where given; ReportError (one
    line) when there are no FP8 metrics, saying why. Undecodable lines (a run killed mid-write
    leaves one) are skipped with one warning; a file that grew while read (the run is live)
    is one warning too."""
    skipped: list[int] = []
    too_long: list[int] = []
    cut: list[int] = []  # the last line read, unfinished (no newline): `read_jsonl`
    causes: dict[int, str] = {}  # skipped lines no crash leaves, and why: `read_jsonl`
    guard: GuardSeries = {}
    older: dict[int, str] = {}
    doubled = Doubled()
    try:
        size = metrics_file.stat().st_size
        if size == 0:
            raise ReportError(f"{metrics_file}: empty (did the run log anything?)")
        run, restarts = _read(_doubled_into(read_jsonl(metrics_file, skipped, too_long, cut,
                                                       causes),
                                            doubled), guard, losses, older)
        grown = metrics_file.stat().st_size - size
    except JsonlError as e:
        raise ReportError(json_document(metrics_file) or _not_metrics(metrics_file) or str(e)
                          ) from None
    except OSError as e:
        raise ReportError(f"{metrics_file}: cannot read ({e.strerror or e})") from None
    if grown > 0:  # one statement: the unfinished last line read is the one being written
        read = f"up to step {run.steps[-1]}" if run.steps else "no FP8 statistics"
        said = ""
        if cut:
            skipped.remove(cut[0])  # not a crash's: said here, not in the warning below
            said = f" (line {cut[0]}, not finished when read, skipped)"
        warn(f"{metrics_file}: grew by {grown:,} bytes while the report read it: the run is "
             f"still writing it; the report covers what was read{said}, {read}")
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        lines = "1 line that does" if len(skipped) == 1 else f"{len(skipped)} lines that do"
        named = "; ".join(f"line {n}: {causes[n]}" for n in [n for n in skipped if n in causes][:3])
        why = "a run killed mid-write leaves one"
        if all(n in causes for n in skipped):  # no crash's: each says its own cause
            shown, why = named, ""
        elif named:
            why += f"; {named}"
        elif skipped == cut:  # the file as read ended in it (a copy synced mid-write)
            why = ("the file's last line, not finished: the run is still writing it, was "
                   "killed mid-write, or its disk filled")
        if too_long:
            which = (f"line {too_long[0]} is" if len(too_long) == 1 else
                     f"{len(too_long)} of them (from line {too_long[0]}) are")
            why += (f"; {which} longer than {jsonl.MAX_LINE_BYTES:,} bytes, left unread: a power "
                    "loss can leave a run of NUL bytes")
        said = f"line {shown}; {why}" if why else shown
        warn(f"{metrics_file}:{skipped[0]}: skipped {lines} not decode ({said}); the report "
             "covers the rest")
    if restarts:
        warn(_restarts_said(metrics_file, restarts))
    if doubled.in_a_row:
        warn(_doubled_said(metrics_file, doubled))
    if older and run.values and (said := _older_said(metrics_file, older, run)):
        warn(said)
    if not run.values:
        raise NoStatistics(_older_said(metrics_file, older) if older else why_empty(metrics_file))
    return run, guard


def _losses_into(records: Iterable[tuple[int, Mapping[str, Any]]], into: dict[int, float]
                 ) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """`records` unchanged, each one's training loss (`LOSS`) copied `into` on the way: what
    `--baseline` compares, taken in the pass that reads the metrics (a second read of a large
    file cost seconds, and of a file still growing, other steps than the report's)."""
    for step, metrics in records:
        if (value := number(metrics.get(LOSS))) is not None:
            into[step] = value
        yield step, metrics


def _drop_from(logged: dict[int, Any], step: int) -> None:
    """Forget what `logged` holds from `step` on: a later attempt logs it again."""
    for later in [s for s in logged if s >= step]:
        del logged[later]


def losses_of(records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[int, float]:
    """step -> training loss of `records`, a later attempt's replacing what earlier ones logged
    from its first step on, as the report's metrics are (`_attempts`)."""
    losses: dict[int, float] = {}
    for _ in _losses_into(_attempts(records, lambda _, step: _drop_from(losses, step)), losses):
        pass
    return losses


def _read(records: Iterable[tuple[int, Mapping[str, Any]]], guard: GuardSeries,
          losses: dict[int, float] | None = None, older: dict[int, str] | None = None
          ) -> tuple[RunMetrics, list[tuple[int, int]]]:
    """The per-layer metrics of `records` (fp8_guard's series copied into `guard`, the training
    loss into `losses` where given, step -> a key of OLDER_LAYOUT into `older`), each later
    attempt of the run replacing what earlier ones logged from its first step on (`_attempts`);
    also where the steps went back, (before, after)."""
    restarts: list[tuple[int, int]] = []
    run = RunMetrics()
    losses = {} if losses is None else losses
    older = {} if older is None else older

    def restarted(before: int, step: int) -> None:
        restarts.append((before, step))
        run.drop_from(step)
        _drop_from(guard, step)
        _drop_from(losses, step)
        _drop_from(older, step)

    collect(_losses_into(_guard_series(_older_into(_attempts(records, restarted), older), guard),
                         losses), run)
    return run, restarts


def _older_into(records: Iterable[tuple[int, Mapping[str, Any]]], into: dict[int, str]
                ) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """`records` unchanged, the steps holding a per-layer key of OLDER_LAYOUT noted `into` (with
    one such key): a run a build before OLDER_LAYOUT_UNTIL began and a later one resumed holds both
    layouts, and the steps of the older one are not read."""
    for step, metrics in records:
        key = next((k for k in metrics if k.count("/") >= 3 and older_layout(k)), None)
        if key is not None:
            into.setdefault(step, key)
        yield step, metrics


def _older_said(where: Path, older: dict[int, str], run: RunMetrics | None = None) -> str:
    """One line on the steps logged in OLDER_LAYOUT, which this report does not read (all of
    them, or those `run` lacks), and what does: a post-mortem cannot train again."""
    steps = sorted(older)
    said = (f"{where}: FP8 statistics in an older key layout ({OLDER_LAYOUT}, e.g. "
            f"`{older[steps[0]]}`, from foundry-fp8 builds before {OLDER_LAYOUT_UNTIL})")
    reader = (f"the report of the build that logged them reads them (foundry-fp8 at commit "
              f"{OLDER_LAYOUT_LAST} or earlier, installed in another environment)")
    if run is None:
        return (f"{said}; this report (foundry-fp8 {__version__}) reads {LAYOUT} series only: "
                f"{reader}")
    read = set(run.steps)
    unread = [s for s in steps if s not in read]
    return (f"{said} at {len(unread)} logging step(s), {unread[0]} to {unread[-1]}, are not read:"
            f" this report covers the {LAYOUT} series only, steps {run.steps[0]} to "
            f"{run.steps[-1]}; {reader}") if unread else ""


def _attempts(records: Iterable[tuple[int, Mapping[str, Any]]],
              restarted: Callable[[int, int], None]) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """`records`, `restarted(before, step)` called ahead of each whose step is below the one
    before it: a later attempt of the run begins there (a resume from a checkpoint logs the
    steps after it again, `fit()` again with `reset_time` logs from 0). The jsonl logger appends
    every attempt to one file; the report, as W&B's history does, keeps for each step what the
    latest attempt that reached it logged, and nothing of a dead attempt after it."""
    last = -1
    for step, metrics in records:
        if step < last:
            restarted(last, step)
        last = step
        yield step, metrics


#: Step changes a warning lists (the rest are counted).
RESTARTS_SHOWN = 5


def _restarts_said(metrics_file: Path, restarts: list[tuple[int, int]]) -> str:
    """One line on where the steps went back (each a later attempt of the run)."""
    shown = ", ".join(f"{a} -> {b}" for a, b in restarts[:RESTARTS_SHOWN]) + (
        f", ... ({len(restarts) - RESTARTS_SHOWN} more)" if len(restarts) > RESTARTS_SHOWN else "")
    times = "once" if len(restarts) == 1 else f"{len(restarts)} times"
    return (f"{metrics_file}: the steps go back {times} (step {shown}): a resumed run logs the "
            "steps after its checkpoint again, fit() again with reset_time logs from step 0; from "
            "each such step on, the report keeps the later attempt's numbers only")


#: Series one writer logs once at a step: Composer's training loss (every batch) and
#: fp8_stats' count of flagged layers (every logging step).
ONCE_A_STEP = (LOSS, summary_key(None, "flagged_layers"))


@dataclass
class Doubled:
    """The steps at which a series of ONCE_A_STEP was logged twice in one attempt (no step going
    back between), in file order, and whether it was at two of its steps in a row. A resume at
    the step its dead attempt logged last logs that one step twice (a crash loop resumed at one
    checkpoint, that step again); two runs writing one file at once log every step they share
    twice: the `jsonl` logger's flock keeps a second out, but not where the file system takes
    no flock (logged at INFO) or takes it per host (Lustre's `localflock`)."""

    steps: list[int] = field(default_factory=list)
    in_a_row: bool = False


def _doubled_into(records: Iterable[tuple[int, Mapping[str, Any]]], into: Doubled
                  ) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """`records` unchanged, where a series of ONCE_A_STEP was logged twice noted `into`."""
    last: dict[str, tuple[int, bool, bool]] = {}  # key: its last step, twice there, and before
    for step, metrics in records:
        for key in ONCE_A_STEP:
            if key not in metrics:
                continue
            at, twice, before = last.get(key, (-1, False, False))
            if step != at:
                last[key] = (step, False, step > at and twice)  # a step back: a new attempt
            elif not twice:
                last[key] = (step, True, before)
                into.in_a_row |= before
                if not into.steps or into.steps[-1] != step:
                    into.steps.append(step)
        yield step, metrics


def _doubled_said(metrics_file: Path, doubled: Doubled) -> str:
    """One line on two runs' records mixed in one file."""
    steps = sorted(set(doubled.steps))
    shown = ", ".join(map(str, steps[:RESTARTS_SHOWN])) + (
        f", ... ({len(steps) - RESTARTS_SHOWN} more)" if len(steps) > RESTARTS_SHOWN else "")
    return (f"{metrics_file}: steps {shown} each hold two records of the series a run logs once "
            f"a step ({' or '.join(ONCE_A_STEP)}): two runs wrote this file at once (the same run "
            "name started twice, on a file system where the `jsonl` logger's flock does not keep "
            "the second out); at each such step the report keeps the record read last, of "
            "either run: give each run its own run name or `loggers.jsonl.path`")


def json_document(path: Path) -> str | None:
    """Why `path`, which read_jsonl refused, is one JSON document over several lines (a
    hparams.json, W&B's or MLflow's JSON), when it is one: its lines read one by one are no
    records, which says less."""
    try:
        if path.stat().st_size > MAX_HPARAMS_BYTES:
            return None
        data = path.read_bytes()
        json.loads(data)
    except (OSError, ValueError, RecursionError):  # not JSON as a whole either
        return None
    lines = len(data.strip().splitlines())
    if lines < 2:
        return None  # one line: read_jsonl's message names what it holds
    return (f"{path}: one JSON document over {lines} lines, not the JSON Lines metrics file "
            '(a {"step": ..., "metrics": {...}} record a line) the `jsonl` logger writes as '
            "metrics.jsonl")


@dataclass(frozen=True)
class GuardRun:
    """What fp8_guard logged in a run."""

    series: GuardSeries
    fallbacks: list[Fallback]  # in step order
    exclude: str | None  # te_swap's own `exclude` (hparams.json), kept in the static YAML
    repromotions: tuple[Repromotion, ...] = ()  # in step order
    refusals: tuple[Refusal, ...] = ()  # the budget's, in step order
    # layers an earlier attempt moved that were in fallback when the later attempt the report
    # shows began, at step `carried[0]` (`carried_fallbacks`)
    carried: tuple[int, tuple[str, ...]] | None = None
    # each layer's summarised pairs whose records the hyperparameters lack, counted (`pairs`)
    summaries: tuple[Summary, ...] = ()

    def decided(self, f: Fallback) -> int:
        """The step a fallback took effect after, in the attempt the report shows: a carried
        one's (its record's step is an earlier attempt's) the one before that attempt's first."""
        if self.carried is not None and f.layer in self.carried[1]:
            return self.carried[0] - 1
        return f.step

    def spans(self) -> list[tuple[str, int, int | None]]:
        """(layer, the step that decided a fallback, the step of the re-promotion that ended it
        or None) per fallback, in step order: the layer ran in high precision at the steps after
        the first, up to and including the second."""
        return [(f.layer, start, next((r.step for r in self.repromotions
                                       if r.layer == f.layer and r.step > start), None))
                for f in self.fallbacks for start in [self.decided(f)]]

    @property
    def kept(self) -> list[str]:
        """The layers in fallback at the end: their last record is a fallback."""
        last: dict[str, tuple[int, bool]] = {}
        for event in sorted([(f.step, f.layer, True) for f in self.fallbacks]
                            + [(r.step, r.layer, False) for r in self.repromotions]):
            last[event[1]] = (event[0], event[2])
        return sorted(layer for layer, (_, fallen) in last.items() if fallen)

    def _logged(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of one of fp8_guard's series, in step order."""
        return [(s, self.series[s][key]) for s in sorted(self.series) if key in self.series[s]]

    @property
    def fp8_share(self) -> tuple[float, float] | None:
        """The FP8 share of the linear-GEMM FLOPs at the first and the last logging step."""
        shares = self._logged(FP8_FLOPS_SHARE)
        return (shares[0][1], shares[-1][1]) if shares else None

    @property
    def in_fallback(self) -> int:
        """Layers in fallback at the last logging step (the series)."""
        counts = self._logged(FALLBACK_LAYERS)
        return int(counts[-1][1]) if counts else len(self.kept)

    @property
    def unrecorded(self) -> tuple[int, float, float] | None:
        """(first step, most, last) of the series `fp8/guard/fallback_layers` where it counts
        layers in fallback but hparams.json holds no fallback record (a logger that failed, a
        cut hparams.json): then the series is all the report knows. None otherwise."""
        counts = self._logged(FALLBACK_LAYERS)
        fallen = [(s, n) for s, n in counts if n >= 1]
        if self.fallbacks or not fallen:
            return None
        return fallen[0][0], max(n for _, n in fallen), counts[-1][1]


def carried_fallbacks(series: GuardSeries, fallbacks: list[Fallback], since: int | None,
                      where: Path, warn: Callable[[str], None]
                      ) -> tuple[int, tuple[str, ...]] | None:
    """(first logging step, layers) of the fallbacks an earlier attempt decided that the later
    attempt from step `since` (`RunMetrics.later_attempt`) began with: `fit()` again with
    `reset_time` keeps them but their records keep the first fit's steps, which the later fit
    logs again, so the report marked the layer FP8 until that step number came round. The
    records carry no attempt; the series `fp8/guard/fallback_layers` at the later attempt's
    first logging step counts the layers in fallback then: where that count exceeds the records
    decided by that step by as many as there are records of later steps, those are the ones.
    Otherwise (a later attempt moved more layers too) which they are is unknown: one warning."""
    first = next((s for s in sorted(series) if since is not None and s >= since
                  and FALLBACK_LAYERS in series[s]), None)
    if first is None:
        return None
    before = {f.layer for f in fallbacks if f.step <= first}
    later = sorted({f.layer for f in fallbacks if f.step > first} - before)
    extra = round(series[first][FALLBACK_LAYERS]) - len(before)
    if extra <= 0 or not later:
        return None
    if extra != len(later):
        warn(f"{where}: the steps went back to {since} with {extra} layer(s) in fallback "
             f"(`{FALLBACK_LAYERS}` at step {first}) whose records' steps are later: "
             f"{extra} of {', '.join(later)}, which ones the records do not say; the report "
             "marks each from its record's step")
        return None
    return first, tuple(later)


def guard_run(series: GuardSeries, hparams: Mapping[str, Any] | None, where: Path,
              warn: Callable[[str], None], since: int | None = None) -> GuardRun | None:
    """fp8_guard's series and the fallbacks it logged as hyperparameters; None when the run
    had no fp8_guard. A fallback record that does not read is left out with a warning.
    `since`: the step a later attempt logged from (`carried_fallbacks`)."""
    hparams = hparams or {}
    fallbacks: list[Fallback] = []
    repromotions: list[Repromotion] = []
    refusals: list[Refusal] = []
    summaries: list[Summary] = []
    kinds: list[tuple[str, Any, list, str]] = [
        (FALLBACK_PREFIX, Fallback, fallbacks, "fallback"),
        (REPROMOTION_PREFIX, Repromotion, repromotions, "re-promotion"),
        (REFUSED_PREFIX, Refusal, refusals, "refusal"),
        (OLDER_PREFIX, Summary, summaries, "summary")]
    for key, value in hparams.items():
        kind = next((k for k in kinds if key.startswith(k[0])), None)
        if kind is None:
            continue
        try:
            kind[2].append(kind[1].from_dict(value))
        except (TypeError, ValueError):
            warn(f"{where}: key {key!r}: not an fp8_guard {kind[3]} record; left out")
    # a layer the series covers has every span of the steps shown there. Otherwise (a run
    # logged before the series) a layer's latest summary counts all its older pairs; their
    # records, logged when decided, stay wherever the hyperparameters still hold them
    # (hparams.json, W&B and MLflow keep every key), and count as read. After the latest fold the layer has the summary's pairs, its
    # last KEPT_DECISIONS pairs and at most one open fallback: the summary stands only for the
    # pairs whose records are missing (a resumed run's own W&B run gets the kept ones again).
    # Steps restart after `fit(reset_time=True)`, so no step says which record a summary counted.
    fallbacks, repromotions, covered = _from_series(series, fallbacks, repromotions, hparams)
    latest = {s.layer: s for s in sorted(summaries, key=lambda s: s.pairs)
              if s.layer not in covered}  # the series has each span of those
    missing = []
    for layer, summary in latest.items():
        fell = sum(f.layer == layer for f in fallbacks)
        back = sum(r.layer == layer for r in repromotions)
        lacking = summary.pairs + KEPT_DECISIONS + max(fell - back, 0) - fell
        if lacking > 0:
            missing.append(replace(summary, pairs=min(lacking, summary.pairs)))
    callbacks = hparams.get("callbacks")
    configured = isinstance(callbacks, Mapping) and "fp8_guard" in callbacks
    if not (series or fallbacks or configured):
        return None
    return GuardRun(series, sorted(fallbacks, key=lambda f: (f.step, f.layer)),
                    swap_exclude(hparams),
                    tuple(sorted(repromotions, key=lambda r: (r.step, r.layer))),
                    tuple(sorted(refusals, key=lambda r: (r.step, r.layer))),
                    carried_fallbacks(series, fallbacks, since, where, warn),
                    tuple(sorted(missing, key=lambda s: (s.step, s.layer))))


#: the reason a span has where only the series `IN_FALLBACK_PREFIX<layer>` tells it
UNLOGGED = (f"no record in the hyperparameters (fp8_guard logs a layer's first {KEPT_DECISIONS} "
            f"fallbacks only); steps from `{IN_FALLBACK_PREFIX}<layer>`")


def _from_series(series: GuardSeries, fallbacks: list[Fallback],
                 repromotions: list[Repromotion], hparams: Mapping[str, Any]
                 ) -> tuple[list[Fallback], list[Repromotion], set[str]]:
    """The fallbacks and re-promotions, those of each layer the series
    `IN_FALLBACK_PREFIX<layer>` covers taken from it (1 from the logging step that decided a
    fallback, 0 from its re-promotion's): fp8_guard logs a layer's first KEPT_DECISIONS pairs
    only, and after `fit(reset_time=True)` an earlier fit's records share the later one's step
    numbers. A record of the same layer and step gives a span its details; a layer in fallback
    at the first logging step shown ran so from there: decided there, at its latest record
    before that no re-promotion before ends, or (no such record) before. Also returns the
    layers the series covers. A run a build before the series (897d697) began and this one
    resumed: its rows before the first holding any `IN_FALLBACK_PREFIX` key say nothing of a
    layer, so there its records stand, as for a run logged before the series. Told by one of
    them counting a layer in fallback (this build logs the series of each layer in fallback)
    or a record between the last of them and the first with the series (its rows lost: a
    killed attempt's in W&B); else they are this build's rows before its first fallback."""
    steps = sorted(s for s in series if FALLBACK_LAYERS in series[s])
    first = next((i for i, s in enumerate(steps)
                  if any(key.startswith(IN_FALLBACK_PREFIX) for key in series[s])), 0)
    if first and not (any(series[s][FALLBACK_LAYERS] >= .5 for s in steps[:first]) or any(
            steps[first - 1] < f.step < steps[first] for f in fallbacks)):
        first = 0
    older, steps = steps[:first], steps[first:]
    covered = {key.removeprefix(IN_FALLBACK_PREFIX) for s in steps for key in series[s]
               if key.startswith(IN_FALLBACK_PREFIX)}
    options = hparams.get("callbacks")
    options = options.get("fp8_guard") if isinstance(options, Mapping) else None
    after = options.get("repromote_after") if isinstance(options, Mapping) else None
    healthy = next((r.healthy_steps for r in repromotions), after if isinstance(after, int) else 0)
    fell = [f for f in fallbacks if f.layer not in covered]
    back = [r for r in repromotions if r.layer not in covered]
    for layer in sorted(covered):
        records = {f.step: f for f in fallbacks if f.layer == layer}
        ends = {(r.step, r.fallen_at): r for r in repromotions if r.layer == layer}
        share = next(iter(records.values())).flops_share if records else math.nan
        start: int | None = None
        # a resumed run's own hparams.json or W&B run gets the kept records again at its start:
        # the fallback open there is the latest one decided before with no re-promotion before
        before = [f for f in records.values() if f.step < steps[0]]
        opened = max(before, key=lambda f: f.step) if before else None
        if opened is not None and any(at < steps[0] and fallen_at == opened.step
                                      for at, fallen_at in ends):
            opened = None
        if older:  # the records of the steps the series does not cover
            at_first = series[steps[0]].get(IN_FALLBACK_PREFIX + layer, 0) >= .5
            fell.extend(f for f in before if not (at_first and f is opened))
            back.extend(r for (at, _), r in ends.items() if at < steps[0] or (
                at == steps[0] and not at_first))
            if opened is not None and not at_first and (steps[0], opened.step) not in ends:
                back.append(Repromotion(layer, steps[0], opened.step, healthy))
        for step in [*steps, None]:
            fallen = step is not None and series[step].get(IN_FALLBACK_PREFIX + layer, 0) >= .5
            if fallen and start is None:
                start = step
                if step in records or step != steps[0]:
                    decided = step
                else:
                    decided = opened.step if opened is not None else step - 1
                fell.append(records.get(decided) or Fallback(layer, decided, share, (UNLOGGED,)))
            elif not fallen and start is not None:
                if step is not None:
                    decided = fell[-1].step
                    back.append(ends.get((step, decided))
                                or Repromotion(layer, step, decided, healthy))
                start = None
    return fell, back, covered


def mark_high_precision(run: RunMetrics, guard: GuardRun | None) -> None:
    """Mark (`HIGH_PRECISION`) each row logged while fp8_guard ran its layer in high precision:
    its numbers are fp8_stats' what-if casts, which the heatmaps hatch and the tables name."""
    if guard is None:
        return
    tensors: dict[str, set[str]] = {}
    for layer, tensor, _ in run.values:
        tensors.setdefault(layer, set()).add(tensor)
    for layer, decided, ended in guard.spans():
        for step in run.steps:
            if decided < step and (ended is None or step <= ended):
                for tensor in tensors.get(layer, ()):
                    run.add(step, layer, tensor, HIGH_PRECISION, 1.0)


#: The summary series that count flagged layers (`fp8/flagged_layers`, `fp8/<tensor>/...`).
COUNTED = ("flagged_layers", "nonfinite")


def _summaries_only(metrics_file: Path) -> str | None:
    """Why a metrics file holding fp8_stats' summary series but no per-layer one has no report,
    and where the summaries first count a flagged layer: "fp8_stats logged no layer" said of a
    run whose `fp8/flagged_layers` counted them was wrong, and the step is what the on-call
    reader of such a file is after."""
    counted = {summary_key(tensor, name) for tensor in (None, *TENSORS) for name in COUNTED}
    seen, first = False, None
    for step, metrics in read_jsonl(metrics_file):
        for key, value in metrics.items():
            if key.startswith(f"{SUMMARY_PREFIX}/") and key.rpartition("/")[2] in SUMMARIES:
                seen = True
                if key in counted and (v := number(value)) is not None and v > 0 and (
                        first is None or step < first[0]):
                    first = (step, key, v)
    if not seen:
        return None
    said = (f"; they first count a flagged layer at step {first[0]} ({first[1]} {first[2]:g})"
            if first is not None else "; they count no flagged layer")
    return (f"{metrics_file}: only fp8_stats' summary series (`{summary_key('<tensor>', '...')}`"
            f"{said}), no per-layer series ({LAYOUT}) to say which layer: the report needs those "
            "(were they left out of what was logged or copied?)")


def why_empty(metrics_file: Path) -> str:
    """Why a metrics file holds no per-layer FP8 series (in no older layout, `_older_said`):
    only summaries, no fp8_stats in the run, or it ran and watched nothing."""
    if (summaries := _summaries_only(metrics_file)) is not None:
        return summaries
    hparams = read_hparams(hparams_of(metrics_file))  # metrics.1.jsonl: hparams.1.json
    if hparams is not None and _fp8_stats_options(hparams) is None:
        return (f"{metrics_file}: no FP8 statistics: the run had no `fp8_stats` callback (add "
                "`callbacks: {fp8_stats: {}}` to the YAML)")
    if hparams is not None:
        layers = _fp8_stats_options(hparams).get("layers", ".*")  # type: ignore[union-attr]
        return (f"{metrics_file}: no FP8 statistics: fp8_stats ran but logged no layer "
                f"(callbacks.fp8_stats.layers: {layers!r} matched nothing, or the run ended "
                "before its first logging step)")
    return f"{metrics_file}: no FP8 statistics (`{LAYOUT}` series): was `fp8_stats` in the YAML?"


#: fp8_stats' dumps: the folder it records (`paths.DUMP_FOLDER_KEY`; before that record,
#: `dump_folder`, default paths.DUMP_FOLDER, in the run folder: composer/stats.py, `_fit_start`)
#: holds `step<7 digits>-rank<r>.safetensors` (monitor.py, _write_dump) of `<module name>/<tensor>`
#: keys.
DUMP_FILES = "step{step:07d}-rank*.safetensors"
#: A safetensors header is read, never a tensor: its length is 8 bytes little-endian, then JSON.
MAX_DUMP_HEADER = 16 * 2**20


def _dumped_keys(path: Path) -> set[str]:
    """The tensor names a safetensors file holds, from its header alone (none where it does not
    read: a dump cut short)."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size <= MAX_DUMP_HEADER else {}
    except (OSError, ValueError):
        return set()
    return set(header) if isinstance(header, dict) else set()


def recorded_dump_folders(values: Iterable[Any]) -> list[str]:
    """The `paths.DUMP_FOLDER_KEY` values among `values` (one per attempt, latest first) that name
    a folder, each once; a logger's other types, empty text or a NUL (no path) left out."""
    return list(dict.fromkeys(v for v in values if isinstance(v, str) and v and "\x00" not in v))


def dump_places(folder: Path, hparams: Mapping[str, Any] | None, recorded: Sequence[str] = ()
                ) -> list[Path]:
    """The folders fp8_stats may have written the run's dumps to, in the order looked in: each
    folder the run recorded (`recorded`, latest attempt first; else the one `hparams` holds)
    inside `folder` (the folder holding metrics.jsonl, W&B's `dir`, an MLflow run's folder:
    `mlflow_run.run_folder_of`), an absolute one as it is; then `callbacks.fp8_stats.dump_folder`
    (default paths.DUMP_FOLDER) inside `folder`: runs of builds before the record, and an attempt
    whose record a logger replaced (hparams.json) or refused (MLflow keeps a param's first
    value)."""
    hparams = hparams or {}
    places = dict.fromkeys(
        path if path.is_absolute() else folder / path
        for path in map(Path, recorded_dump_folders(recorded or [hparams.get(DUMP_FOLDER_KEY)])))
    template = (_fp8_stats_options(hparams) or {}).get("dump_folder") or DUMP_FOLDER
    run_name = hparams.get("run_name")
    if not isinstance(template, str):
        return list(places)
    # where the run put them for each way it may have written its folder (`report .` inside it
    # has no parts to match a template's beginning against; `X/dumps` repeats a run folder
    # written `X`), named from `folder` as given
    for written in written_forms(folder):
        try:
            dumps = in_run_folder(template, written, run_name if isinstance(run_name, str)
                                  else "", "dump_folder")
        except (PathError, KeyError, ValueError):
            break
        places[folder / dumps.relative_to(written) if dumps.is_relative_to(written)
               else dumps] = None
    return list(places)


def dump_of(places: Iterable[Path], step: int, layer: str, tensor: str) -> Path | None:
    """The dump fp8_stats wrote at `step` holding `layer`'s `tensor` (its `dump_steps`), the first
    found in `places` (`dump_places`); None where there is none."""
    names = {f"{form}/{tensor}" for form in full_forms(layer)}
    for dumps in places:
        try:
            found = sorted(dumps.glob(DUMP_FILES.format(step=step)))
        except (OSError, ValueError):  # a folder we may not read
            continue
        if (path := next((p for p in found if names & _dumped_keys(p)), None)) is not None:
            return path
    return None
