"""`fp8_state`: FP8 amax histories and scales kept right across checkpoints and activation recompute.

The state lives in this callback's own entry of the checkpoint (tensors and plain types: the
run's recipe, and per module name its scales and amax histories, per rank where ranks differ),
checked before it is written back (`foundry_fp8.restore`), so resuming never depends on TE's pickled `_extra_state`: TE 2.16.1, 2.17.1
and >= 2.18 refuse to unpickle a delayed-scaling one without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE,
before any callback could help. te_swap's modules save no `_extra_state` key at all
(`swap._save_plain`); other TE modules (`fc_type: te`) keep the key but store a pickled `None`,
which every TE from 1.12 to 2.20 loads as "no state" (an empty tensor would be skipped too from
TE 2.4 on, but older TE fails to unpickle it), and load that `None` where a checkpoint lacks the
key (a bf16 run's: TE 2.20.2 refuses torch's placeholder for it under FSDP). At INIT it also makes FSDP activation
checkpointing recompute under FP8 (TE #1190), and for the first batches it watches for the
#1190 symptom: forward amax histories rolling while the backward ones never do.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from torch import nn

from foundry_fp8 import emulate
from foundry_fp8.composer.failures import device_failure
from foundry_fp8.composer.guard import FP8Guard, accept_absent_state, checkpointed_core
from foundry_fp8.composer.te_swap import TESwap, recompute_inputs, run_recipe
from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.fp8_meta import (
    canonical_modules,
    fp8_modules,
    is_fp8_module,
    read_fp8_meta,
    write_fp8_meta,
)
from foundry_fp8.guard import Fallback
from foundry_fp8.health import plural, short_layer
from foundry_fp8.jsonl import file_kind
from foundry_fp8.options import build
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.restore import (
    FP8ModuleState,
    StateProblems,
    checked_modules,
    combine_ranks,
    payload_problem,
    recipe_change,
    saved_recipe,
    scale_keys_changed,
)
from foundry_fp8.swap import MPT_MLP_LINEARS, fp8_module_counts, would_run_fp8
from foundry_fp8.te import backend as te_backend
from foundry_fp8.te.extra_state import (
    holds_te_scaling_state,
    inert_extra_state_hook,
    inert_when_missing_hook,
)
from foundry_fp8.te.facts import MIN_TE_FOR_RECOMPUTE, dotted
from foundry_fp8.te.probe import is_te_module
from foundry_fp8.te.recompute import recompute_plan

log = logging.getLogger(__name__)


class FP8StateError(ValueError):
    """A checkpoint or configuration that fp8_state refuses; the message names what to fix."""


#: All a `save_weights_only` checkpoint holds (composer/utils/checkpoint.py:1031-1037); a
#: full save adds timestamp, optimizers, callbacks, rank_zero_seed... (composer/core/state.py)
_WEIGHTS_ONLY_KEYS = frozenset({"model", "integrations", "metadata"})

#: Per weights-only setting, what the line on a load says of it and how to keep the FP8 state.
_WEIGHTS_ONLY = {
    "load_weights_only": ("loaded with load_weights_only", "a full load restores them"),
    "save_weights_only": ("was saved with save_weights_only",
                          "checkpoints saved in full hold them"),
}

#: What `strict: false` continues with where nothing of the checkpoint's FP8 state applies.
_FRESH = "FP8 scaling started fresh"

#: What the run goes on without when one of fp8_state's event works fails (`_guarded`), by its
#: method's name.
_LOST = {
    "_init": "fp8_state's check and setting of FSDP activation recompute under FP8 (TE #1190: "
             "recomputed FP8 layers may now update their scales wrongly; the symptom watch "
             "stays on)",
    "_inert_extra_state_on_save": "saving TE modules' _extra_state as 'no state' (checkpoints "
                                  "may hold TE's pickled FP8 state, which TE >= 2.16.1 refuses "
                                  "to load)",
    "_inert_extra_state_on_load": "loading checkpoints without TE's _extra_state (a bf16 "
                                  "run's, te_swap's) into TE modules: under FSDP "
                                  "state_dict_type full, TE refuses torch's stand-in for the "
                                  "missing key",
    "_see_loaded_entries": "its notes on this load (weights-only, a bf16 checkpoint, fp8_guard "
                           "fallbacks without fp8_guard)",
    "accept_sharded_checkpoints": "loading sharded checkpoints saved without fp8_state",
    "_report_loaded_entries": "its notes on this load (weights-only, a bf16 checkpoint, "
                              "fp8_guard fallbacks without fp8_guard)",
    "load_state_dict": "the checkpoint's FP8 state (FP8 scaling starts fresh)",
    "say": "reporting FP8 state restores that failed at a module's first FP8 forward",
    "_watch": "the TE #1190 symptom watch",
}


def _composer_checkpoint_types() -> list[Any]:
    """The types besides tensors that a Composer 0.32 checkpoint's pickle names (the torch
    version, `timedelta`s of its timestamp, the numpy arrays of its RNG state): none runs code
    when unpickled."""
    import datetime

    import numpy as np
    from torch.torch_version import TorchVersion

    dtypes = [t for t in vars(np.dtypes).values() if isinstance(t, type)]
    # The array rebuilder under the name this numpy pickles it by (numpy.core in 1.x, numpy._core
    # in 2.x): taken from the reduction itself so no private module path is spelled here.
    reconstruct = np.zeros(0).__reduce__()[0]
    return [TorchVersion, datetime.timedelta, np.ndarray, np.dtype, reconstruct, *dtypes]


def fp8_state_from_checkpoint(path: str | Path) -> FP8ModuleState:
    """The FP8 state `fp8_state` stored in a Composer checkpoint file, rank 0's (empty if none).

    Read with `weights_only=True`: a file whose pickle names anything but tensors, plain types
    and `_composer_checkpoint_types` is refused (FP8StateError, one line) before it can run code.
    Any other file (hparams.json, a dump, a compressed checkpoint, text) is one line too, and a
    FIFO is refused unopened (torch.load would wait on it for a writer forever).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise FP8StateError(f"fp8_state: {path}: not a readable checkpoint "
                            f"({_described(error)})") from None
    if not stat.S_ISREG(mode):
        raise FP8StateError(f"fp8_state: {path}: {file_kind(mode)}, not a checkpoint file")
    allowed = _composer_checkpoint_types()  # outside the try: a bug of ours is no bad file
    try:
        with torch.serialization.safe_globals(allowed):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's reason is the line between its advice on weights_only and the link to the
        # docs, after "WeightsUnpickler error: " where it says so
        lines = [line.strip().rpartition("WeightsUnpickler error: ")[2]
                 for line in str(error).splitlines() if line.strip()]
        said = next((line for line in lines[1:] if not line.startswith("Check the doc")),
                    lines[-1] if lines else "")
        if "GLOBAL" in said:
            raise FP8StateError(f"fp8_state: {path}: not loaded, its pickle could run code "
                                f"({said})") from None
        # not a pickle torch reads (JSON, safetensors, gzip, pickle protocol 4): no code in it
        raise FP8StateError(f"fp8_state: {path}: not a readable checkpoint (not a file "
                            f"torch.save wrote: {said})") from None
    except Exception as error:  # cut short, not a torch file: torch.load raises any kind
        raise FP8StateError(f"fp8_state: {path}: not a readable checkpoint "
                            f"({_described(error)})") from None
    entry: Any = checkpoint
    for where, key in (("the file", "state"), ("state", "callbacks"),
                       ("state.callbacks", FP8State.__qualname__)):
        if not isinstance(entry, Mapping):
            raise FP8StateError(f"fp8_state: {path}: not a Composer checkpoint ({where} holds "
                                f"a {type(entry).__name__}, not a mapping)")
        entry = entry.get(key, {})
    problem = payload_problem(entry)
    if problem:
        raise FP8StateError(f"fp8_state: {path}: the fp8_state entry is not ours: {problem}")
    return entry.get("modules", {})


