"""TE's own FP8 statistics (nvdlfw-inspect's `LogFp8TensorStats`) for what module hooks miss.

Module hooks see a TE module's input and weights, not the GEMM inputs inside fused modules
(`LayerNormLinear`'s normalised X, `LayerNormMLP`'s inner activation). TE's debug API computes
statistics on the tensors it really casts. It must be initialised before the first TE module is
created (TE's `TEDebugState` refuses otherwise), so `FP8Stats` starts it in its constructor:
LLM-Foundry builds callbacks before the model. TE and nvdlfw-inspect are imported lazily.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from foundry_fp8.health.keys import TENSORS, layer_key, short_layer
from foundry_fp8.options import one_pattern
from foundry_fp8.te.facts import MIN_TE_DEBUG_STATS, TE_INSTALL_HINT, dotted
from foundry_fp8.te.probe import is_te_module, te_available, te_version

#: Statistics under the training recipe, plus the current-scaling what-if of delayed scaling
#: (TE: `overflows%` exists only for delayed scaling; `<recipe>_<stat>` names a what-if).
DELAYED_STATS = ("underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse",
                 "fp8_current_scaling_underflows%", "fp8_current_scaling_mse")
CURRENT_STATS = ("underflows%", "scale_inv_min", "scale_inv_max", "mse")

FEATURE = "LogFp8TensorStats"
NAMESPACE = "transformer_engine"

#: nvdlfw-inspect's loggers: each `initialize` adds a file handler (its log in `log_dir`, an open
#: file) and a console one to them, and `end_debug` leaves them (nvdlfw_inspect 0.2.2
#: logging.py, `FileLogger.initialize` and `_initialize_stats_logger`)
INSPECT_LOGGERS = ("nvdlfw_inspect", "Default Statistics")

log = logging.getLogger(__name__)


#: TE's LayerNormMLP gives the debug API its two GEMMs as `<name>.fc1` and `<name>.fc2`
#: (pytorch/module/layernorm_mlp.py, `_setup_...debug` quantizer names, TE 2.7 to 2.20).
LN_MLP_GEMMS = ("fc1", "fc2")


def te_debug_problem() -> str | None:
    """Why TE's debug statistics cannot run here (no TE, or a TE before MIN_TE_DEBUG_STATS,
    which would fail at the first logged step); None when they can."""
    if not te_available():
        return (f"needs TransformerEngine and nvdlfw-inspect ({TE_INSTALL_HINT} nvdlfw-inspect "
                "on a GPU machine); without TE, leave te_debug unset: the module-hook "
                "statistics work anywhere")
    version = te_version()
    if version is not None and version < MIN_TE_DEBUG_STATS:
        return (f"needs TransformerEngine >= {dotted(MIN_TE_DEBUG_STATS)}, found "
                f"{dotted(version)} (its LogFp8TensorStats logs only underflows% before "
                f"{dotted(MIN_TE_DEBUG_STATS)}); "
                "leave te_debug unset: the module-hook statistics work with any TE")
    return None


def layer_pattern(include: str, exclude: str | None = None) -> str:
    """One regex (nvdlfw-inspect takes one, and searches it) for names that match `include`
    and not `exclude`, as fp8_stats' own `layers`/`exclude` select them: a LayerNormMLP's GEMMs
    reach TE's debug API as `<layer>.fc1`/`.fc2`, so an end anchor also ends there."""
    return one_pattern(_end_also_at_gemm(include), exclude and _end_also_at_gemm(exclude))


def _end_also_at_gemm(pattern: str) -> str:
    """`pattern` with each end anchor (`$`, `\\Z`) outside character classes and lookbehinds
    also matching before a LayerNormMLP GEMM suffix: `ffn$` selects `ffn.fc1` and `ffn.fc2`.
    A rewrite that would not compile keeps `pattern`."""
    gemm = "(?:\\.(?:" + "|".join(LN_MLP_GEMMS) + "))?"
    out: list[str] = []
    groups: list[bool] = []  # per open group: is it a lookbehind (fixed width: no rewrite)
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        anchor = not in_class and not any(groups)
        if char == "\\":
            escaped = pattern[i:i + 2]
            out.append(gemm + escaped if escaped == "\\Z" and anchor else escaped)
            i += 2
            continue
        if in_class:
            in_class = char != "]" or out[-1] in ("[", "[^")
        elif char == "[":
            opening = "[^" if pattern.startswith("[^", i) else "["
            out.append(opening)
            in_class, i = True, i + len(opening)
            continue
        elif char == "(":
            groups.append(pattern.startswith(("(?<=", "(?<!"), i))
        elif char == ")" and groups:
            groups.pop()
        out.append(gemm + char if char == "$" and anchor else char)
        i += 1
    rewritten = "".join(out)
    try:
        re.compile(rewritten)
    except re.error:
        return pattern
    return rewritten


