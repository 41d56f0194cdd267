"""FP8 training numerics in plain torch: a linear layer that behaves like TE's under FP8.

`EmulatedFP8Linear` keeps TE's delayed-scaling state layout in `module.fp8_meta`
(`scaling_fwd`: input, weight, output; `scaling_bwd`: grad_output, grad_input; each with
`scale` and `amax_history`, float32 in any model dtype), casts its GEMM operands to FP8 with
the scale in force, records their amaxes into history slot 0 (NaN skipped, as TE's kernels)
and multiplies the FP8 values in float32, rounding each GEMM's result once to the activation
dtype, as TE's FP8 GEMMs do.
Scale updates follow TE 2.20 (`pytorch/quantization.py`, `pytorch/module/linear.py`): a layer
registers at its first delayed-scaling cast under that recipe and amax reduction group; the
forward scales of every registered layer are updated when the outermost `fp8_autocast` exits,
the backward scales at the end of the backward of the first layer that cast in each outermost
autocast; with `reduce_amax`, row 0 of the histories is all-reduced (MAX) across the group
first. TE names a buffer by the recipe's text, which leaves out `amax_compute_algo`
(`_buffer_key`), and updates it with the recipe last entered under that text, so the algorithm
is the last autocast's, not the layer's. A layer keeps the rest of the recipe it first cast
under (TE reuses its state and registers it once: its open TODO #3157), so a layer cast under
another format, margin or reduction raises `RecipeError` naming the key rather than predict
numbers TE would not produce (`amax_history_len` excepted, which TE follows).
`is_first_microbatch` keeps and reuses the FP8 weight as te.Linear's weight cache does
(`_WeightCache`).
`fp8_checkpoint` recomputes activations the way TE's `distributed.checkpoint` does (same recipe
and scales as the original forward, no amax recorded), so checkpointing does not change the
numerics (TE issue #1190). It gives FP8 numerics on hardware without FP8 (CPU, A100); it is not
fast.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn

from foundry_fp8.numerics import (
    FP8_MAX,
    amax,
    current_scale,
    delayed_scale_update,
    dequantize,
    quantize,
)
from foundry_fp8.recipe import (
    TE_DEFAULT_RECIPE,
    UNSUPPORTED_TE_RECIPES,
    FP8Recipe,
    RecipeError,
    RecipeProblem,
    unsupported_recipe_problem,
)
from foundry_fp8.shapes import (
    FP8_DIM_MULTIPLE,
    FP8_TOKEN_MULTIPLE,
    dim_fits_fp8,
    operand_fits_fp8,
)
from foundry_fp8.te.facts import (
    BACKWARD_OVERRIDE_ENV,
    TE_GEMM_LEADING_DIM_ERROR,
    TE_RECIPE_CHANGE_WARNING_FROM,
    backward_override_problems,
    dotted,
)

FWD_INPUT, FWD_WEIGHT = 0, 1
BWD_GRAD_OUTPUT = 0


Direction = Literal["forward", "backward"]
_META_KEY: dict[Direction, str] = {"forward": "scaling_fwd", "backward": "scaling_bwd"}


@dataclass
class _Member:
    """A registered layer, weakly, with the size of its amax row per direction and its device:
    a layer freed since the last prune still takes its place in the reduction, as zeros."""

    ref: weakref.ref[EmulatedFP8Linear]
    slots: dict[Direction, int]
    device: torch.device


@dataclass
class _AmaxBuffer:
    """One of TE's global amax buffers (`add_fp8_tensors_to_global_buffer`, quantization.py:
    501-566): the layers registered under one recipe and amax reduction group (`_buffer_key`),
    in registration order, updated together with the recipe last entered under that key
    (`_AutocastState.entered`). TE holds the layers for good; here a freed layer drops out at
    the next prune (`_prune`)."""

    layers: list[_Member] = field(default_factory=list)


@dataclass
class _AutocastState:
    depth: int = 0  # open fp8_autocast regions, enabled or not (TE's autocast_depth)
    enabled: bool = False
    recipe: FP8Recipe | None = None
    group: Any = None  # the amax reduction group in force (None: the world group)
    calibrating: bool = False  # TE's fp8_calibration (`fp8_autocast(calibrating=True)`)
    # TE's is_first_fp8_module: set when the outermost region opens, taken by the first layer
    # that casts with grad; that layer's backward updates the backward scales.
    first_module: bool = False
    # the layer that last took the flag, weakly: `first_fp8_module`
    first_layer: weakref.ref[EmulatedFP8Linear] | None = None
    pruned: bool = False  # whether this outermost region has pruned the buffers (`_prune`)
    buffers: dict[tuple[Any, ...], _AmaxBuffer] = field(default_factory=dict)
    # TE's autocast_arguments: per `_buffer_key`, the (recipe, group) of the last autocast
    # entered under it, enabled or not, whether or not a buffer exists yet (set at every entry,
    # quantization.py:743-746; the update reads it, l. 675)
    entered: dict[tuple[Any, ...], tuple[FP8Recipe, Any]] = field(default_factory=dict)
    # fp8_checkpoint: scales in force at the original forward, stashed per module, in call order;
    # `replay` is set while the recompute consumes them.
    stash: dict[EmulatedFP8Linear, deque[torch.Tensor]] | None = None
    replay: dict[EmulatedFP8Linear, deque[torch.Tensor]] | None = None


_STATE = _AutocastState()
# Per layer, weakly (a deep copy is a new layer): the recipe of its first FP8 cast, and the
# buffer it registered in (delayed scaling only).
_FIRST_RECIPE: weakref.WeakKeyDictionary[EmulatedFP8Linear, FP8Recipe] = (
    weakref.WeakKeyDictionary())
_REGISTERED: weakref.WeakKeyDictionary[EmulatedFP8Linear, _AmaxBuffer] = (
    weakref.WeakKeyDictionary())


def is_fp8_enabled() -> bool:
    return _STATE.enabled


def first_fp8_module() -> EmulatedFP8Linear | None:
    """The layer that took the latest outermost autocast's first-module flag: only its backward
    updates the backward scales, so if it never gets a gradient (detached, frozen or unused
    output) they never update. None: no layer took it yet, or it was freed."""
    return None if _STATE.first_layer is None else _STATE.first_layer()


def active_recipe() -> FP8Recipe | None:
    """The recipe emulated layers cast with right now; None where FP8 is off."""
    return _STATE.recipe if is_fp8_enabled() else None


@contextmanager
def fp8_autocast(enabled: bool = True, recipe: FP8Recipe | None = None,
                 amax_reduction_group: Any = None, *, calibrating: bool = False
                 ) -> Iterator[None]:
    """Run `EmulatedFP8Linear` layers in FP8 (`enabled`) or in high precision, as TE's autocast.

    From TE 2.20's `pytorch/quantization.py`: entering saves the state and sets FP8 on or off
    with this region's recipe and amax reduction group (None: the world group), so a nested
    `enabled=False` region runs layers in high precision and records no amax, and a nested
    recipe replaces the enclosing one (`recipe=None` means TE's default recipe, not the
    enclosing one: `autocast_enter`, l. 730-756; `recipe.TE_DEFAULT_RECIPE`); exiting
    restores the saved state, the first-module flag included (`autocast.__exit__`,
    l. 1056-1059). Only an enabled autocast
    that leaves the last open region, with grad enabled, updates forward scales
    (`autocast_exit`, l. 772-782), so a nested region never does; amaxes recorded without an
    update (no_grad, a disabled outermost region) wait for the next one. The update covers
    every registered layer, each buffer with the recipe last entered under its text
    (`_buffer_key`), this region's included, enabled or not; the fused update leaves
    a slot with nothing recorded alone (`numerics.delayed_scale_update`).
    `calibrating` (TE's calibration mode, which only acts with `enabled=False`): layers run in
    high precision and take this region's recipe and state, but record no amax, as te.Linear
    (`EmulatedFP8Linear._calibrate`).
    """
    _check_recipe_type(recipe)
    saved = (_STATE.enabled, _STATE.recipe, _STATE.group, _STATE.first_module,
             _STATE.calibrating)
    if _STATE.depth == 0:
        _STATE.first_module, _STATE.pruned = True, False
    _STATE.enabled, _STATE.recipe = enabled, recipe or TE_DEFAULT_RECIPE
    _RUN.fp8_ran = _RUN.fp8_ran or enabled
    _STATE.group, _STATE.calibrating = amax_reduction_group, calibrating
    _STATE.entered[_buffer_key(_STATE.recipe, amax_reduction_group)] = (
        _STATE.recipe, amax_reduction_group)
    _STATE.depth += 1
    try:
        yield
    finally:
        (_STATE.enabled, _STATE.recipe, _STATE.group, _STATE.first_module,
         _STATE.calibrating) = saved
        _STATE.depth -= 1
        if enabled and _STATE.depth == 0 and torch.is_grad_enabled():
            _reduce_and_update("forward")


#: The recipe keys TE's buffer key leaves out: `get_unique_autocast_key` names a recipe by its
#: text (quantization.py:714-727), and DelayedScaling's omits the algorithm (common/recipe/
#: __init__.py:272-282).
_UNNAMED_KEYS = ("amax_compute_algo",)


def _buffer_key(recipe: FP8Recipe, group: Any) -> tuple[Any, ...]:
    """TE's key of the amax buffer a layer registers in, and of the recipe that updates it:
    the recipe's text, which leaves out `_UNNAMED_KEYS`, and the group's identity."""
    return (*(getattr(recipe, f.name) for f in fields(FP8Recipe) if f.name not in _UNNAMED_KEYS),
            None if group is None else id(group))


def _check_recipe_type(recipe: object) -> None:
    """One line for a recipe the emulation cannot run, before any state changes: TE's own
    recipe objects (its block-scaling ones named as unsupported) or anything else. Without it a
    TE recipe failed inside the first layer's forward with an AttributeError."""
    if recipe is None or isinstance(recipe, FP8Recipe):
        return
    name = type(recipe).__name__
    if name.lower() in UNSUPPORTED_TE_RECIPES:
        raise RecipeError(unsupported_recipe_problem(UNSUPPORTED_TE_RECIPES[name.lower()]))
    raise RecipeError(RecipeProblem(
        "scaling", f"fp8_autocast got a {name}, not an FP8Recipe: the emulation runs "
        "foundry_fp8's FP8Recipe only",
        "pass FP8Recipe(scaling='delayed' or 'current', ...) with the same options"))


#: What TE does, by key, when a layer's recipe differs from its first recipe in that key (a key
#: not named here: TE goes on with the first recipe). A new scaling mode (delayed <-> current):
#: TE builds that mode's recipe state for the layer and uses it from then on (pytorch/module/
#: base.py:1106-1175 at d0067d0); the old state is not carried over (quantization.py:1383: a
#: state of another class inherits nothing). TE warns from TE_RECIPE_CHANGE_WARNING_FROM only.
_RECIPE_CHANGE = {"scaling": "switch the layer to the new scaling mode with fresh scaling state "
                             f"(and, from TE {dotted(TE_RECIPE_CHANGE_WARNING_FROM)}, a 'Recipe "
                             "type changed' warning)"}

#: TE's switch to its unfused Python update (read at every update: quantization.py:687-691).
UNFUSED_UPDATE_ENV = "NVTE_UNFUSED_FP8_UPDATE"

@dataclass
class _Run:
    """The run the emulation's warnings count in. A run begins where a layer is built, converted
    or reset (`reset_scaling_state`) after an enabled `fp8_autocast` opened: a second model or
    Trainer in one process (a notebook, a sweep, variants benchmarked in turn) is a new run,
    while eval after training, EMA's deep copy, a second `fit()` and a second Trainer on the
    same, already converted model (te_swap leaves its layers as they are) are not.
    Every rank of a data-parallel run builds and autocasts alike, so the ranks number their
    runs alike, which names the run in `_claim`'s store key."""

    number: int = 0
    fp8_ran: bool = False  # an enabled fp8_autocast opened since the run began


_RUN = _Run()

#: Per kind of warning ("unfused", "forward", "backward"), the run it was last met in: each is
#: given once per run. Python's own once-per-message record is reset by any
#: `warnings.catch_warnings()` or filter change (library code may do one every step), after
#: which a warning repeated step after step.
_WARNED: dict[str, int] = {}


def _begin_run_if_fp8_ran() -> None:
    """Called as a layer's scaling state is set up: the first such after FP8 ran begins a run."""
    if _RUN.fp8_ran:
        _RUN.number, _RUN.fp8_ran = _RUN.number + 1, False


def _warn_once(kind: str, message: str) -> None:
    """Warn `message` the first time this process meets `kind` in this run (`_Run`), and only
    from the rank that met it first (`_claim`): one line per kind per run on a console that
    interleaves 8 GPUs' stderr, yet a shape met only by rank 3's short last batch is said, by
    rank 3. Later shapes of the kind, on any rank, are not warned of."""
    if _WARNED.get(kind) == _RUN.number:
        return
    _WARNED[kind] = _RUN.number
    prefix = _claim(kind)
    if prefix is not None:
        warnings.warn(prefix + message, stacklevel=3)


def _claim(kind: str) -> str | None:
    """The prefix to warn of `kind` with: '' in a process alone; '[rank N] ' where this is the
    first rank of the torch.distributed group to meet it in this run; None where another rank
    did. The ranks agree through one atomic add on torch.distributed's key-value store (no
    collective: the other ranks need not be at any step, nor meet the kind at all). A store
    that fails to answer, or a torch without the private `_get_default_store`: every rank that
    meets the kind says it, rather than none, and training goes on."""
    import torch.distributed as torch_dist

    if (not torch_dist.is_available() or not torch_dist.is_initialized()
            or torch_dist.get_world_size() <= 1):
        return ""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        launch = _launch(torch_dist.get_world_size())
        first = _get_default_store().add(
            f"foundry_fp8/emulate/warned/{launch}/{kind}/{_RUN.number}", 1) == 1
    except (ImportError, AttributeError, ValueError, RuntimeError):
        first = True
    return f"[rank {torch_dist.get_rank()}] " if first else None


def _launch(world_size: int) -> str:
    """The launch the store key counts in. torchrun keeps one store across its restarts (its
    agent's TCPStore, static and c10d rendezvous alike, torch 2.7: static_tcp_rendezvous.py:66-75,
    dynamic_rendezvous.py:1205-1216), while the restarted workers number their runs from 0
    again: without the restart in the key they would find every kind claimed before the crash
    and say nothing. The agent gives its workers the count (local_elastic_agent.py:319-321),
    bumped by the agent whose worker failed; a restart for a node joining or leaving is not
    counted (api.py:886-917), so the world size is in the key too. Limits: another node's agent
    may not count the restart (pytorch issue 108158), and a kind only its ranks meet is then
    not said; outside torchelastic, a store that outlives its processes (a file:// rendezvous
    file left by a crash, which torch asks to be removed) is not told apart."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"{run}/{restart}/{world_size}"


def _warn_if_unfused() -> None:
    """TE's unfused update rolls every history column, those that recorded nothing too, and
    divides with torch.compile's arithmetic (quantization.py:1067-1166); the emulation models
    the fused kernel, so with the variable set its state would differ from TE's in silence.
    Once per run (`_warn_once`): the update runs for every buffer at every step. Read as TE
    2.20.2 reads it at every update, `bool(int(value))` (quantization.py:687-688): "00" is the
    fused kernel, and a value `int` refuses ("true", "") stops TE's first delayed-scaling
    update with ValueError, so it stops the emulation's too, in one line."""
    value = os.environ.get(UNFUSED_UPDATE_ENV)
    if value is None:
        return
    try:
        unfused = bool(int(value))
    except ValueError:
        raise ValueError(
            f"{UNFUSED_UPDATE_ENV}={value!r}: TransformerEngine reads it with int() at every "
            "delayed-scaling update and stops the first one with ValueError ('invalid literal "
            f"for int()'); set {UNFUSED_UPDATE_ENV}=0 (TE's fused update, which the emulation "
            "models) or 1, or unset it") from None
    if unfused:
        _warn_once("unfused",
            f"{UNFUSED_UPDATE_ENV}={value}: TransformerEngine would update delayed scales with "
            "its unfused Python path (which also rolls histories that recorded nothing); the "
            "emulation models the fused kernel only, so its histories and scales can differ "
            f"from TE's (unset {UNFUSED_UPDATE_ENV} to compare them)")


def _reduce_and_update(direction: Direction) -> None:
    """TE's `reduce_and_update_fp8_tensors` (quantization.py:655-711): per buffer, row 0 of
    every registered layer's history all-reduced (MAX) across the buffer's group when its
    recipe says `reduce_amax`, then one fused scale update per layer with that recipe."""
    for key, buffer in _STATE.buffers.items():
        if not buffer.layers:
            continue
        _warn_if_unfused()
        recipe, group = _STATE.entered[key]
        layers = [member.ref() for member in buffer.layers]
        metas = [layer.fp8_meta[_META_KEY[direction]] for layer in layers if layer is not None]
        if recipe.reduce_amax:
            device = metas[0].amax_history.device if metas else buffer.layers[0].device
            _all_reduce_max([layer.fp8_meta[_META_KEY[direction]].amax_history[0]
                             if layer is not None
                             else torch.zeros(member.slots[direction], device=device)
                             for layer, member in zip(layers, buffer.layers, strict=True)],
                            group)
        fp8_max = FP8_MAX[recipe.format_for(direction)]
        for meta in metas:
            # in place, as TE's fused kernel writes them: code holding `fp8_meta[...].scale`
            # or `.amax_history` across a step (TE's own tests/pytorch/test_recipe.py:99-106)
            # reads the update, not a stale tensor with the step's amax half-recorded
            history, scale = delayed_scale_update(
                meta.amax_history, meta.scale, fp8_max, recipe.amax_compute_algo, recipe.margin)
            meta.amax_history.copy_(history)
            meta.scale.copy_(scale)


def _all_reduce_max(rows: list[torch.Tensor], group: Any) -> None:
    """One MAX all-reduce of the concatenated rows, written back in place; nothing to do
    without torch.distributed or with one rank (TE's condition, quantization.py:677-683)."""
    import torch.distributed as torch_dist

    if (not torch_dist.is_available() or not torch_dist.is_initialized()
            or torch_dist.get_world_size(group=group) <= 1):
        return
    flat = torch.cat(rows)
    torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.MAX, group=group)
    for row, reduced in zip(rows, flat.split([row.numel() for row in rows]), strict=True):
        row.copy_(reduced)