def recompute_settings(precision: str, fsdp: Mapping[str, Any] | None, fsdp_version: int,
                       te_version: tuple[int, ...] | None, emulated: bool) -> dict[str, Any]:
    """The FSDP config fields to set so that activation recompute runs under FP8
    (`te.recompute.recompute_plan`); FP8StateError where no setting makes it safe."""
    plan = recompute_plan(precision, fsdp, fsdp_version, te_version, emulated)
    if plan.refusal is not None:
        raise FP8StateError(plan.refusal)
    return plan.settings


def _rolled(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether a delayed-scaling amax history took in an amax: its past rows (1..) changed.

    Row 0 is left out: it max-accumulates the amaxes being recorded until an update rolls it
    in, so it also moves, whenever amaxes grow, where no update ever runs."""
    return not torch.equal(before[1:], after[1:])


def stale_backward_modules(before: FP8ModuleState, after: FP8ModuleState,
                           grads_nonzero: set[str]) -> list[str]:
    """Modules whose forward amax history rolled between two states while their backward one
    did not roll and their backward scale stayed, although their weight had a non-zero
    gradient: the TE #1190 symptom, backward scale updates never running (backward amaxes not
    recorded at all, or recorded into row 0 and never rolled in).

    Quiet where backward updates run at all, once per backward (micro-batches, eval batches
    between the states, a history not yet full or restored from a checkpoint), for modules
    without a gradient (frozen, unused), and where no past rows are kept (current scaling, a
    history of length 1): there the symptom cannot be told from a steady state.
    """
    return [name for name in sorted(before.keys() & after.keys() & grads_nonzero)
            if _rolled(before[name]["fwd_amax_history"], after[name]["fwd_amax_history"])
            and not _rolled(before[name]["bwd_amax_history"], after[name]["bwd_amax_history"])
            and torch.equal(before[name]["bwd_scale"], after[name]["bwd_scale"])]


class FP8State(Callback):
    """`callbacks: {fp8_state: {strict: true, watch_batches: 8}}`.

    With `strict`, a checkpoint whose FP8 modules do not match the model's, FP8 state that is
    not valid by TE's rules or was saved under another recipe (`foundry_fp8.restore`), and the
    #1190 symptom, are errors naming module and field; otherwise warnings, and the state is
    repaired by TE's rules. Different per-rank state from another rank count is combined as
    TE's amax reduction would, and said in the log. A checkpoint without FP8 state (a bf16
    run's), or with fp8_guard fallbacks this run has no fp8_guard to keep, is one warning. Logs
    no metrics. Unsafe activation-checkpointing setups are always refused. An error in
    fp8_state's own code while training or saving is logged (and switches the watch off); it
    never stops the run. `watch_batches`: how many first batches the symptom is watched for (0:
    never); it shows from the first batches on.
    """

    #: what te_swap looks for (it cannot import this module, which imports te_swap)
    keeps_fp8_state = True

    def __init__(self, **options: Any):
        self.options = build("fp8_state", options)  # one line naming callbacks.fp8_state.<key>
        self.strict: bool = self.options.strict
        self.watch_batches: int = self.options.watch_batches
        self._model: nn.Module | None = None
        #: Composer's precision, known at INIT; a model given by hand (a plain loop) runs under
        #: TE's autocast, as `swap.convert_to_fp8` takes it by default
        self._precision: str = "amp_fp8"
        self._recipe: FP8Recipe | None = None
        self._pending: dict[str, Any] | None = None
        self._last: FP8ModuleState | None = None
        self._stale: dict[str, int] = {}
        self._watched = 0
        self._loaded_entries: Mapping[str, Any] | None = None
        self._weights_only: str | None = None  # which weights-only setting, if any
        self._te_restored = False  # the load's model held TE's own pickled FP8 state
        self._bf16_weights = False  # a weights-only load of a checkpoint saved without FP8
        #: the full load's checkpoint: its run's precision (Composer's `metadata`) and whether
        #: that run computed in FP8 (`_saved_run`)
        self._saved_precision: str | None = None
        self._saved_fp8 = False
        #: fp8_guard's fallbacks in a whole-file weights-only load's checkpoint
        self._weights_fallbacks: list[str] = []
        self._waiting = _Waiting({}, self._mismatch, self.strict)  # TE modules before their first forward
        #: this callback's hooks on the model (inert `_extra_state` saves, restores waiting for
        #: a first FP8 forward), taken off when its Trainer closes: the model may train on
        #: in another Trainer, or be saved by the user, without them
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._failed: set[str] = set()  # the works `_guarded` saw fail: not run again
        self._unsaved_said = False  # a save that could not read the FP8 state was warned of

    # -- events ---------------------------------------------------------------------------

    def init(self, state: State, logger: Logger) -> None:
        self._guarded(Event.INIT, "_init", self._init, state)

    def before_load(self, state: State, logger: Logger) -> None:
        self._unhook()  # this callback given to another Trainer that was never closed
        self._guarded(Event.BEFORE_LOAD, "_inert_extra_state_on_save",
                      self._inert_extra_state_on_save, state.model)
        self._guarded(Event.BEFORE_LOAD, "_inert_extra_state_on_load",
                      self._inert_extra_state_on_load, state.model)
        self._guarded(Event.BEFORE_LOAD, "_see_loaded_entries", self._see_loaded_entries, state)
        self._guarded(Event.BEFORE_LOAD, "accept_sharded_checkpoints",
                      self.accept_sharded_checkpoints)

    @classmethod
    def accept_sharded_checkpoints(cls) -> None:
        """A sharded checkpoint without fp8_state loads (said at AFTER_LOAD, as for any other),
        and all the FP8 state it holds is read (`saved_state_template`). Under the name
        Composer keeps the entry by, the class's own (a subclass's too)."""
        accept_absent_state(cls.__qualname__, None, saved_state_template)

    def after_load(self, state: State, logger: Logger) -> None:
        self._guarded(Event.AFTER_LOAD, "_report_loaded_entries", self._report_loaded_entries,
                      state)

    def fit_start(self, state: State, logger: Logger) -> None:
        if self._pending is not None:
            self._guarded(Event.FIT_START, "load_state_dict", self.load_state_dict, self._pending)

    def close(self, state: State, logger: Logger) -> None:
        """The Trainer is done (Composer's `Trainer.close`, also after a fit that raised): the
        model's state_dict is TE's own again, and a restore that never met an FP8 forward
        (an eval-only Trainer) cannot write this checkpoint's state into a later Trainer's run."""
        del state, logger
        self._unhook()

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._waiting = _Waiting({}, self._mismatch, self.strict)

    def batch_end(self, state: State, logger: Logger) -> None:
        self._guarded(Event.BATCH_END, "say", self._waiting.say)
        if self.watch_batches:
            self._guarded(Event.BATCH_END, "_watch", self._watch)

    def _guarded(self, event: Event, name: str, work: Callable[..., None], *args: Any) -> None:
        """Our own bug must not stop a run: `strict` is about the checkpoint and the symptoms
        we find, not about fp8_state's own failures (FP8StateError is a finding, raised). The
        one line names what the failed work does and so what the run goes on without; a work
        that failed is not run again (at BATCH_END it would fail, and say so, every batch).
        `name`: the work's key in `_LOST`."""
        if name in self._failed:
            return
        try:
            work(*args)
        except FP8StateError:
            raise
        except Exception as error:
            if device_failure(error):  # the device's, as `load_state_dict` raises it
                raise
            self._failed.add(name)
            if name == "_watch":
                self.watch_batches = 0
            log.exception("fp8_state: internal error at %s; the run goes on without %s",
                          event.value, _LOST[name])

    def _init(self, state: State) -> None:
        """Before FSDP wraps the model (right after INIT), so FSDP config changes still take
        effect. Composer runs callbacks before algorithms at INIT: te_swap has not converted
        the model yet, so its plan is read from the run's algorithms."""
        self._model, self._precision = state.model, state.precision.value
        self._recipe = run_recipe(state)
        emulated = (any(isinstance(m, EmulatedFP8Linear) for m in state.model.modules())
                    or any(isinstance(a, TESwap) and a.config.backend == "emulate"
                           for a in state.algorithms))
        for key, value in recompute_settings(*recompute_inputs(state), emulated).items():
            setattr(state.fsdp_config, key, value)
            log.warning("fp8_state: set fsdp_config.%s=%s so activation recompute runs under "
                        "FP8 (TE #1190)", key, value)

    def _inert_extra_state_on_save(self, model: nn.Module) -> None:
        """At BEFORE_LOAD: te_swap has converted the model (INIT) and the checkpoint is not
        loaded yet, so every FP8 module saves, and loads, an inert `_extra_state` (te_swap's own
        modules save none: their hook finds no key)."""
        for module in model.modules():  # FP8 modules, and TE's ops (te.LayerNorm)
            if is_fp8_module(module) or is_te_module(module):
                self._hooks.append(module.register_state_dict_post_hook(inert_extra_state_hook))

    def _inert_extra_state_on_load(self, model: nn.Module) -> None:
        """At BEFORE_LOAD: a TE module whose `_extra_state` the checkpoint lacks (a bf16 run's
        torch layers continued with `fc_type: te`, a te_swap checkpoint) loads the inert one
        and keeps its fresh FP8 metadata; fp8_state restores the FP8 state itself. Without it,
        Composer's loader under FSDP `state_dict_type: full` (torch's `set_model_state_dict`,
        full_state_dict) hands TE torch's `_EXTRA_STATE()` placeholder and TE 2.20.2 stops the
        load ("Unsupported checkpoint format.", pytorch/module/base.py:1443)."""
        for module in model.modules():  # as `_inert_extra_state_on_save`; the hook skips a
            if is_fp8_module(module) or is_te_module(module):  # module without the key
                self._hooks.append(module.register_load_state_dict_pre_hook(
                    inert_when_missing_hook))

    def _see_loaded_entries(self, state: State) -> None:
        """Composer hands each callback only its own checkpoint entry, and none to a callback
        the checkpoint lacks: note the callback entries a full load passes to `state`, and
        whether the load was weights-only, for `_report_loaded_entries`. Composer's
        `load_weights_only` calls `state.load_model_state` alone on a whole-file checkpoint
        (composer/utils/checkpoint.py, `_restore_checkpoint`) and `state.load_state_dict` with
        only the `model` key on a sharded one (`load_sharded_checkpoint`); a full load calls
        `load_state_dict`, which calls `load_model_state`. Wrapped once: a later load goes
        through the same wrappers."""
        load, load_model = state.load_state_dict, state.load_model_state
        if getattr(load, "_fp8_state_notes", False):
            return

        @functools.wraps(load)
        def load_state_dict(serialized: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            entries = serialized.get("callbacks") if isinstance(serialized, Mapping) else None
            self._loaded_entries = entries if isinstance(entries, Mapping) else {}
            self._saved_precision, self._saved_fp8 = _saved_run(serialized)
            self._weights_only = None
            # by the checkpoint's shape, not a missing key: `load_ignore_keys` (say
            # `state/timestamp`) filters a full checkpoint before this call
            # (composer/utils/checkpoint.py:966-973, 986)
            if isinstance(serialized, Mapping) and serialized.keys() <= _WEIGHTS_ONLY_KEYS:
                # only the model asked for (a sharded weights-only load), or only the weights
                # saved (`save_weights_only`)
                self._weights_only = ("load_weights_only" if serialized.keys() <= {"model"}
                                      else "save_weights_only")
            return load(serialized, *args, **kwargs)

        @functools.wraps(load_model)
        def load_model_state(serialized: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if self._loaded_entries is None:  # not inside load_state_dict: weights only
                self._loaded_entries, self._weights_only = {}, "load_weights_only"
                # a whole-file weights-only load hands the checkpoint's whole state
                # (composer/utils/checkpoint.py `_restore_checkpoint`): a bf16 run's holds no
                # FP8 state a full load could restore either
                entries = serialized.get("callbacks") if isinstance(serialized,
                                                                     Mapping) else None
                self._bf16_weights = isinstance(entries, Mapping) and not _holds_fp8_state(
                    next((entries[n] for n in _qualnames(type(self)) if n in entries), None))
                # fp8_guard's entry is not loaded either: its fallbacks end here
                self._weights_fallbacks = _guard_fallbacks(entries) if isinstance(
                    entries, Mapping) else []
            model = serialized.get("model") if isinstance(serialized, Mapping) else None
            self._te_restored = isinstance(model, Mapping) and holds_te_scaling_state(model)
            return load_model(serialized, *args, **kwargs)

        load_state_dict._fp8_state_notes = True  # type: ignore[attr-defined]
        state.load_state_dict = load_state_dict  # type: ignore[method-assign]
        state.load_model_state = load_model_state  # type: ignore[method-assign]

    def _report_loaded_entries(self, state: State) -> None:
        """One line each for what a load leaves out silently: the FP8 state a weights-only load
        does not restore, a checkpoint without FP8 state (a bf16 run's) or with TE's own
        (restored by TE, unchecked), and fp8_guard's fallbacks where this run has no
        fp8_guard."""
        entries, self._loaded_entries = self._loaded_entries, None
        weights_only, self._weights_only = self._weights_only, None
        te_restored, self._te_restored = self._te_restored, False
        bf16_weights, self._bf16_weights = self._bf16_weights, False
        saved_fp8, self._saved_fp8 = self._saved_fp8, False
        weights_fallbacks, self._weights_fallbacks = self._weights_fallbacks, []
        if entries is None or self._model is None:
            return
        ours = type(self).__qualname__ in entries
        has_fp8 = next(fp8_modules(self._model), None) is not None
        # whether anything computes in FP8: a TE layer under amp_bf16 has no scaling to start
        # fresh
        in_fp8 = would_run_fp8(self._precision, *fp8_module_counts(self._model))
        if has_fp8 and te_restored and not ours:
            # TE's set_extra_state restored it during the model load (TE 2.20
            # pytorch/module/base.py), where the TE installed unpickles it at all
            log.warning("fp8_state: %s holds no FP8 state of fp8_state's but TE's own in its "
                        "modules' _extra_state (saved without fp8_state): TE restored those "
                        "FP8 scales and amax histories as saved, unchecked", state.load_path)
        elif in_fp8 and bf16_weights:
            log.warning("fp8_state: %s (loaded with load_weights_only) holds no FP8 state "
                        "(saved without fp8_state or FP8 modules); FP8 scales and amax "
                        "histories start fresh, as expected when converting a bf16 checkpoint",
                        state.load_path)
        elif in_fp8 and weights_only:
            # fp8_state keeps the FP8 state out of the model's weights (TE's
            # `_extra_state` is saved as "no state"), so a weights-only load carries none
            log.warning("fp8_state: %s %s: FP8 scales and amax histories are not part "
                        "of the model's weights and start fresh (%s)", state.load_path,
                        *_WEIGHTS_ONLY[weights_only])
        elif in_fp8 and not ours and saved_fp8:
            log.warning("fp8_state: %s holds no FP8 state though its run computed in FP8 "
                        "(te_swap or amp_fp8; saved without fp8_state, or left out by "
                        "load_ignore_keys); FP8 scales and amax histories start fresh, not "
                        "continued from that run", state.load_path)
        elif in_fp8 and not ours:
            # Composer drops `load_ignore_keys` before any callback sees the checkpoint
            log.warning("fp8_state: %s holds no FP8 state (saved without fp8_state, or left "
                        "out by load_ignore_keys); FP8 scales and amax histories start fresh, "
                        "as expected when converting a bf16 checkpoint", state.load_path)
        # a held layer this run keeps out of FP8 (excluded since, as the guard's advice says)
        # is not back in FP8
        out_of_fp8 = {short_layer(name) for name, module in canonical_modules(self._model)
                      if not (is_fp8_module(module) and would_run_fp8(
                          self._precision, *fp8_module_counts(module)))}
        if weights_only:
            back = [layer for layer in weights_fallbacks if layer not in out_of_fp8]
            if back:
                log.warning("fp8_state: %s: fp8_guard held %s in high precision (%s); "
                            "a weights-only load does not keep its fallbacks, so they run in "
                            "FP8 again", state.load_path, plural(len(back), "layer"), ", ".join(back))
            return
        fallbacks = [layer for layer in _guard_fallbacks(entries) if layer not in out_of_fp8]
        if fallbacks and not any(isinstance(c, FP8Guard) for c in state.callbacks):
            log.warning("fp8_state: %s: fp8_guard held %s in high precision (%s); this "
                        "run has no fp8_guard, so they run in FP8 again", state.load_path,
                        plural(len(fallbacks), "layer"), ", ".join(fallbacks))

    def _watch(self) -> None:
        assert self._model is not None
        current = self._local_state()
        grads_nonzero = {n for n, m in fp8_modules(self._model)
                         if any(p.grad is not None and p.grad.numel() > 0
                                and bool(p.grad.abs().max() > 0)
                                for p in m.parameters(recurse=False))}
        if self._last is not None:
            stale = set(stale_backward_modules(self._last, current, grads_nonzero))
            self._stale = {n: self._stale.get(n, 0) + 1 for n in stale}
            if any(count >= 2 for count in self._stale.values()):
                casting = {n for n in self._last.keys() & current.keys() if _rolled(
                    self._last[n]["fwd_amax_history"], current[n]["fwd_amax_history"])}
                self._report_stale(sorted(self._stale), self._first_module_names(
                    sorted(casting - grads_nonzero)))
        self._last = current
        self._watched += 1
        if self._watched >= self.watch_batches:
            self.watch_batches, self._last = 0, None

    def _first_module_names(self, without_gradient: list[str]) -> str:
        """What the message can say of the first FP8 module in the forward: its name where the
        emulation knows it (TE keeps only a flag), else the FP8 modules that cast in the
        forward without getting a gradient, one of which may be it."""
        assert self._model is not None
        first = emulate.first_fp8_module()
        name = next((n for n, m in fp8_modules(self._model) if m is first), None)
        if name is not None:
            return f"here {name}" + (", which got no gradient" if name in without_gradient
                                     else ", which got a gradient: not this")
        if without_gradient:
            return "FP8 modules that cast without a gradient: " + _shown(without_gradient)
        return "every FP8 module that cast got a gradient: not this"

    def _report_stale(self, names: list[str], first: str) -> None:
        message = (f"fp8_state: backward FP8 scales are not updating while forward ones are in "
                   f"{_shown(names)} (TE #1190 symptom). Either the first FP8 module in the "
                   f"forward ({first}) never gets a gradient (output detached, frozen or "
                   f"unused), and only its backward runs the backward scale update: run it "
                   f"outside FP8 (te_swap's exclude) or after a module that gets one; or "
                   f"activations are recomputed outside FP8: recompute FP8 layers with "
                   f"te.distributed.checkpoint on TE >= {dotted(MIN_TE_FOR_RECOMPUTE)} "
                   f"(Composer FSDP1: te_checkpoint_wrapper: true, "
                   f"activation_checkpointing_reentrant: false) or "
                   f"foundry_fp8.emulate.fp8_checkpoint, not torch.utils.checkpoint")
        if self.strict:
            raise FP8StateError(message + " (fp8_state: {strict: false} only warns)")
        log.warning(message)
        self.watch_batches = 0

    # -- checkpoint state -----------------------------------------------------------------

    def _local_state(self) -> FP8ModuleState:
        """Histories not yet sized by a first FP8 forward are given the recipe's rows, all
        "no amax recorded", so a checkpoint holds the recipe's history length. A TE module
        whose restore still waits for its first FP8 forward (a layer fp8_guard holds in high
        precision since the resume) holds no state of its own yet: the checkpoint's state it
        waits for is what it has, and what the next checkpoint keeps."""
        assert self._model is not None
        # current scaling keeps no history: its empty ones stay empty (given rows, they read
        # as delayed-scaling state, and the run's own resume was refused)
        rows = self._recipe.amax_history_len if self._recipe is not None and \
            self._recipe.scaling == "delayed" else 0
        state: FP8ModuleState = {}
        for name, module in fp8_modules(self._model):
            tensors = read_fp8_meta(module) or self._waiting.unrestored(name)
            for key, value in tensors.items():
                if key.endswith("_amax_history") and value.shape[0] == 0 and rows:
                    tensors[key] = value.new_zeros(rows, *value.shape[1:])
            if tensors:
                state[name] = tensors
        return state

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's state as `modules`; every rank's as `ranks` when they differ. The same on
        all ranks (all ranks call this when Composer saves), so any rank's file is complete.
        A failure to read the state (our bug) is logged and saves `unsaved` instead of stopping
        the save; the all_gather still runs on every rank."""
        local: FP8ModuleState | None
        try:
            local = self._local_state() if self._model is not None else {}
        except Exception:
            # said once: a save every few batches would repeat it all run
            (log.debug if self._unsaved_said else log.exception)(
                "fp8_state: internal error reading the FP8 state to save; this checkpoint "
                "holds none (nor will later ones while reading it fails): a resume from it "
                "starts FP8 scaling fresh")
            self._unsaved_said = True
            local = None
        ranks = dist.all_gather_object(local) if dist.get_world_size() > 1 else [local]
        try:  # every rank holds the same `ranks`: they all fail, or none does
            recipe = self._recipe.as_config() if self._recipe is not None else None
            if any(r is None for r in ranks):
                return {"modules": {}, "unsaved": True, "recipe": recipe}
            saved: dict[str, Any] = {"modules": ranks[0], "recipe": recipe}
            if any(not _same_state(ranks[0], other) for other in ranks[1:]):
                saved["ranks"] = ranks
            return saved
        except Exception:
            (log.debug if self._unsaved_said else log.exception)(
                "fp8_state: internal error putting the FP8 state to save together; this "
                "checkpoint holds none: a resume from it starts FP8 scaling fresh")
            self._unsaved_said = True
            return {"modules": {}, "unsaved": True, "recipe": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validates before anything is written: a refusal (`strict`) leaves the model's FP8
        state as it was; otherwise what is wrong is repaired by TE's rules and named in one
        warning (`foundry_fp8.restore`). A device error (out of memory, CUDA) is raised as it
        came: no setting continues past it."""
        try:
            problem = payload_problem(state)
            if problem:
                self._mismatch(f"fp8_state: the checkpoint's fp8_state entry is not FP8 state "
                               f"as fp8_state saves it ({problem})", _FRESH)
                return
            if state.get("unsaved"):
                self._pending = None
                log.warning("fp8_state: the checkpoint holds no FP8 state (reading it failed "
                            "when it was saved); FP8 scales and amax histories start fresh")
                return
            if self._model is None:  # restored at FIT_START, once the model is known
                self._pending = state
                return
            self._pending = None
            self._restore(state)
        except FP8StateError:
            raise
        except Exception as error:  # our bug, or a checkpoint malformed past our checks
            if device_failure(error):
                raise
            log.debug("fp8_state: restore failed", exc_info=True)
            self._mismatch(f"fp8_state: the checkpoint's FP8 state could not be restored "
                           f"({_described(error)})", "the modules not yet restored fresh")

    def _this_rank(self, state: dict[str, Any], saved_with: FP8Recipe | None,
                   ) -> tuple[FP8ModuleState, list[str]]:
        """This rank's saved state, and what combining other ranks' found wrong. Combined on
        another number of ranks, and where this run turns `reduce_amax` on (the checkpoint's
        was off): each rank's own history would otherwise keep its own scales for
        `amax_history_len` steps, which reduced amaxes never give."""
        ranks = state.get("ranks")
        if ranks is None:
            return state.get("modules", {}), []
        world, rank = dist.get_world_size(), dist.get_global_rank()
        now_reduced = (saved_with is not None and not saved_with.reduce_amax
                       and self._recipe is not None and self._recipe.reduce_amax)
        if len(ranks) == world and not now_reduced:
            return ranks[rank], []
        log.warning("fp8_state: the checkpoint holds different FP8 state on each of its %d "
                    "ranks, %s: every rank gets them combined as TE's amax reduction would "
                    "(amax histories: elementwise max over ranks; scales: the smallest); with "
                    "reduce_amax on, ranks hold the same state and nothing is combined",
                    len(ranks), f"this run has {world}" if len(ranks) != world else
                    "saved with reduce_amax off, this run reduces amaxes")
        return combine_ranks(ranks)

    def _mismatch(self, message: str, outcome: str) -> None:
        """`message`: what does not fit; `outcome`: what `strict: false` continues with."""
        if self.strict:  # one line: an exception being handled is at debug, not chained
            raise FP8StateError(f"{message} (set fp8_state: {{strict: false}} to continue with "
                                f"{outcome})") from None
        log.warning("%s; continuing with %s", message, outcome)

    def _restore(self, state: dict[str, Any]) -> None:
        assert self._model is not None
        run = self._recipe
        try:
            saved_with = saved_recipe(state)
        except StateProblems as error:
            self._mismatch(f"fp8_state: the checkpoint's recipe is not readable ({error})",
                           _FRESH)
            return
        saved, problems = self._this_rank(state, saved_with)
        keeps_state = [n for n, t in saved.items()
                       if any(v.numel() for k, v in t.items() if k.endswith("_amax_history"))]
        if run is not None and run.scaling != "delayed":
            if saved_with is not None and saved_with.scaling == run.scaling:
                # saved under this scaling, only recorded amaxes are delayed-scaling state: its
                # histories before 2026-12-01 were fp8_state's padding, zeros ("none recorded")
                keeps_state = [n for n in keeps_state if any(
                    bool(v.any()) for k, v in saved[n].items() if k.endswith("_amax_history"))]
            if keeps_state:  # a delayed-scaling checkpoint: nothing of it applies
                what = (f"{recipe_change(saved_with, run)}, which keeps no amax histories"
                        if saved_with is not None and saved_with.scaling != run.scaling else
                        f"it holds delayed-scaling amax histories ({keeps_state[0]}, ...), "
                        f"this run's recipe keeps none ({run.as_config()})")
                self._mismatch(f"fp8_state: checkpoint FP8 state does not fit (recipe "
                               f"changed?): {what}", "nothing restored")
            return
        change = recipe_change(saved_with, run)
        if change:
            assert saved_with is not None and run is not None  # a change needs both
            fitted = (", histories fitted to the new length as TE does"
                      if saved_with.amax_history_len != run.amax_history_len else "")
            fresh = saved_with.scaling != "delayed"
            # TE keeps a loaded scale until its next update: that first step would cast with
            # the old recipe's scales, so ours are recomputed now (`recomputed_scales`)
            keys = scale_keys_changed(saved_with, run)
            how = (f"scales recomputed for the new {'/'.join(keys)} from the saved amax "
                   "histories now (TE would keep the saved ones until its next update)" if keys
                   else "scales recomputed under this recipe at the next update")
            self._mismatch(f"fp8_state: checkpoint FP8 state does not fit (recipe changed?): "
                           f"{change}", _FRESH if fresh else f"the saved state{fitted}, {how}")
            if fresh:
                return
        modules = dict(fp8_modules(self._model))
        # judged as fp8_guard judges them: a TE module outside Composer's amp_fp8 (`fc_type: te`
        # under amp_bf16, beside emulated layers) never runs in FP8, so it holds no FP8 state
        # and saved none (TE 2.20.2 pytorch/module/base.py:1543-1552); one the checkpoint holds
        # state for is still restored, at its first FP8 forward
        running = {name for name, module in modules.items()
                   if would_run_fp8(self._precision, *fp8_module_counts(module))}
        # TE modules this run's precision turned FP8 on or off for since the checkpoint: not a
        # change of te_swap's layers, and no FP8 state is lost (one that saved state keeps it)
        turned_on = sorted(
            name for name in running - saved.keys()
            if self._saved_precision not in (None, self._precision)
            and not would_run_fp8(self._saved_precision, *fp8_module_counts(modules[name])))
        turned_off = sorted(saved.keys() & modules.keys() - running)
        if turned_on or turned_off:
            log.warning(_precision_changed(self._saved_precision, self._precision, turned_on,
                                           turned_off))
        running -= set(turned_on)
        missing = sorted(running - saved.keys())
        unexpected = sorted(saved.keys() - modules.keys())
        # out of FP8 now, as the checkpoint's fp8_guard held them and its advice says to keep
        # them (te_swap's exclude): they ran in high precision already, nothing is lost
        held = set(_guard_fallbacks(self._loaded_entries or {}))
        dropped = [name for name in unexpected if short_layer(name) in held]
        if dropped:
            unexpected = [name for name in unexpected if name not in dropped]
            log.info("fp8_state: not in FP8 in this run, and in high precision at the "
                     "checkpoint by fp8_guard's fallback: %s; their saved FP8 state is left "
                     "out", _shown(dropped))
        if running and not {"modules", "ranks"} & state.keys():  # every save writes `modules`
            log.warning("fp8_state: the checkpoint's fp8_state entry holds no modules (left out "
                        "by load_ignore_keys?); FP8 scales and amax histories start fresh")
            return
        if running and not saved:  # a run without FP8 modules saved it (fp8_state in its YAML)
            log.warning("fp8_state: the checkpoint holds no FP8 state (saved by a run without "
                        "FP8 modules); FP8 scales and amax histories start fresh, as expected "
                        "when converting a bf16 checkpoint")
            return
        if not modules and unexpected:
            self._mismatch(f"fp8_state: the checkpoint holds the FP8 state of {len(unexpected)} "
                           "modules, this run has no FP8 module (te_swap left out, or FP8 "
                           "turned off?)", "nothing restored")
            return
        if missing or unexpected:
            self._mismatch(_layers_changed(missing, unexpected),
                           "the modules in both restored, the others' FP8 state fresh")
        # a length change is the recipe change named above: not found again per module
        named_length = saved_with.amax_history_len if change and saved_with is not None else None
        checked, fresh, found = checked_modules(modules.keys() & saved.keys(), saved, saved_with,
                                                run, named_length)
        problems += found
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                               if len(problems) > 3 else "")
            if self.strict:
                raise FP8StateError(f"fp8_state: checkpoint FP8 state refused: {shown} (set "
                                    f"fp8_state: {{strict: false}} to repair it by TE's rules)")
            log.warning("fp8_state: checkpoint FP8 state repaired by TE's rules: %s%s", shown,
                        f" (beyond repair, started fresh: {_shown(fresh)})" if fresh else "")
        # every module checked before any is written or waits for its first FP8 forward, so
        # a refusal (strict) leaves the model's FP8 state as it was
        later = {n for n in checked if not read_fp8_meta(modules[n])}  # TE before its first
        shapes = {}
        for name in checked.keys() - later:
            try:
                write_fp8_meta(modules[name], checked[name], check_only=True)
            except ValueError as error:
                shapes[name] = f"{name} ({error})"
        if shapes:
            self._mismatch("fp8_state: checkpoint FP8 state does not fit (recipe changed?): "
                           + "; ".join(shapes[n] for n in sorted(shapes)),
                           "those modules not restored")
        waiting = self._waiting = _Waiting({n: checked[n] for n in later - shapes.keys()},
                                           self._mismatch, self.strict)
        for name, tensors in checked.items():
            if name in later:
                self._hooks.append(_restore_at_first_forward(
                    modules[name], tensors,
                    lambda message, name=name: waiting.settle(name, message)))
            elif name not in shapes:
                write_fp8_meta(modules[name], tensors)
        log.info("fp8_state: restored amax history and scales of %d modules",
                 len(checked.keys() - shapes.keys() - set(turned_off)))


def saved_state_template(entry: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """fp8_state's FP8 state in a sharded checkpoint, asked for as saved: DCP reads only what
    the load template asks for, into tensors of the template's sizes, so the state before fit
    is replaced by zeros of each saved tensor's size and dtype, `modules` and the per-rank
    `ranks` alike. DCP then loads the checkpoint's state whole, and `load_state_dict` judges it
    as in a whole-file load: modules added to or left out of FP8, another history length,
    another number of ranks, TE modules whose state shape no template could guess before their
    first forward (DotProductAttention's 3 GEMMs). The saved values (`unsaved`, `recipe`) are
    asked for as saved too, by a placeholder DCP replaces: the template's own were left out
    where the checkpoint lacks them (a checkpoint saved `unsaved` then read as an empty FP8
    state) or refused where their layout differs (a run without FP8, `recipe: None`, resuming
    an FP8 run's). `saved`: DCP's metadata by key below the entry (module names hold dots;
    fields do not)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    ranks: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, meta in saved.items():
        size = getattr(meta, "size", None)  # a tensor's (TensorStorageMetadata)
        head, _, rest = key.partition(".")
        if size is None and head not in ("modules", "ranks"):
            _placeholder(entry, key.split("."))
        if size is None or not rest:
            continue
        into = modules if head == "modules" else None
        if head == "ranks":
            index, _, rest = rest.partition(".")
            into = ranks.setdefault(int(index), {}) if index.isdigit() else None
        name, _, field = rest.rpartition(".")
        if into is not None and name:
            into.setdefault(name, {})[field] = torch.zeros(size, dtype=meta.properties.dtype)
    if modules:
        entry["modules"] = modules
    if ranks:
        entry["ranks"] = [ranks.get(i, {}) for i in range(max(ranks) + 1)]


def _qualnames(cls: type) -> list[str]:
    """The names Composer may keep `cls`'s entry under (`type(callback).__qualname__`,
    composer/core/state.py): its own and its subclasses' known to this process."""
    return [cls.__qualname__, *(n for sub in cls.__subclasses__() for n in _qualnames(sub))]


def _placeholder(entry: dict[str, Any], path: list[str]) -> None:
    """A value at `path` for DCP to load the saved one into; what was there is replaced."""
    for part in path[:-1]:
        if not isinstance(entry.get(part), dict):
            entry[part] = {}
        entry = entry[part]
    entry[path[-1]] = None


def _holds_fp8_state(entry: Any) -> bool:
    """Whether fp8_state's checkpoint entry holds FP8 state, or would have (`unsaved`: the
    save failed): a bf16 run with fp8_state in its YAML saves `modules` empty."""
    return isinstance(entry, Mapping) and bool(
        entry.get("modules") or entry.get("ranks") or entry.get("unsaved"))


def _layers_changed(missing: list[str], unexpected: list[str]) -> str:
    """One line for a checkpoint whose FP8 modules are not the model's: mostly te_swap's layer
    selection changed between the runs (a resume with a new include/exclude), so that is named;
    each side counted and shown up to 5 names (a real model has hundreds). Modules without
    saved state may also be a `load_ignore_keys` glob's doing (Composer drops them before any
    callback sees the checkpoint), so that is named too; and `fuse_ln_mlp` where an MLP's
    FP8 modules are the other layout's (one te.LayerNormMLP at `ffn`, or its two layers), which
    changing it leaves: its weights load renamed (`composer.plain`), its FP8 state does not."""
    ignored = ", another model, or saved state left out by load_ignore_keys" if missing else \
        ", or another model"
    refused = set(missing) | set(unexpected)
    fusion = sorted(name for name in refused
                    if {f"{name}.{plain}" for plain in MPT_MLP_LINEARS} <= refused)
    ways = [f"{n} MLP(s) saved {way}" for n, way in (
        (sum(name in unexpected for name in fusion), "fused, now plain"),
        (sum(name in missing for name in fusion), "plain, now fused")) if n]
    fused = (f"te_swap's fuse_ln_mlp changed: {' and '.join(ways)} ({_shown(fusion)}), "
             f"a te.LayerNormMLP's FP8 state does not carry over to ffn.up_proj and "
             f"ffn.down_proj or back; or " if fusion else "")
    return (f"fp8_state: the checkpoint's FP8 modules differ from this run's ({fused}te_swap's "
            f"include/exclude/keep_first_blocks/keep_last_blocks changed{ignored}?): "
            f"{len(missing)} in FP8 now without saved state"
            f"{': ' + _shown(missing) if missing else ''}; {len(unexpected)} saved, not in FP8 "
            f"now{': ' + _shown(unexpected) if unexpected else ''}")


def _saved_run(serialized: Any) -> tuple[str | None, bool]:
    """The precision a checkpoint's run trained under (Composer's `metadata`, None if not
    recorded) and whether that run computed in FP8: under amp_fp8, or with te_swap among its
    algorithms (Composer keeps their class names, composer/core/state.py)."""
    if not isinstance(serialized, Mapping):
        return None, False
    metadata = serialized.get("metadata")
    precision = metadata.get("precision") if isinstance(metadata, Mapping) else None
    precision = precision if isinstance(precision, str) else None
    algorithms = serialized.get("algorithms")
    names = [item[0] for item in algorithms if isinstance(item, (tuple, list)) and item] \
        if isinstance(algorithms, list) else []
    return precision, precision == "amp_fp8" or TESwap.__name__ in names


def _precision_changed(saved: str | None, now: str, turned_on: list[str],
                       turned_off: list[str]) -> str:
    """One line for TE modules whose FP8 the run's precision turned on (`turned_on`: saved no
    state) or off (`turned_off`: their saved state is kept, `_local_state`) since the
    checkpoint: TE computes in FP8 only under amp_fp8 (`would_run_fp8`)."""
    change = f"precision {saved} -> {now} since the checkpoint" if saved not in (None, now) \
        else f"under this run's precision {now}"
    said = []
    if turned_on:
        said.append(f"{len(turned_on)} TE module(s) run in FP8 now and start FP8 scaling fresh "
                    f"(they saved none): {_shown(turned_on)}")
    if turned_off:
        said.append(f"{len(turned_off)} TE module(s) do not run in FP8 now, their saved FP8 "
                    f"scales and amax histories kept unused for a later amp_fp8 resume: "
                    f"{_shown(turned_off)}")
    return f"fp8_state: {change}: {'; '.join(said)}"


def _guard_fallbacks(entries: Mapping[str, Any]) -> list[str]:
    """The layers (`short_layer` names) fp8_guard held in high precision in a checkpoint, from
    its callback entries; none where its entry is missing or broken (a broken one is the
    guard's to report: its fit_start does)."""
    try:
        guard = next((entries[n] for n in _qualnames(FP8Guard) if n in entries), None)
        core = checkpointed_core(guard or {}) or {}
        return [Fallback.from_dict(item).layer for item in core.get("fallbacks", ())]
    except (TypeError, ValueError, KeyError, AttributeError):
        return []


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _described(error: Exception) -> str:
    """`TypeName: first line` of an exception, for a one-line message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def _same_state(a: FP8ModuleState, b: FP8ModuleState) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n])
        for n in a)


class _Waiting:
    """The restores waiting for TE modules' first FP8 forward. A failure they share (the same
    bug, a recipe that keeps no state) was one warning per module, hundreds in a real model: it
    is one line per kind of failure, counting the modules, said once every waiting module has
    settled, or at the batch's end for those that had their forward. Under `strict` the first
    failure raises at once (`mismatch`)."""

    def __init__(self, waiting: FP8ModuleState, mismatch: Callable[[str, str], None],
                 strict: bool):
        self._waiting, self._mismatch, self._strict = dict(waiting), mismatch, strict
        self._failed: dict[str, list[str]] = {}

    def unrestored(self, name: str) -> dict[str, torch.Tensor]:
        """The checked state `name` waits for (empty once settled, or if it waits for none)."""
        return dict(self._waiting.get(name, {}))

    def settle(self, name: str, message: str | None) -> None:
        """`name`'s restore is over: done (`message` None) or failed."""
        self._waiting.pop(name, None)
        if message is not None:
            self._failed.setdefault(message, []).append(name)
        if not self._waiting or (self._strict and message is not None):
            self.say()

    def say(self) -> None:
        failed, self._failed = self._failed, {}
        for message, names in failed.items():
            if len(names) == 1:
                self._mismatch(f"{message} ({names[0]})", "that module not restored")
            else:
                self._mismatch(f"{message} ({len(names)} modules: {_shown(sorted(names))})",
                               "those modules not restored")


def _restore_at_first_forward(module: nn.Module, tensors: dict[str, torch.Tensor],
                              settle: Callable[[str | None], None]
                              ) -> torch.utils.hooks.RemovableHandle:
    """TE creates a module's scaling state in its first FP8 forward; create it a moment earlier
    and write the saved values.

    The pre-hook runs inside the model forward, so inside Composer's FP8 autocast, where
    `te.backend.init_fp8_state` (the call TE's own forward makes first, 3 forward tensors per
    GEMM) builds the state for the active recipe; TE's forward then finds it initialised for
    the same recipe and keeps it. Forwards outside FP8 (eval) leave the hook
    waiting; a run whose recipe keeps no such state (current scaling), one that does not fit
    the checkpoint, and a failure of ours are reported through `settle` (None: restored), once:
    the hook is gone after its first FP8 forward, whatever happened. Returns its handle.
    """

    def pre_hook(mod: nn.Module, args: Any) -> None:
        """Inside the training forward: a failure of ours is said through `settle`
        (FP8StateError under strict, else a warning), its traceback at debug; a device error
        goes on as raised."""
        del args
        try:
            restore(mod)
        except FP8StateError:
            raise
        except Exception as error:
            handle.remove()  # tried once: a failing hook would fail at every forward
            if device_failure(error):
                raise
            log.debug("fp8_state: restore at the first FP8 forward failed", exc_info=True)
            settle(f"fp8_state: the checkpoint's FP8 state could not be restored at the "
                   f"module's first FP8 forward ({_described(error)})")

    def restore(mod: nn.Module) -> None:
        if not read_fp8_meta(mod):
            fp8_on = te_backend.init_fp8_state(mod, num_gemms=len(tensors["fwd_scale"]) // 3)
            if not read_fp8_meta(mod) and not fp8_on:
                return  # FP8 is off in this forward: wait for one with FP8
        handle.remove()
        if not read_fp8_meta(mod):
            settle("fp8_state: the checkpoint holds delayed-scaling FP8 state, but this "
                   "run's recipe keeps none (current scaling?)")
            return
        try:
            write_fp8_meta(mod, tensors)
        except ValueError as error:
            settle(f"fp8_state: checkpoint FP8 state does not fit (recipe changed?): {error}")
            return
        settle(None)

    # eager under torch.compile (`compile_config`), as fp8_guard's and fp8_stats' hooks: traced,
    # Dynamo went into TE's state creation and broke the graph there (4 breaks on CPU)
    handle = module.register_forward_pre_hook(torch.compiler.disable(pre_hook))
    return handle
