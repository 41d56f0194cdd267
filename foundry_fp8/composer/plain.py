"""The plain model's view of a te_swap model, where LLM-Foundry and Composer expect it.

HF export: LLM-Foundry's `hf_checkpointer` gathers the model's state dict with torch's
`get_model_state_dict` and loads it with a strict `load_state_dict` into a fresh model built from
the model's config (llmfoundry/callbacks/hf_checkpointer.py, `_get_hf_model`, LLM-Foundry
0.21-0.22). The config still describes the plain MPT, so a fused te.LayerNormMLP's names fail
that load (`RuntimeError: Unexpected key(s) in state_dict`) at the first HF save, possibly hours
into a run. Composer's own checkpoints need those names, so the plain view
(`swap.plain_state_dict`) applies only while a checkpointer handles an event: its `run_event` is
wrapped to gather through it, the module's `get_model_state_dict` being swapped for the call and
put back after.

Loads: Composer loads `load_path` through `State.load_model_state`, whose torch loader drops the
keys the model lacks before any load hook runs when it loads a full state dict (FSDP's
default), so a plain checkpoint's `norm_2`/`ffn.up_proj` keys are renamed first
(`swap.swapped_state_dict`). A sharded (DCP) checkpoint is read by the model's own keys: a plain
one cannot fill fused layers, and DCP says which keys it lacks.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger
from torch import nn

from foundry_fp8.swap import plain_state_dict, swapped_state_dict

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
        checkpointer.run_event = _plain_run_event(checkpointer.run_event, module, gather)
    return len(checkpointers)


def _plain_run_event(run_event: Callable[[Event, State, Logger], None], module: ModuleType,
                     gather: Callable[..., dict[str, Any]]) -> Callable[[Event, State, Logger],
                                                                          None]:
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
        try:
            run_event(event, state, logger)
        finally:
            setattr(module, _GATHER, gather)

    return run


def load_plain(state: State) -> None:
    """Make Composer's loads into `state.model` take a plain checkpoint's names (above)."""
    load = state.load_model_state

    @functools.wraps(load)
    def load_model_state(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_dict.get("model"), dict):
            swapped_state_dict(state_dict["model"], state.model)
        return load(state_dict, *args, **kwargs)

    state.load_model_state = load_model_state  # type: ignore[method-assign]