def _prune() -> None:
    """Drop freed layers from every buffer, after a full garbage collection. Python frees a
    layer in a reference cycle whenever its collector runs, at different moments on different
    ranks; dropping it then would give the ranks' all-reduces different sizes (gloo fails, NCCL
    hangs). So freed layers leave only here, when a layer first joins a buffer (its first FP8
    cast: the same step on every rank), once per outermost region; the full collection only
    where several ranks reduce (it costs tens of milliseconds in a large process)."""
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized() and (
            torch_dist.get_world_size() > 1):
        gc.collect()
    for buffer in _STATE.buffers.values():
        buffer.layers = [member for member in buffer.layers if member.ref() is not None]
    _STATE.pruned = True


def _take_first_module() -> bool:
    first, _STATE.first_module = _STATE.first_module, False
    return first


@contextmanager
def _stashing(scales: dict[EmulatedFP8Linear, deque[torch.Tensor]]) -> Iterator[None]:
    previous, _STATE.stash = _STATE.stash, scales
    try:
        yield
    finally:
        _STATE.stash = previous


@contextmanager
def _replaying(scales: dict[EmulatedFP8Linear, deque[torch.Tensor]], enabled: bool,
               recipe: FP8Recipe | None) -> Iterator[None]:
    """TE's recompute: stashed scales, no amax recorded, no layer registered and the
    first-module flag untouched (linear.py:258-265, module/base.py:1601-1603, 1649-1650), under
    an autocast of FP8 on or off and the recipe as at checkpoint time (distributed.py:797-803;
    autocasts inside the function decide for their region). That autocast is an ordinary one:
    leaving the last open region (a backward outside any) with FP8 on, it updates the forward
    scales (quantization.py:772-782): a no-op unless amaxes were recorded since the last update,
    e.g. by an FP8 forward under no_grad between the training forward and the backward."""
    with fp8_autocast(enabled, recipe):
        previous, _STATE.replay = _STATE.replay, scales
        try:
            yield
        finally:
            _STATE.replay = previous


