"""The plain model's view of a te_swap model, where LLM-Foundry and Composer expect it.

HF export: LLM-Foundry's `hf_checkpointer` gathers the model's state dict with torch's
`get_model_state_dict` and loads it with a strict `load_state_dict` into a fresh model built from
the model's config (llmfoundry/callbacks/hf_checkpointer.py, `_get_hf_model`, LLM-Foundry
0.21-0.22). The config still describes the plain MPT, so a fused te.LayerNormMLP's names fail
that load (`RuntimeError: Unexpected key(s) in state_dict`) at the first HF save, possibly hours
into a run. Composer's own checkpoints need those names, so the plain view
(`swap.plain_state_dict`) applies only while a checkpointer handles an event: its `run_event` is
wrapped to gather through it, the module's `get_model_state_dict` being swapped for the call and
put back after. The exported config gets TE's activation too: a fused te.LayerNormMLP trained
with TE's `gelu`, the tanh form (transformer_engine/common/util/math.h `gelu`), which MPT's
`ffn_act_fn` default (exact GELU, llmfoundry/models/layers/ffn.py `_FFN_ACT_FN_DEFAULT`) is not:
the export would compute another function of the trained weights (1e-3 on a tiny MPT's logits).
Where every block is fused its `ffn_act_fn` is the tanh GELU; where only some are, MPT's config
cannot say so per block (`block_overrides` takes attention keys only), and a warning says so,
unless the kept blocks' own activation is TE's GELU (`swap.is_te_gelu`).

Loads: Composer loads `load_path` through `State.load_model_state`, whose torch loader drops the
keys the model lacks before any load hook runs when it loads a full state dict (FSDP's
default), so a checkpoint whose blocks are in another layout is renamed to this run's first
(`swap.swapped_state_dict`): a plain one's `norm_2`/`ffn.up_proj` keys where this run fuses,
a fused one's `ffn.fc1_weight`... where it does not (`fuse_ln_mlp`, `exclude` or
`keep_first/last_blocks` changed), the optimizer state's names with them (torch's optimizer
loader raised `KeyError` on the first renamed parameter). A sharded (DCP) checkpoint is read by
the model's own keys, so its load gets a planner that reads them under the other layout's names
(`load_sharded_plain`).
LLM-Foundry's own `ffn_type: te_ln_mlp` checkpoint loads into a plain block too, its TE
`_extra_state` dropped, unless its te.LayerNormMLP computes something else than the block
(swiglu, another activation or norm: by the config Composer saves with it, TE's defaults for
what it leaves out, and by its keys and fc1's rows), which is refused in one line, whole file
or sharded alike (`swap.refuse_foreign_ln_mlps`; a sharded one before anything loads). A
fused block loaded plain computes the run's `ffn_act_fn` where it trained TE's tanh GELU: one
warning (none for ReLU, which TE's is).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger
from torch import nn

from foundry_fp8.fp8_meta import canonical_modules
from foundry_fp8.swap import (
    TE_GELU_ACT_FN,
    gelu_tanh_error,
    is_te_gelu,
    ln_mlp_layout,
    plain_state_dict,
    refuse_foreign_ln_mlps,
    swapped_state_dict,
    te_activation,
)
from foundry_fp8.te.facts import LN_MLP_SOURCES

log = logging.getLogger(__name__)

HF_CHECKPOINTER_MODULE = "llmfoundry.callbacks.hf_checkpointer"
_GATHER = "get_model_state_dict"


def export_plain(callbacks: Sequence[Callback]) -> int:
    """Make every LLM-Foundry `HuggingFaceCheckpointer` in `callbacks` export the plain model;
    returns how many. No checkpointer class loaded means none was built: nothing to do."""
    module = sys.modules.get(HF_CHECKPOINTER_MODULE)
    cls = getattr(module, "HuggingFaceCheckpointer", None)
    checkpointers = [c for c in callbacks if cls is not None and isinstance(c, cls)]
    if not checkpointers:
        return 0
    assert module is not None
    gather = getattr(module, _GATHER, None)
    if gather is None:
        log.warning("te_swap: this LLM-Foundry's hf_checkpointer does not gather the model with "
                    "%s; its HF export may fail on te_swap's TE keys (_extra_state, fused "
                    "LayerNormMLP names)", _GATHER)
        return 0
    for checkpointer in checkpointers:
        checkpointer.run_event = _plain_run_event(checkpointer, module, gather)
    return len(checkpointers)


def _kept_activations(model: nn.Module) -> tuple[int, list[Any]]:
    """(MPT blocks whose norm_2 + MLP te_swap fused into a te.LayerNormMLP with TE's gelu, the
    built activations (`ffn.act`, None where none) of those it kept). A block fused with TE's
    relu computes its own ffn_act_fn (`swap.te_activation`): neither. By the block's ffn: a
    wrapper (FSDP's) forwards both attributes to the block it wraps."""
    blocks = {id(m.ffn): m for m in model.modules() if hasattr(m, "norm_2") and hasattr(m, "ffn")}
    fused = [b for b in blocks.values() if ln_mlp_layout(b) == "fused"]
    kept = [getattr(b.ffn, "act", None) for b in blocks.values() if ln_mlp_layout(b) != "fused"]
    return sum(getattr(b.ffn, "activation", None) == "gelu" for b in fused), kept


def _te_activation(transform_config: Callable[[Any], Any], model: nn.Module,
                   warned: list[bool]) -> Callable[[Any], Any]:
    """The checkpointer's `transform_config`, giving the exported MPT config TE's tanh GELU
    where every block was fused (module docstring); `warned`: whether the mixed case was.
    The config is set on a copy: a subclass's `transform_config` may return the trained model's
    own (LLM-Foundry's deep-copies it, callbacks/hf_checkpointer.py:527, 0.21-0.22), which
    Composer's checkpoints then save."""

    def transform(original_config: Any) -> Any:
        config = transform_config(original_config)
        fused, kept = _kept_activations(model)
        ffn_config = getattr(config, "ffn_config", None)
        if not isinstance(ffn_config, dict) or not fused or (kept and all(map(is_te_gelu, kept))):
            return config  # no MPT config, nothing fused, or the kept blocks' GELU is TE's
        if not kept:
            config = copy.copy(config)
            config.ffn_config = {**ffn_config, "ffn_act_fn": dict(TE_GELU_ACT_FN)}
        elif not warned[0]:
            warned[0] = True
            log.warning("te_swap: the HF export computes MPT's exact GELU in all %d blocks, "
                        "but %d of them trained fused in te.LayerNormMLP with TE's tanh GELU "
                        "(up to %.1e apart per activation): MPT's config has no per-block "
                        "ffn_act_fn; fuse every block (keep_first/last_blocks 0) for an exact "
                        "export", fused + len(kept), fused, gelu_tanh_error()[0])
        return config

    return transform


def _plain_run_event(checkpointer: Callback, module: ModuleType,
                     gather: Callable[..., dict[str, Any]]) -> Callable[[Event, State, Logger],
                                                                          None]:
    run_event = checkpointer.run_event
    transform_config = checkpointer.transform_config  # type: ignore[attr-defined]
    warned = [False]

    def plain_gather(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state_dict = gather(model, *args, **kwargs)
        try:
            return plain_state_dict(state_dict, model)
        except Exception:  # our bug must not end the run: the checkpointer gets what it asked
            log.exception("te_swap: making the HF export's state dict plain failed")
            return state_dict

    @functools.wraps(run_event)
    def run(event: Event, state: State, logger: Logger) -> None:
        setattr(module, _GATHER, plain_gather)
        checkpointer.transform_config = _te_activation(  # type: ignore[attr-defined]
            transform_config, state.model, warned)
        try:
            run_event(event, state, logger)
        finally:
            setattr(module, _GATHER, gather)
            checkpointer.transform_config = transform_config  # type: ignore[attr-defined]

    return run


def load_plain(state: State) -> None:
    """Make Composer's loads into `state.model` take a checkpoint whose blocks are in another
    layout (plain where this run fuses them, or fused where it does not; module docstring), the
    optimizer state's parameter names included."""
    load = state.load_model_state

    @functools.wraps(load)
    def load_model_state(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_dict.get("model"), dict):
            renames = swapped_state_dict(state_dict["model"], state.model,
                                         _saved_ffn_config(state_dict))
            if renames:
                _rename_optimizer_state(state_dict.get("optimizers"), renames)
                _log_layout_change(renames, state.model)
        return load(state_dict, *args, **kwargs)

    state.load_model_state = load_model_state  # type: ignore[method-assign]


#: where Composer saves a HuggingFaceModel's config.json's `ffn_config` in its state
#: (composer/core/state.py `_get_integrations_state_dict`, composer/models/huggingface.py
#: `get_metadata`, 0.31-0.32)
_FFN_CONFIG_PATH = ("integrations", "huggingface", "model", "config", "content", "ffn_config")


def _saved_ffn_config(state_dict: dict[str, Any]) -> Any:
    """The checkpoint's MPT `ffn_config` (None where it has none), from Composer's state."""
    node: Any = state_dict
    for key in _FFN_CONFIG_PATH:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _rename_optimizer_state(optimizers: Any, renames: dict[str, str]) -> None:
    """Composer's `state["optimizers"]`, {optimizer class: torch's `get_optimizer_state_dict`},
    keys each parameter's state and its param group's `params` by the parameter's name
    (composer/core/state.py `get_optim_state_dict`, 0.31-0.32), as the model's state dict: the
    same renames. `State.load_state_dict` loads the model first, then the optimizers from the
    same dict. Older checkpoints' integer ids have no name to rename."""
    for optimizer in (optimizers or {}).values():
        if not isinstance(optimizer, dict):
            continue
        per_param = optimizer.get("state")
        if isinstance(per_param, dict):
            for old in [k for k in per_param if k in renames]:
                per_param[renames[old]] = per_param.pop(old)
        for group in optimizer.get("param_groups") or []:
            group["params"] = [renames.get(p, p) if isinstance(p, str) else p
                               for p in group.get("params", [])]


def _log_layout_change(renames: dict[str, str], model: nn.Module) -> None:
    """Logs the renames; warns once where blocks trained with TE's tanh GELU now compute
    another activation (~1e-3 in the logits: LLM-Foundry shows no INFO of this logger)."""
    up = ".ffn.up_proj.weight"
    to_fused = sum(new.endswith(".ffn.fc1_weight") for new in renames.values())
    to_plain = {new.removesuffix(up) for new in renames.values() if new.endswith(up)}
    log.info("te_swap: the checkpoint's layout differs from this run's: %d block(s) saved "
             "with a plain norm_2 + MLP load into this run's fused te.LayerNormMLP, %d saved "
             "fused load into a plain norm_2 + MLP (weights and optimizer state renamed)",
             to_fused, len(to_plain))
    other = sum(name in to_plain and te_activation(act := getattr(block.ffn, "act", None)) != "relu"
                and not is_te_gelu(act) for name, block in canonical_modules(model))
    if other:
        act_fn = ", ".join(f"{k}: {v}" for k, v in TE_GELU_ACT_FN.items())
        log.warning("te_swap: %d block(s) of the checkpoint trained fused in te.LayerNormMLP "
                    "with TE's tanh GELU load into this run's plain MLP, which computes its "
                    "ffn_act_fn instead (MPT's default, exact GELU, is up to %.1e apart per "
                    "activation); to keep TE's, set model ffn_config.ffn_act_fn: {%s}",
                    other, gelu_tanh_error()[0], act_fn)


#: te_swap's Trainers' states, from INIT to close: a sharded load into one of them reads keys
#: under the other layout's names (`load_sharded_plain`)
_LAYOUT_STATES: weakref.WeakSet[State] = weakref.WeakSet()
_installed: list[Callable[..., Any]] = []  # the load_sharded_checkpoint wrapper, while in place


def load_sharded_plain(state: State) -> Callable[[], None]:
    """Make Composer's sharded (DCP) loads into `state` read a checkpoint whose blocks are in
    another layout, as `load_plain` does a whole file; returns what undoes it (te_swap's close).

    Composer builds the load template from the model's own keys and has DCP fill it in place
    (composer/utils/checkpoint.py `load_sharded_checkpoint`, 0.31-0.32), so DCP's planner
    refused a key the checkpoint lacked ("Missing key in checkpoint state_dict"). Its planner
    comes from `fsdp_config.load_planner`, which FSDP2Config cannot set (a property that
    returns None). So `load_sharded_checkpoint`, which `load_checkpoint` calls by its module
    name (for `load_path`, autoresume and the LoadCheckpoint callback alike), is wrapped while
    some te_swap state is registered: for a load into a registered state only, and for that
    call only, `dist_cp_load` gets a planner that reads each missing key from the other
    layout's name, weights and optimizer state alike, and the optimizer's parameter names back.
    Another Trainer's load, or one after the state's Trainer failed, is Composer's own."""
    from composer.utils import checkpoint

    _LAYOUT_STATES.add(state)
    if checkpoint.load_sharded_checkpoint not in _installed:
        _installed[:] = [_into_registered_states(checkpoint.load_sharded_checkpoint)]
        checkpoint.load_sharded_checkpoint = _installed[0]

    def undo() -> None:
        _LAYOUT_STATES.discard(state)
        wrapper = checkpoint.load_sharded_checkpoint
        if not _LAYOUT_STATES and wrapper in _installed:
            checkpoint.load_sharded_checkpoint = wrapper.__wrapped__  # type: ignore[attr-defined]
            _installed.clear()

    return undo


def _into_registered_states(load_sharded: Callable[..., Any]) -> Callable[..., Any]:
    """`load_sharded_checkpoint`, with `dist_cp_load` given the layout planner during a load
    into a registered state (put back after, also where the load raises)."""
    signature = inspect.signature(load_sharded)

    @functools.wraps(load_sharded)
    def load_sharded_checkpoint(*args: Any, **kwargs: Any) -> Any:
        state = signature.bind(*args, **kwargs).arguments.get("state")
        if state not in _LAYOUT_STATES:
            return load_sharded(*args, **kwargs)
        from composer.utils import checkpoint

        load = checkpoint.dist_cp_load

        @functools.wraps(load)
        def layout_load(state_dict: dict[str, Any], storage_reader: Any,
                        load_planner: Any = None) -> None:
            _refuse_foreign_sharded(state.model, storage_reader)
            planner = _layout_planner(state.model) if load_planner is None else load_planner
            load(state_dict, storage_reader, planner)

        checkpoint.dist_cp_load = layout_load
        try:
            return load_sharded(*args, **kwargs)
        finally:
            if checkpoint.dist_cp_load is layout_load:
                checkpoint.dist_cp_load = load

    return load_sharded_checkpoint


#: Composer's sharded checkpoints hold the state under this key, the model's under "model"
#: (`load_sharded_checkpoint`'s template, composer/utils/checkpoint.py, 0.31-0.32); DCP names
#: each leaf by its path joined with dots
_STATE = "state"


def _refuse_foreign_sharded(model: nn.Module, storage_reader: Any) -> None:
    """`swap.refuse_foreign_ln_mlps` for a sharded checkpoint, before anything loads: tensor
    shapes from DCP's metadata (`TensorStorageMetadata.size`), the `ffn_config` Composer saved
    read on its own (`_sharded_ffn_config`) where some block's te.LayerNormMLP is there to
    judge. DCP keeps a key the model lacks out of the load without a word, so without this a
    te.LayerNormMLP another block computes differently (LLM-Foundry's own `te_ln_mlp`, LayerNorm
    whatever the `norm_type`; `activation: relu`) loaded as this run's block."""
    saved = storage_reader.read_metadata().state_dict_metadata
    model_prefix = f"{_STATE}.model."
    shapes = {k.removeprefix(model_prefix): tuple(getattr(md, "size", ())) or None
              for k, md in saved.items() if k.startswith(model_prefix)}
    if any(k.endswith("ffn.fc1_weight") for k in shapes):
        refuse_foreign_ln_mlps(model, shapes, _sharded_ffn_config(storage_reader, saved))


def _sharded_ffn_config(storage_reader: Any, saved: dict[str, Any]) -> Any:
    """The `ffn_config` in a sharded checkpoint's Composer state (`_saved_ffn_config`), None
    where it has none: DCP saved each of its leaves (flattened, torch's `_traverse.py`) as
    bytes, read here with this rank's reader alone (`no_dist`: no collective another rank
    would not make)."""
    import torch.distributed.checkpoint as dcp

    prefix = ".".join((_STATE, *_FFN_CONFIG_PATH)) + "."
    leaves: dict[str, Any] = {k: None for k in saved if k.startswith(prefix)}
    if not leaves:
        return None
    dcp.load(leaves, storage_reader=storage_reader, no_dist=True)
    config: dict[str, Any] = {}
    for key, value in leaves.items():
        *parents, last = key.removeprefix(prefix).split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def _layout_pairs(model: nn.Module) -> dict[str, str]:
    """{this run's key: the other layout's} for each fused or plain block's norm_2 + MLP."""
    pairs: dict[str, str] = {}
    for name, block in canonical_modules(model):
        layout = ln_mlp_layout(block)
        if layout is None:
            continue
        prefix = f"{name}." if name else ""
        for te_name, plain in LN_MLP_SOURCES.items():
            fused = f"ffn.{te_name}"
            own, other = (fused, plain) if layout == "fused" else (plain, fused)
            pairs[prefix + own] = prefix + other
    return pairs


#: the missing keys Composer's `dist_cp_load` retries with `DefaultLoadPlanner(allow_partial_load=
#: True)` (composer/utils/checkpoint.py, 0.31-0.32: `Missing key.+Adam.+decoupled_weight_decay`)
_ADAM_RETRIED = re.compile(r"Adam.+decoupled_weight_decay")


def _layout_planner(model: nn.Module) -> Any:
    """torch's DefaultLoadPlanner, reading a key the checkpoint lacks under its other-layout
    name (torch 2.7 distributed/checkpoint/default_planner.py: `set_up_planner` flattens the
    template into `state_dict`/`mappings`, tensors load in place by those keys, other objects
    through `load_bytes`)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    pairs = _layout_pairs(model)

    class LayoutLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict: Any, metadata: Any = None,
                           is_coordinator: bool = False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            saved = metadata.state_dict_metadata
            self.names: dict[str, str] = {}  # the checkpoint's parameter name: this run's
            for key in [k for k in self.state_dict if k not in saved]:
                for own, other in pairs.items():
                    if f".{own}." in f".{key}.":
                        renamed = f".{key}.".replace(f".{own}.", f".{other}.", 1)[1:-1]
                        if renamed in saved:
                            self.state_dict[renamed] = self.state_dict.pop(key)
                            if self.flatten_state_dict:
                                self.mappings[renamed] = self.mappings.pop(key)
                            self.names[other] = own
                        break
            if self.names:
                # Composer's dist_cp_load reloads a checkpoint that lacks these (torch 2.6's
                # Adam) with a partial-load planner of its own, which would skip the renamed
                # keys: they keep the template's values here, as that reload leaves them
                for key in [k for k in self.state_dict
                            if k not in saved and _ADAM_RETRIED.search(k)]:
                    del self.state_dict[key]
                if is_coordinator:
                    _log_layout_change(self.names, model)

        def load_bytes(self, read_item: Any, value: Any) -> None:
            super().load_bytes(read_item, value)
            if not self.names:
                return
            fqn = read_item.dest_index.fqn  # param_groups' `params`: parameter names
            path = self.mappings[fqn] if self.flatten_state_dict else (fqn,)
            node: Any = self.original_state_dict if self.flatten_state_dict else self.state_dict
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = _renamed(node[path[-1]], self.names)

    return LayoutLoadPlanner()


def _renamed(value: Any, names: dict[str, str]) -> Any:
    """`value` with every string naming a renamed parameter (also in lists and dicts) renamed."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, list):
        return [_renamed(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _renamed(v, names) for k, v in value.items()}
    return value
