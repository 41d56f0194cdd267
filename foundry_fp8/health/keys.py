"""The metric key layout of FP8 statistics, written and read only through this module.

Per-layer series are `fp8_<stat>/<tensor>/<layer>`: W&B makes one section per text before the
first `/`, so each section holds one statistic. The layer comes last and may itself hold `/`.
Summary series are `fp8/<tensor>/<name>` (and `fp8/<name>` over all tensors): few, charted,
alertable, printed on the console. Plain Python.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

TENSORS = ("activation", "weight", "gradient")
LAYER_PREFIX = "fp8_"
LAYOUT = "fp8_<stat>/<tensor>/<layer>"  # the per-layer series, as the messages name it
SUMMARY_PREFIX = "fp8"
#: te_swap's hyperparameters (composer/te_swap.py, INIT): how many modules it converted
#: (LayerNorms included, a fused LN-MLP once), and how many of them and of TE's the model was
#: built with run their GEMMs in FP8 (`Decision.in_fp8`): the run's FP8 layers.
MODULES_CONVERTED = "fp8/modules_converted"
MODULES_IN_FP8 = "fp8/modules_in_fp8"
#: The training loss Composer's trainer logs at every batch, at the batch's step
#: (composer/trainer/trainer.py, `_train_loop`: `loss/train/total`); the report's --baseline
#: compares it.
LOSS = "loss/train/total"
#: Logged as 1 for a tensor cast with delayed scaling's initial scale 1 (no amax history yet).
INITIAL_SCALE = "initial_scale"
#: A marker as INITIAL_SCALE is: 1 for a row logged while its layer ran in high precision (never
#: converted, te_swap's exclude, or fp8_guard's fallback): its numbers are fp8_stats' what-if
#: casts, not the layer's own. fp8_stats logs it; the report also sets it from fp8_guard's
#: records; the heatmaps hatch such cells.
HIGH_PRECISION = "high_precision"
#: A marker as INITIAL_SCALE is, logged by fp8_stats: 1 for a row whose tensor its layer's FP8
#: run does not cast (dY under NVTE_BACKWARD_OVERRIDE): what-if numbers, judged only on the
#: high-precision tensor's NaN/Inf (`rules.uncast_judged`).
UNCAST = "uncast"
#: The markers: logged only where 1 (a row without one is not marked).
MARKERS = (INITIAL_SCALE, HIGH_PRECISION, UNCAST)
#: Summary names per tensor kind (`summary_key(tensor, name)`); `flagged_layers` also over all.
SUMMARIES = ("worst_underflow_pct", "worst_overflow_pct", "worst_cos_sim", "flagged_layers",
             "nonfinite")
_STAT = re.compile(r"[^/\s]+")  # any name without a `/` or space (TE has `underflows%`)
#: Module-name segments that are not layers: the Composer/HF wrappers' attribute names at the
#: front (`model.transformer.blocks.0...` -> `blocks.0...`); te_swap advice anchors on them.
FRONTS = ("model.", "transformer.")


def direction(tensor: str) -> Literal["forward", "backward"]:
    """Which pass casts a watched tensor, the half of a recipe's format it takes
    (`FP8Recipe.format_for`): the output gradient (`gradient`, TE's debug names for a
    LayerNormMLP's GEMMs `fc1_gradient`, `fc2_gradient`) the backward's, every GEMM input of the
    forward (`activation`, `weight`, `fc1_weight`, ...) the forward's."""
    return "backward" if tensor.rpartition("_")[2] == "gradient" else "forward"


def layer_key(stat: str, tensor: str, layer: str) -> str:
    """`fp8_underflow_pct/gradient/blocks.0.attn.Wqkv`."""
    if not _STAT.fullmatch(stat) or not tensor or "/" in tensor:
        raise ValueError(f"bad FP8 statistic or tensor name: {stat!r}, {tensor!r}")
    return f"{LAYER_PREFIX}{stat}/{tensor}/{layer}"


def summary_key(tensor: str | None, name: str) -> str:
    """`fp8/gradient/worst_underflow_pct`, or `fp8/flagged_layers` for `tensor=None`."""
    return f"{SUMMARY_PREFIX}/{name}" if tensor is None else f"{SUMMARY_PREFIX}/{tensor}/{name}"


def parse_key(key: str) -> tuple[str, str, str] | None:
    """(stat, tensor, layer) of a per-layer key; None for any other key (summaries included).
    Everything after the second `/` is the layer, so a `/` in a layer name survives."""
    if not key.startswith(LAYER_PREFIX):
        return None
    head, _, rest = key.partition("/")
    tensor, _, layer = rest.partition("/")
    stat = head.removeprefix(LAYER_PREFIX)
    if not _STAT.fullmatch(stat) or not tensor or not layer:
        return None
    return stat, tensor, layer


#: The per-layer layout fp8_stats wrote before this one (foundry-fp8 builds before
#: OLDER_LAYOUT_UNTIL), full module names in the middle; no version reads it any more.
OLDER_LAYOUT = "fp8/<layer>/<tensor>/<stat>"
#: The date of the first build whose fp8_stats wrote LAYOUT (commit 1fae7ff).
OLDER_LAYOUT_UNTIL = "2026-11-23"
#: The last commit whose fp8_stats wrote OLDER_LAYOUT and whose report read it (1fae7ff, the
#: next, moved to LAYOUT): the report for a run it logged.
OLDER_LAYOUT_LAST = "0b6e716"


def older_layout(key: str) -> bool:
    """Whether `key` is a per-layer series of OLDER_LAYOUT (`fp8/model.transformer.blocks.0.
    attn.Wqkv/weight/amax`), which no summary series (`fp8/<tensor>/<name>`) looks like."""
    parts = key.split("/")
    return (len(parts) >= 4 and parts[0] == SUMMARY_PREFIX and parts[-2] in TENSORS
            and bool(_STAT.fullmatch(parts[-1])))


def full_forms(layer: str) -> list[str]:
    """The module names a layer of the keys may have had before `short_layer` (te_swap's and
    fp8_stats' regexes, and their logs, see those): `blocks.0.attn.Wqkv` may be
    `model.transformer.blocks.0.attn.Wqkv`, `model.blocks.0...`, ... The key's own form first."""
    forms = [layer]
    for k in range(1, len(FRONTS) + 1):
        for fronts in itertools.combinations(FRONTS, k):
            forms.append("".join(fronts) + layer)
    return forms


def short_layer(name: str) -> str:
    """The layer's name in keys: `model.transformer.blocks.0.attn.Wqkv` -> `blocks.0.attn.Wqkv`
    (the caller has already removed FSDP/DDP/checkpoint wrapper segments)."""
    for front in FRONTS:
        name = name.removeprefix(front)
    return name


#: The hyperparameter recording the model's order of the layers fp8_stats can watch (the keys'
#: names): W&B's history rows come back with their keys in another order each, and MLflow keeps
#: none, so the report takes the order from here (`layer_order`). A model whose list is longer
#: than a logger keeps in one value continues it in `fp8/layers.2`, `fp8/layers.3`, ...
LAYER_ORDER = "fp8/layers"


def layer_order_params(layers: Sequence[str], limit: int) -> dict[str, Any]:
    """`layers` as hyperparameters, `{LAYER_ORDER: {"parts": n, "layers": [...]},
    LAYER_ORDER.2: [...], ...}`, each value's `str()` within `limit` characters (MLflow keeps
    `str(value)` and cuts it at its limit); {} where one name alone is longer."""
    head = len(repr({"parts": 10**9, "layers": []}))
    parts: list[list[str]] = [[]]
    size = head
    for name in layers:
        room = len(repr(name)) + 2  # its `, ` or the brackets
        if parts[-1] and size + room > limit:
            parts.append([])
            size = 2
        if size + room > limit:
            return {}
        parts[-1].append(name)
        size += room
    return {LAYER_ORDER: {"parts": len(parts), "layers": parts[0]},
            **{f"{LAYER_ORDER}.{n}": part for n, part in enumerate(parts[1:], 2)}}


def layer_order(hparams: Mapping[str, Any]) -> list[str] | None:
    """The layer order fp8_stats recorded (`layer_order_params`), or None where the run holds
    none whole (builds before it, a part missing or not a list of names, a `parts` that no
    number of hyperparameters could hold: a corrupt `10**9` would be looked up that often)."""
    first = hparams.get(LAYER_ORDER)
    parts = first.get("parts") if isinstance(first, Mapping) else None
    if not isinstance(parts, int) or not 1 <= parts <= len(hparams):
        return None
    names = [first.get("layers"), *(hparams.get(f"{LAYER_ORDER}.{n}") for n in range(2, parts + 1))]
    if not all(isinstance(part, list) and all(isinstance(s, str) for s in part) for part in names):
        return None
    return [name for part in names for name in part]


def by_name(layer: str) -> tuple[tuple[int, int, str], ...]:
    """A layer's place by name, its numbers by value (`blocks.2` before `blocks.10`): the order
    where no record says the model's."""
    return tuple((0, int(part), "") if i % 2 else (1, 0, part)  # odd: a `\d+` the split kept
                 for i, part in enumerate(re.split(r"(\d+)", layer)))
