"""TE's pickled `_extra_state` in checkpoints, kept loadable by every TE we support.

TE stores a module's delayed-scaling state as a pickled `_extra_state` tensor. TE 2.16.1, 2.17.1
and >= 2.18 refuse to unpickle a delayed-scaling one without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE
(pytorch/_extra_state.py; `facts.refuses_pickled_extra_state`), before any callback could help;
`fp8_state` keeps the state itself and saves a pickled `None` in its place, which TE's
`set_extra_state` reads as "no state" on every TE from 1.12 to 2.20 (an empty tensor is skipped
only from TE 2.4: older TE fails to unpickle it; see `facts`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

EXTRA_STATE_SUFFIX = "_extra_state"

#: A key of TE's pickled delayed-scaling state (TE 2.20 pytorch/module/base.py
#: `get_extra_state`; pytorch/_extra_state.py `_FLOAT8_DELAYED_SCALING_STATE_KEYS`).
_TE_SCALING_KEY = b"amax_history_fwd"


def inert_extra_state() -> torch.Tensor:
    """A pickled `None` as TE's uint8 extra-state tensor: TE's `set_extra_state` returns on a
    `None` state, and TE >= 2.16.1 classifies a pickle without globals as safe to ignore
    (`pytorch/_extra_state.py`), so it loads without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE."""
    return torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)


def extra_state_missing(state_dict: Mapping[str, Any], key: str) -> bool:
    """Whether a load would give TE's `set_extra_state` no `_extra_state` of its own under `key`:
    none, or one TE cannot read. TE takes None, a tensor or (TE 1.x) a BytesIO; anything else
    raises "Unsupported checkpoint format." (TE 2.20.2 pytorch/module/base.py:1419-1443; te.ops'
    LayerNorm calls `.numel()` on it, ops/op.py:713). torch's `set_model_state_dict` with a full
    state dict (Composer's FSDP default) hands a module whose key the checkpoint lacks its
    `_EXTRA_STATE()` placeholder (torch/distributed/checkpoint/state_dict.py, torch 2.7 and 2.11:
    `_iterate_valid_model_state`, then `_load_model_state_dict`'s `state_dict.update(
    local_state_dict)`)."""
    if key not in state_dict:
        return True
    return not (state_dict[key] is None or isinstance(state_dict[key], (torch.Tensor, io.BytesIO)))


def has_extra_state(module: nn.Module) -> bool:
    """Whether `module.state_dict()` holds an `_extra_state` key (TE's modules do): torch adds
    one where the class overrides `get_extra_state`."""
    return type(module).get_extra_state is not nn.Module.get_extra_state


def inert_when_missing_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                            *args: Any) -> None:
    """A load_state_dict pre-hook giving `module` the inert `_extra_state` where the load holds
    none TE can read (`extra_state_missing`), so TE keeps the FP8 metadata it has: a checkpoint
    of torch layers (a bf16 run's) or te_swap's, loaded by torch's full-state-dict loader
    (Composer under FSDP `state_dict_type: full`), would hand TE torch's placeholder, which TE
    2.20.2 refuses (pytorch/module/base.py:1443), and a strict load without FSDP would stop on
    the missing key. Not for TE's `fp8_model_init` modules, which read the key before any
    pre-hook runs (base.py:1925-1928)."""
    del args
    key = prefix + EXTRA_STATE_SUFFIX
    if has_extra_state(module) and extra_state_missing(state_dict, key):
        state_dict[key] = inert_extra_state()


def without_pickled_extra_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a model state_dict whose `_extra_state` entries hold no pickled state.

    The keys stay (a strict load expects them); TE then loads the checkpoint without
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE. The FP8 state they held is what `fp8_state` saves.
    """
    return {k: inert_extra_state() if k.split(".")[-1] == EXTRA_STATE_SUFFIX else v
            for k, v in state_dict.items()}


def inert_extra_state_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                           local_metadata: Any) -> None:
    """A state_dict post-hook saving `module`'s `_extra_state` as a pickled `None`."""
    del module, local_metadata
    key = prefix + EXTRA_STATE_SUFFIX
    if key in state_dict:
        state_dict.update(without_pickled_extra_state({key: state_dict[key]}))


def holds_te_scaling_state(state_dict: Mapping[str, Any]) -> bool:
    """Whether a model state_dict's `_extra_state` holds TE's own delayed-scaling state (a
    checkpoint saved without fp8_state), which TE's `set_extra_state` restores as saved. Read
    as TE classifies it, by the strings in the pickle (a pickle stores a dict's keys as their
    UTF-8 bytes), never unpickled."""
    for key, value in state_dict.items():
        if not (isinstance(key, str) and key.split(".")[-1] == EXTRA_STATE_SUFFIX):
            continue
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
            data = value.detach().cpu().numpy().tobytes()
        elif isinstance(value, io.BytesIO):  # TE's format before the uint8 tensor
            data = value.getvalue()
        else:
            continue
        if _TE_SCALING_KEY in data:
            return True
    return False