@torch.compiler.disable
def fp8_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Activation checkpointing that is safe for `EmulatedFP8Linear` (cf. TE's checkpoint).

    Plain `torch.utils.checkpoint` recomputes during backward, outside `fp8_autocast` and after
    the forward scales were updated, so the saved activations differ from the original forward
    (reentrant mode even back-propagates through a non-FP8 graph and never updates the backward
    scales). Here the recompute runs under the original recipe with the scales in force at the
    original forward and records no amax. That holds too when `function` opens its own
    `fp8_autocast` and is checkpointed outside FP8, as in TE 2.20 (distributed.py:257-271):
    the inner region's exit in the recompute is not the outermost one, so it updates nothing;
    the recompute's own region updates as TE's does (`_replaying`).
    Non-reentrant; `kwargs` go to torch's checkpoint. Eager under torch.compile
    (`compile_config`), as the layers' FP8 forwards: Dynamo's checkpoint operator takes no
    `context_fn` function (torch 2.7, _dynamo/variables/higher_order_ops.py:2221) and stopped
    the first batch of an HF model with gradient checkpointing.
    """
    scales: dict[EmulatedFP8Linear, deque[torch.Tensor]] = {}
    # outside FP8, TE's recompute region gets no recipe (its default), whatever the disabled
    # region around the checkpoint was given (distributed.py:795): entering it would make that
    # recipe its buffer's (`_AmaxBuffer`)
    kwargs.pop("use_reentrant", None)  # torch's and TE's keyword: this one is non-reentrant
    enabled = _STATE.enabled
    recipe = _STATE.recipe if enabled else None
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (_stashing(scales), _replaying(scales, enabled, recipe)), **kwargs)


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype TE computes in: torch autocast's where it is on, else the input's
    (`set_activation_dtype`, module/base.py:1482-1502)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


#: The dtypes TE's FP8 casts read: its input type switch (common/common.h,
#: TRANSFORMER_ENGINE_TYPE_SWITCH_INPUT); float64 has no TE dtype (pytorch/csrc/common.h:495-520).
#: te.Linear casts its input and weight as they come (linear.py:436, module/base.py:883).
_TE_CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Float32Gemms:
    """The user's float32 matmul precision while emulated GEMMs run, and how many run: threads
    (nn.DataParallel's replicas, CUDA backward threads) overlap, and the last one out restores
    it (one thread restoring while another multiplied ran the other's GEMM in TF32)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    user: str = "highest"


_GEMMS = _Float32Gemms()


@contextmanager
def _float32_gemms(device_type: str) -> Iterator[None]:
    """The emulated GEMMs in float32 as written, whatever torch's float32 matmul precision or
    autocast say, as TE's FP8 GEMMs (exact FP8 products, float32 accumulation in cuBLAS) are
    reached by neither. Composer's GPU device turns TF32 on by default ("high": 10-bit operand
    mantissas) and "medium" makes a CPU matmul bfloat16, so each dequantized operand `fp8 *
    scale_inv` (up to 24 significant bits) was rounded again; a backward called inside torch
    autocast ran in autocast's dtype. The user's precision is restored on the way out."""
    with _GEMMS.lock:
        if _GEMMS.running == 0:
            _GEMMS.user = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
        _GEMMS.running += 1
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        with _GEMMS.lock:
            _GEMMS.running -= 1
            if _GEMMS.running == 0:
                torch.set_float32_matmul_precision(_GEMMS.user)


def _bias_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """cuBLAS takes no float32 bias with FP8 operands: TE casts it to bfloat16 then
    (linear.py:499-502); the epilogue adds it to the float32 accumulator."""
    return torch.bfloat16 if activation_dtype == torch.float32 else activation_dtype


class ScalingMeta(nn.Module):
    """`scale` [n] and `amax_history` [history_len, n], as TE's FP8TensorMeta holds them: in
    float32 whatever the module's dtype (TE's are plain float32 tensors, quantization.py:
    1436-1442); a bfloat16 scale cannot hold float32 max, which the update writes on overflow.

    The history is empty until the first delayed-scaling forward sizes it by the recipe (or
    `fp8_state` restores a checkpoint's). Plain tensor attributes, not buffers, as TE's
    `fp8_meta` dict: whatever walks a model's buffers leaves them alone (Composer's EMA
    averaged and swapped them, `buffer_dtype` casts, state_dict); they follow the module's
    device moves (`_apply`), and a forward on another device (FSDP moves only parameters and
    buffers) takes them there (`follow`).
    """

    def __init__(self, n: int):
        super().__init__()
        self.scale = torch.ones(n)
        self.amax_history = torch.zeros(0, n)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> ScalingMeta:
        """Take only the device from `fn`, never to `meta`: a dtype cast (`.to(bfloat16)`,
        `.half()`, `.type()`) or `to_empty` must not change the values."""
        del recurse  # no submodules
        self.follow(fn(self.scale).device)
        return self

    def follow(self, device: torch.device) -> None:
        if device.type != "meta" and self.scale.device != device:
            with _state_tensors():
                self.scale = self.scale.to(device)
                self.amax_history = self.amax_history.to(device)


def _state_tensors() -> torch.inference_mode:
    """Where the scaling state's tensors are made, also inside a forward under
    `torch.inference_mode()`: an inference tensor made there refuses the in-place amax record
    of every later training forward ('Inplace update to inference tensor outside
    InferenceMode'). TE's cast kernels and fused update write its state through raw pointers
    (pytorch/csrc/extensions/recipe.cpp:44-53), which no such check sees, so a te.Linear whose
    first FP8 forward ran under inference_mode trains on with the fused update and no FP8
    activation recompute; TE's Python `copy_`s would raise there (the recompute's stash and
    restore, quantization.py:832-833, 842-843; NVTE_UNFUSED_FP8_UPDATE, l. 1071-1072, 1115,
    1165). The emulation trains on in every case (it does not model that error)."""
    return torch.inference_mode(False)


def backward_override(recipe: FP8Recipe) -> str | None:
    """TE's NVTE_BACKWARD_OVERRIDE for a cast under `recipe` (`te.facts`, TE >= 2.15): None
    (unset), "high_precision" or "dequantized"; `RecipeError` where TE would refuse to build the
    recipe (a value it does not take; any value with delayed scaling). TE reads the variable
    once, when it is imported; the emulation at each FP8 forward, as TE's Linear reads the
    recipe's (linear.py:1605-1608 at v2.15)."""
    value = os.environ.get(BACKWARD_OVERRIDE_ENV)
    problems = backward_override_problems(value, None, recipe.scaling)
    if problems:
        raise RecipeError(problems[0])
    return value


class _FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 operands: each GEMM multiplies the FP8 values in float32 and
    rounds its result once to the activation dtype (forward, dgrad and wgrad, as TE's
    general_gemm with out_dtype=activation_dtype, linear.py:536-545, 1086-1095, 1249-1265).
    Under NVTE_BACKWARD_OVERRIDE (current scaling, `backward_override`) dgrad and wgrad take the
    gradient as it comes, with the weight and input as stored (`high_precision`) or their FP8
    copies dequantized to the activation dtype (`dequantized`), as `te.facts` says TE does."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, recipe, update_backward, override, microbatch,
                transpose):
        meta = module.fp8_meta["scaling_fwd"]
        fmt = recipe.format_for("forward")
        dtype = _activation_dtype(x)
        cached = module._cached_weight(microbatch, transpose)
        scales = module._cast_scales(meta, (x,) if cached else (x, weight), fmt, recipe)
        sx = scales[FWD_INPUT].clone()
        qx = quantize(x, sx, fmt)
        if cached is not None:  # the weight is not cast, so records no amax (`_WeightCache`)
            qw, sw = cached.data, cached.scale
        else:
            sw = scales[FWD_WEIGHT].clone()
            qw = quantize(weight, sw, fmt)
            if microbatch is not None:
                module._fp8_weight_cache = _WeightCache(qw, sw, transpose)
        if override == "high_precision":  # TE saves the original input and weight
            ctx.save_for_backward(x, weight, None, None)
        else:
            ctx.save_for_backward(qx, qw, sx, sw)
        ctx.override = override
        ctx.module, ctx.recipe, ctx.update_backward = module, recipe, update_backward
        ctx.dtypes = x.dtype, weight.dtype, None if bias is None else bias.dtype, dtype
        with _float32_gemms(x.device.type):
            out = nn.functional.linear(dequantize(qx, sx), dequantize(qw, sw))
            if bias is not None:
                out = out + bias.to(_bias_dtype(dtype)).float()
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qx, qw, sx, sw = ctx.saved_tensors
        module, recipe = ctx.module, ctx.recipe
        x_dtype, w_dtype, b_dtype, dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.override is None:
            meta = module.fp8_meta["scaling_bwd"]
            fmt = recipe.format_for("backward")
            sg = module._cast_scales(meta, (grad_out,), fmt, recipe)[BWD_GRAD_OUTPUT]
            g = dequantize(quantize(grad_out, sg, fmt), sg)
            w, x = dequantize(qw, sw), dequantize(qx, sx)
        elif ctx.override == "high_precision":  # weight as stored, input in activation dtype
            g, w, x = grad_out.float(), qw.float(), qx.to(dtype).float()
        else:  # dequantized: the forward's FP8 operands, dequantized to the activation dtype
            g = grad_out.float()
            w, x = dequantize(qw, sw).to(dtype).float(), dequantize(qx, sx).to(dtype).float()
        grad_x = grad_w = grad_b = None
        with _float32_gemms(grad_out.device.type):
            if need_x:
                grad_x = (g @ w).to(dtype).to(x_dtype)
            if need_w:
                g2d, x2d = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
                grad_w = (g2d.t() @ x2d).to(dtype).to(w_dtype)
        if need_b:
            # TE's fused bgrad + cast reduces the high-precision gradient (module/base.py,
            # grad_output_preprocess: tex.bgrad_quantize), accumulating in float32
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
            grad_b = grad_2d.float().sum(0).to(grad_out.dtype).to(b_dtype)
        # the end of this layer's backward (linear.py:1462-1470); not under an override
        # (`reduce_and_update_bwd_fp8_tensors = False`, linear.py:1128-1129 at v2.15)
        if ctx.update_backward and ctx.override is None:
            _reduce_and_update("backward")
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


@dataclass
class _WeightCache:
    """TE's cached FP8 weight (`_fp8_workspaces["weight"]`) under `is_first_microbatch`
    (TE 2.20, pytorch/module/linear.py:1958-1961, 2068-2071; module/base.py:792-890): True or
    None casts the weight afresh (True keeps the cast), False reuses the kept FP8 weight with
    the scale it was cast with (with none kept, casts and keeps it; under FSDP2 TE keeps none,
    `_under_fsdp2`), so that forward records no weight amax and the fused update
    leaves the weight's history column and scale alone (`numerics.delayed_scale_update`).
    `transpose`: whether the cast made the transpose a backward reads, which Hopper needs
    (`_weight_transpose_needed`)."""

    data: torch.Tensor
    scale: torch.Tensor
    transpose: bool


def _weight_transpose_needed(x: torch.Tensor, override: str | None) -> bool:
    """Whether TE casts the weight with its transpose (columnwise usage, linear.py:466-474): for
    an input gradient with no backward override, or in the first forward of an activation
    recompute (`fp8_checkpoint`'s stash). Asked before the autograd Function, whose forward
    runs without grad."""
    return (torch.is_grad_enabled() and x.requires_grad and override is None) or (
        _STATE.stash is not None)


#: Ends each shape warning: one per kind per run (`_warn_unless_te_runs`).
_FURTHER_NOT_WARNED = "; the emulation runs it (only the first such shape is warned of)"


def _warn_unless_te_runs(x: torch.Tensor, weight: torch.Tensor, fp8_backward: bool) -> None:
    """Warn where TE 2.20 would stop a GEMM the emulation runs. Forward: te.Linear,
    LayerNormLinear and LayerNormMLP, under any recipe, raise ValueError unless each of input
    and weight [out, in] passes `shapes.operand_fits_fp8` (`assert_dim_for_fp8_exec`,
    pytorch/utils.py:614-623, called at module/linear.py:376, layernorm_linear.py:184,
    layernorm_mlp.py:356; forward only). Backward in FP8, on Hopper (TN-only FP8 GEMMs): the
    weight-gradient GEMM's inner dim is the tokens and the input-gradient GEMM's is
    out_features, each checked for 16 (common/gemm/cublaslt_gemm.cu: 160-163, 251-254; read in
    the sources, not run on a GPU). te_swap's plan keeps layers of other weight shapes in high
    precision, but a batch's tokens (a short last batch, an odd sequence length) are only known
    here. One warning per kind (forward, backward) per run across the ranks (`_warn_once`),
    naming the first shapes the first rank to meet the kind met: with variable lengths every
    new length would warn again, thousands of lines in a long run's log where the first
    already says the batches need padding."""
    refused = [f"{name} of shape {list(t.shape)}" for name, t in (("input", x), ("weight", weight))
               if not operand_fits_fp8(t.shape)]
    if refused:
        _warn_once("forward",
            f"EmulatedFP8Linear: FP8 {' and '.join(refused)}: TransformerEngine stops the "
            f"forward with ValueError under any recipe (assert_dim_for_fp8_exec: the product of "
            f"the leading dims must be divisible by {FP8_TOKEN_MULTIPLE} and the last dim by "
            f"{FP8_DIM_MULTIPLE}){_FURTHER_NOT_WARNED}")
        return
    if not fp8_backward:
        return
    needs = [f"{what} ({n}) for the {gemm} GEMM" for what, n, gemm in (
                 ("the tokens", math.prod(x.shape[:-1]), "weight-gradient"),
                 ("out_features", weight.shape[0], "input-gradient")) if not dim_fits_fp8(n)]
    if needs:
        _warn_once("backward",
            f"EmulatedFP8Linear: FP8 input of shape {list(x.shape)} and weight of shape "
            f"{list(weight.shape)}: TransformerEngine's forward accepts them, but its FP8 "
            f"backward on Hopper needs {' and '.join(needs)} divisible by {FP8_DIM_MULTIPLE} "
            f"and stops with '{TE_GEMM_LEADING_DIM_ERROR}' "
            f"(read in TE's cublaslt_gemm.cu, not run on a GPU){_FURTHER_NOT_WARNED}")


class EmulatedFP8Linear(nn.Linear):
    """`nn.Linear` whose GEMMs read FP8 operands inside `fp8_autocast` (a plain Linear outside
    it). Parameter names are unchanged, so optimizers and checkpoints line up."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._fsdp2: bool | None = None  # `_under_fsdp2`, once asked
        self._last_dtype: torch.dtype | None = None  # `_check_dtypes`' cache, as TE's
        self.reset_scaling_state()

    def reset_scaling_state(self) -> None:
        """Fresh scales (1), empty histories, no recipe, no registration and no kept FP8
        weight, as a new layer; on CPU when the weights are on `meta`. The first layer set up
        after FP8 ran begins a new run for the warnings (`_Run`).

        Never on `meta`: FSDP materialises a module with meta buffers by `to_empty` plus
        LLM-Foundry's param_init_fn, which knows nothing of these, so the scales would be
        uninitialised memory. LLM-Foundry keeps its own buffers on CPU for the same reason;
        the first forward on the GPU takes the state there (`ScalingMeta.follow`).
        """
        _begin_run_if_fp8_ran()
        device = self.weight.device if self.weight.device.type != "meta" else "cpu"
        self.fp8_meta = nn.ModuleDict({"scaling_fwd": ScalingMeta(3), "scaling_bwd": ScalingMeta(2)})
        self.fp8_meta.to(device)
        self._fp8_weight_cache: _WeightCache | None = None
        _FIRST_RECIPE.pop(self, None)
        buffer = _REGISTERED.pop(self, None)
        if buffer is not None:
            buffer.layers = [member for member in buffer.layers if member.ref() is not self]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> EmulatedFP8Linear:
        """Same shapes, dtype and device; weights and bias copied bit for bit."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def _check_dtypes(self, x: torch.Tensor) -> None:
        """TE's `set_activation_dtype` (TE 2.20 pytorch/module/base.py:1482-1501), which
        `prepare_forward` asks at every forward, FP8 or not, but in an FP8 recompute (l. 1601,
        1617): outside torch autocast, a parameter whose dtype is not the input's raises, unless
        the input has the dtype the layer last computed in (TE caches it, under autocast too, and
        then checks nothing). The FP8 GEMMs here read float32 either way, so without this a CPU run
        passed that stops TE's first forward. TypeError as TE raises from 2.14; up to 2.13 it is
        an `assert` (base.py:939-944 at v2.13), gone under `python -O`."""
        dtype = _activation_dtype(x)
        if torch.is_autocast_enabled(x.device.type) or self._last_dtype == dtype:
            self._last_dtype = dtype
            return
        for name, param in self.named_parameters():
            if param.dtype != dtype:
                raise TypeError(
                    f"EmulatedFP8Linear: input {dtype} and parameter {name!r} "
                    f"{param.dtype} outside torch autocast: TransformerEngine >= 2.14 raises "
                    "TypeError here ('Data types for parameters must match when outside of "
                    "autocasted region'), older TE fails an assert; cast the input or the model "
                    "to one dtype, or run under torch.autocast")
        self._last_dtype = dtype

    def _check_castable(self, x: torch.Tensor) -> None:
        """RuntimeError for an input or weight of a dtype TE has none for (`_TE_CAST_DTYPES`),
        in FP8 and calibration forwards. Calibration is no FP8: under torch autocast TE casts
        its operands to autocast's dtype first (linear.py:400, 439, 493), which the emulation's
        CPU autocast does not do for float64, so the message says so."""
        uncast = [f"{name} {t.dtype}" for name, t in (("input", x), ("weight", self.weight))
                  if t.dtype not in _TE_CAST_DTYPES]
        if not uncast:
            return
        operands = " and ".join(uncast)
        if is_fp8_enabled():
            raise RuntimeError(
                f"EmulatedFP8Linear: FP8 {operands}: TransformerEngine casts only float32, "
                "float16 and bfloat16 to FP8 and stops with 'Invalid type' (under torch "
                "autocast too: it casts its input and weight as they come); use one of them")
        raise RuntimeError(
            f"EmulatedFP8Linear: calibration forward with {operands}: TransformerEngine has no "
            "float64 type ('Invalid type') and computes in float32, float16 or bfloat16 (under "
            "torch autocast it casts to autocast's dtype first, which this emulation does not "
            "follow); use one of them")

    def _check_recipe(self, recipe: FP8Recipe) -> None:
        """Refuse a recipe other than this layer's first (the history length aside, which TE
        follows, and the algorithm, which the buffer's last-entered recipe decides): TE keeps
        the first recipe's format, margin and reduction for a layer (module/base.py:1106-1117
        reuses its state, quantization.py:522-524 registers it once), and going back to
        delayed after current scaling leaves it never updated. A change of scaling mode TE does
        follow, with new state and (from TE_RECIPE_CHANGE_WARNING_FROM) a 'Recipe type changed'
        warning (base.py:1106-1175, 1576-1585), which the emulation does not model: refused
        too."""
        first = _FIRST_RECIPE.setdefault(self, recipe)
        if first == recipe:
            return
        key = next((f.name for f in fields(FP8Recipe)
                    if f.name not in ("amax_history_len", *_UNNAMED_KEYS)
                    and getattr(first, f.name) != getattr(recipe, f.name)), None)
        if key is None:
            return
        raise RecipeError(RecipeProblem(
            key, f"this layer first ran FP8 with {key}={getattr(first, key)!r}, now "
                 f"{getattr(recipe, key)!r}; TransformerEngine would "
                 f"{_RECIPE_CHANGE.get(key, 'go on with the first recipe for it')}, so the "
                 "emulation refuses the change",
            "keep one recipe per layer for the whole run, or call reset_scaling_state()"))

    def _fit_history(self, meta: ScalingMeta, recipe: FP8Recipe) -> None:
        """Resize the history to the recipe's length keeping its rows and the scales, as TE's
        `adjust_amax_history_length` does when a delayed recipe's length changes: the first
        rows are kept when it shrinks, zero rows appended when it grows."""
        history, length = meta.amax_history, recipe.amax_history_len
        with _state_tensors():
            if history.shape[0] > length:
                meta.amax_history = history[:length].clone()
            elif history.shape[0] < length:
                meta.amax_history = nn.functional.pad(history,
                                                      (0, 0, 0, length - history.shape[0]))

    def _register(self, recipe: FP8Recipe) -> None:
        """Join the amax buffer of (recipe, group) at the first delayed-scaling cast, once
        (`add_fp8_tensors_to_global_buffer`, quantization.py:519-524)."""
        if self in _REGISTERED:
            return
        if not _STATE.pruned:
            _prune()
        group = _STATE.group
        buffer = _STATE.buffers.setdefault(_buffer_key(recipe, group), _AmaxBuffer())
        slots: dict[Direction, int] = {d: self.fp8_meta[k].scale.numel()
                                       for d, k in _META_KEY.items()}
        buffer.layers.append(_Member(weakref.ref(self), slots,
                                     self.fp8_meta["scaling_fwd"].amax_history.device))
        _REGISTERED[self] = buffer

    def _cast_scales(self, meta: ScalingMeta, tensors: tuple[torch.Tensor, ...], fmt: str,
                     recipe: FP8Recipe) -> torch.Tensor:
        """The scales to cast `tensors` with (indexed as `FWD_INPUT`...); records their amaxes in
        history slot 0."""
        if (recipe.scaling == "delayed" and _STATE.replay is not None
                and meta is self.fp8_meta["scaling_fwd"]):
            return _STATE.replay[self].popleft()  # recompute: the original forward's scales
        amaxes = torch.stack([amax(t) for t in tensors])
        if recipe.scaling == "current":
            return current_scale(amaxes, fmt, power_2=recipe.use_power_2_scales)
        n = len(tensors)
        meta.amax_history[0, :n] = torch.maximum(meta.amax_history[0, :n], amaxes)
        if _STATE.stash is not None and meta is self.fp8_meta["scaling_fwd"]:
            # the whole row, as TE stashes and restores it (quantization.py:832-833): a
            # recompute that casts a weight its forward took from the cache needs its scale
            _STATE.stash.setdefault(self, deque()).append(meta.scale.clone())
        return meta.scale[:n]

    def forward(self, input: torch.Tensor,  # noqa: A002  (nn.Linear's name)
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """`is_first_microbatch` as te.Linear's: under FP8, None casts the weight at every
        forward, True casts it and keeps the FP8 copy, False reuses the kept copy
        (`_WeightCache`; not under FSDP2); outside FP8 it changes nothing."""
        if is_fp8_enabled():
            return self._fp8_forward(input, is_first_microbatch)
        if (_STATE.depth == 0 and self in _FIRST_RECIPE and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() != -1):
            _warn_once("recompute", (
                "EmulatedFP8Linear: a forward recomputed in the backward outside fp8_autocast "
                "(torch.utils.checkpoint, or transformers' gradient_checkpointing_enable() "
                "after convert_to_fp8) runs without FP8, as TE's (TE #1190): its backward is "
                "not FP8's and never updates the backward scales; checkpoint with "
                "foundry_fp8.fp8_checkpoint, or enable gradient checkpointing before "
                "convert_to_fp8"))
        self._check_dtypes(input)  # a mismatch: TE's TypeError, before F.linear's RuntimeError
        if _STATE.calibrating:
            self._calibrate(input)
        if torch.is_autocast_enabled(input.device.type):
            return super().forward(input)
        # TE computes in the activation dtype, casting the parameters its cache let through
        # (linear.py:439, 493, 503)
        bias = None if self.bias is None else self.bias.to(input.dtype)
        return nn.functional.linear(input, self.weight.to(input.dtype), bias)

    @torch.compiler.disable
    def _calibrate(self, x: torch.Tensor) -> None:
        """A forward in TE's calibration mode: te.Linear takes the recipe and sizes its state
        (`init_fp8_metadata` runs for calibration too, module/base.py:1534-1566) but hands its
        calibrate calls no quantizer outside FP8 (linear.py:506-510 read `_get_quantizers`,
        which returns None for each unless FP8 is on, l. 2082-2084, as since TE 2.0; TE 1.x
        wrote the amaxes into the history), so it records no amax and registers for no update.
        A later FP8 region with another recipe is then refused, as after an FP8 forward
        (`_check_recipe`)."""
        recipe = _STATE.recipe
        self._check_castable(x)
        self._check_recipe(recipe)
        for meta in self.fp8_meta.values():
            meta.follow(x.device)
            if recipe.scaling == "delayed":
                self._fit_history(meta, recipe)

    def _cached_weight(self, microbatch: bool | None, transpose: bool) -> _WeightCache | None:
        """The kept FP8 weight where TE reuses it (`_WeightCache`): `is_first_microbatch` False
        and a cast kept with the transpose if one is needed, as on Hopper
        (`_is_weight_workspace_valid`, module/base.py:757-768, non-TN FP8 GEMMs from compute
        capability 10.0, pytorch/utils.py:658-663); in an activation recompute too, whose
        restored scales cast the weight where the kept cast lacks it. TE checks no device
        (base.py:848-871): a False call after a `.to()` meets the cast on its old device (TE's
        True call updates that cast in place there, tensor/float8_tensor.py:110-111; here it
        casts anew)."""
        cache = self._fp8_weight_cache
        if microbatch is None or microbatch or cache is None:
            return None
        if transpose and not cache.transpose:
            return None
        return cache

    def _under_fsdp2(self) -> bool:
        """TE's `is_fsdp2` (module/base.py:1036-1047, distributed.py:2112-2146): whether FSDP2's
        `fully_shard` was given this layer or a module holding it; asked once, as TE caches it.
        Inside the forward the weight is FSDP2's unsharded plain tensor, so its type cannot
        tell."""
        if self._fsdp2 is None:
            try:
                from torch.distributed._composable_state import _module_state_mapping
            except ImportError:
                self._fsdp2 = False
                return False
            self._fsdp2 = any(hasattr(holder, "_get_fsdp_state")
                              and any(m is self for m in holder.modules())
                              for holder in list(_module_state_mapping))
        return self._fsdp2

    @torch.compiler.disable
    def _fp8_forward(self, x: torch.Tensor, microbatch: bool | None) -> torch.Tensor:
        """Eager under torch.compile: the emulation is bookkeeping in Python (histories sized
        at the first cast, module-level autocast state) that Dynamo would recompile for at
        every change, and software FP8 gains nothing from a compiled graph."""
        recipe = _STATE.recipe
        replaying = _STATE.replay is not None
        if not replaying:  # TE's FP8 recompute sets no activation dtype (module/base.py:1601)
            self._check_dtypes(x)
        self._check_castable(x)
        self._check_recipe(recipe)
        for meta in self.fp8_meta.values():
            meta.follow(x.device)
        if recipe.scaling == "delayed" and not replaying:
            for meta in self.fp8_meta.values():
                self._fit_history(meta, recipe)
            self._register(recipe)
        # TE flags the first layer that casts with grad in each outermost autocast
        # (linear.py:1436-1444); the recompute leaves the flag alone
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, self.weight, self.bias))
        override = backward_override(recipe)
        _warn_unless_te_runs(x, self.weight, needs_grad and override is None)
        update_backward = needs_grad and not replaying and _take_first_module()
        if microbatch is not None and self._under_fsdp2():
            microbatch = None  # TE keeps no FP8 weight under FSDP2 (linear.py:1958)
        if update_backward:
            _STATE.first_layer = weakref.ref(self)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self, recipe, update_backward,
                                        override, microbatch, _weight_transpose_needed(x, override))