def log_fp8_tensor_stats_config(layers: str, tensors: Sequence[str], freq: int,
                                scaling: str = "delayed", start_step: int | None = None,
                                end_step: int | None = None) -> dict[str, Any]:
    """The nvdlfw-inspect config enabling TE's `LogFp8TensorStats` on layers whose names match
    the regex `layers` (searched, as our hooks do), every `freq` steps."""
    unknown = set(tensors) - set(TENSORS)
    if unknown:
        raise ValueError(f"fp8_stats.tensors: unknown {sorted(unknown)}; use {list(TENSORS)}")
    re.compile(layers)
    stats = list(DELAYED_STATS if scaling == "delayed" else CURRENT_STATS)
    window = {k: v for k, v in (("start_step", start_step), ("end_step", end_step))
              if v is not None}
    return {"foundry_fp8_stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": layers},
        NAMESPACE: {FEATURE: {
            "enabled": True,
            "tensors_struct": [{"tensor": t, "stats": stats, "freq": freq, **window}
                               for t in tensors],
        }},
    }}


#: TE's percentages (`underflows%`, `overflows%`, `<recipe>_underflows%`, `underflows%_columnwise`:
#: debug/features/utils/stats_computation.py:183-206, 303 at main d0067d0) as our keys name
#: theirs, `underflow_pct` (health.keys): MLflow refuses a `%` in a metric name.
_PERCENT = re.compile(r"s?%")


def our_stat(te_stat: str) -> str:
    """TE's statistic (or logged name) with `_pct` for its `%`: `underflows%` -> `underflow_pct`."""
    return _PERCENT.sub("_pct", te_stat)


def metric_name(te_name: str, layers: Iterable[str]) -> str | None:
    """TE logs `<layer>_<tensor>_<stat>`; ours is `fp8_te_<stat>/<tensor>/<layer>` (health.keys),
    `<stat>` with `_pct` for TE's `%` (`our_stat`). A LayerNormMLP's GEMMs
    (`<layer>.fc1_<tensor>_<stat>`) keep the module's name, the GEMM going into the tensor
    (`fc1_activation`), as fp8_stats' hooks name `fc1_weight`.

    Layer names hold underscores too, so the layer is the longest known name that prefixes
    `te_name`; None when no known layer and tensor fit.
    """
    for layer in sorted(layers, key=len, reverse=True):
        for gemm in ("", *LN_MLP_GEMMS):
            prefix = f"{layer}.{gemm}_" if gemm else f"{layer}_"
            if not te_name.startswith(prefix):
                continue
            rest = te_name[len(prefix):]
            for tensor in TENSORS:
                if rest.startswith(f"{tensor}_"):
                    stat = f"te_{our_stat(rest.removeprefix(f'{tensor}_'))}"
                    return layer_key(stat, f"{gemm}_{tensor}" if gemm else tensor,
                                     short_layer(layer))
    return None


class TEDebugSession:
    """One run's TE debug API: start before the model exists, name layers, step, close.

    `sink(name, value, step)` receives every statistic TE logs, under our metric names.
    nvdlfw-inspect takes one session per process (a second `initialize` raises "Already
    initialized"): a session of ours that was never closed (its fit raised before FIT_END and
    its Trainer was not closed, as LLM-Foundry's `train()` leaves it) is ended by the next one.
    """

    #: the started session of ours not yet closed
    _open: ClassVar[TEDebugSession | None] = None

    def __init__(self, config: Mapping[str, Any], log_dir: Path,
                 sink: Callable[[str, float, int], None]):
        self.config, self.log_dir, self.sink = dict(config), Path(log_dir), sink
        self.layer_names: set[str] = set()
        self._paused = False  # TE's `debug_enabled` was True at `pause`
        self._manager: Any = None  # the nvdlfw-inspect DebugManager `start` made
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []  # ones it added

    def start(self) -> None:
        """Start nvdlfw-inspect with TE's features. TE's debug flag left False (TE modules built
        while nvdlfw-inspect was imported but ran no session: an earlier run in this process, a
        test module importing it) would make TE refuse the next TE module built ("should be
        initialized before the first TE module": `TEDebugState.initialize`, debug/pytorch/
        debug_state.py:23-39 in 2.20.2): it goes back to None, TE's own start, so the next
        module turns it on and `name_layers` the earlier ones."""
        import nvdlfw_inspect.api as debug_api
        import transformer_engine.debug.features as te_features
        import yaml
        from nvdlfw_inspect.logging import BaseLogger
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        session = self

        class _Forward(BaseLogger):
            def log_scalar(self, name: str, value: float | int, iteration: int,
                           **kwargs: Any) -> None:
                del kwargs
                ours = metric_name(name, session.layer_names)
                session.sink(ours or f"fp8/te_debug/{our_stat(name)}", float(value),
                             int(iteration))

        self.log_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.log_dir / "te_debug.yaml"
        config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        stale = TEDebugSession._open
        if stale is not None:
            if stale._manager is not None and stale._manager is debug_api.DEBUG_MANAGER:
                log.warning("fp8_stats te_debug: ending the TE debug session of an earlier "
                            "fp8_stats whose fit did not reach its end (it raised, or has not "
                            "run) and whose Trainer was not closed: TE's debug API takes one "
                            "session per process")
            stale.close()
        loggers = [logging.getLogger(name) for name in INSPECT_LOGGERS]
        before = [list(logger.handlers) for logger in loggers]
        try:
            debug_api.initialize(config_file=str(config_file),
                                 feature_dirs=[str(Path(te_features.__file__).parent)],
                                 log_dir=str(self.log_dir), statistics_logger=_Forward())
        finally:  # a session nvdlfw-inspect half made (a config it refused) is ours to end too
            self._manager, TEDebugSession._open = debug_api.DEBUG_MANAGER, self
            self._handlers = [(logger, handler)
                              for logger, old in zip(loggers, before, strict=True)
                              for handler in logger.handlers if handler not in old]
        if TEDebugState.debug_enabled is False:
            TEDebugState.debug_enabled = None

    def name_layers(self, named_modules: Iterable[tuple[str, Any]]) -> None:
        """Give TE modules our module names (TE would call them `Layer_<n>`), so the layer regex
        and the metric names match what our hooks use: pass `fp8_meta.canonical_modules`.

        TE turns its debug API on when a TE module is built while a session exists
        (`TEDebugState.initialize` in `TransformerEngineBaseModule.__init__`, module/base.py:
        922-923 in 2.20.2, 890-891 at v2.18), and every forward reads that flag (`is_debug_iter`,
        base.py:1979-1985). A model built before `start` (a Composer script building it before
        fp8_stats) left it off, and TE computed no statistics, silently: turned on here, as a
        module built now would; a module keeps no debug state from its construction (2.7-2.20)."""
        import nvdlfw_inspect.api as debug_api
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        for name, module in named_modules:
            if is_te_module(module) and hasattr(module, "name"):
                module.name = name
                self.layer_names.add(module.name)
        if (self.layer_names and not TEDebugState.debug_enabled and not self._paused
                and self._manager is not None and self._manager is debug_api.DEBUG_MANAGER):
            TEDebugState.debug_enabled = True

    def start_at(self, batch: int) -> None:
        """TE's debug iteration is Composer's batch count: nvdlfw-inspect counts from 0 at
        `initialize`, so a resumed run (or `fit(reset_time=True)`) would log TE's statistics
        off fp8_stats' schedule (`freq`, `start_step` are checked against that count)."""
        import nvdlfw_inspect.api as debug_api

        debug_api.initialize_training_step(batch)

    def pause(self) -> None:
        """No TE debug statistics until `resume`: TE feeds its buffers on every forward of a
        debug iteration, evaluation included (pytorch/module/base.py `is_debug_iter` and
        debug/features/utils/stats_buffer.py `feed`, at TE main d0067d0, check no training
        mode), so an evaluation inside a logging step would mix into its statistics. TE's
        modules read `TEDebugState.debug_enabled` at every forward (`is_debug_iter`)."""
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        if TEDebugState.debug_enabled:  # None before the first TE module: nothing to pause
            TEDebugState.debug_enabled, self._paused = False, True

    def resume(self) -> None:
        """Undo `pause` (nothing when not paused)."""
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        if self._paused:
            TEDebugState.debug_enabled, self._paused = True, False

    def step(self) -> None:
        import nvdlfw_inspect.api as debug_api

        debug_api.step()

    def close(self) -> None:
        """End TE's debug API if this session still holds it (once: FIT_END, or the Trainer's
        close after a fit that raised) and close the log files nvdlfw-inspect opened for it: left
        open, every later session's messages went into each earlier run's log as well, and its
        console warnings were printed once per earlier session."""
        import nvdlfw_inspect.api as debug_api

        if self._manager is not None and self._manager is debug_api.DEBUG_MANAGER:
            self.resume()
            debug_api.end_debug()
        self._manager = None
        if TEDebugSession._open is self:
            TEDebugSession._open = None
        for logger, handler in self._handlers:
            logger.removeHandler(handler)
            handler.close()
        self._handlers = []
