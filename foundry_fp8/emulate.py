"""FP8 training numerics in plain torch: a linear layer that behaves like TE's under FP8.

`EmulatedFP8Linear` keeps TE's delayed-scaling state layout in `module.fp8_meta`
(`scaling_fwd`: input, weight, output; `scaling_bwd`: grad_output, grad_input; each with
`scale` and `amax_history`), casts its GEMM inputs through saturating FP8 round trips with the
scale in force, and records amaxes into history slot 0. As in TE, forward scales are updated when
the outermost `fp8_autocast` exits (see `fp8_autocast` for nesting) and backward scales when the
backward pass ends, each layer with the recipe it cast under.
`fp8_checkpoint` recomputes activations the way TE's `distributed.checkpoint` does (same recipe
and scales as the original forward, no amax recorded), so checkpointing does not change the
numerics (TE issue #1190). It gives FP8 numerics on hardware without FP8 (CPU, A100); it is not
fast.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn

from foundry_fp8.numerics import FP8_MAX, current_scale, delayed_scale_update, quantize_dequantize
from foundry_fp8.recipe import FP8Recipe

FWD_INPUT, FWD_WEIGHT, FWD_OUTPUT = 0, 1, 2
BWD_GRAD_OUTPUT, BWD_GRAD_INPUT = 0, 1


Direction = Literal["forward", "backward"]


@dataclass
class _AutocastState:
    depth: int = 0  # open fp8_autocast regions, enabled or not (TE's autocast_depth)
    enabled: bool = False
    recipe: FP8Recipe | None = None
    # Layers whose amaxes await a scale update, each with the recipe of its first cast since
    # its last update, per direction.
    pending: dict[Direction, dict[EmulatedFP8Linear, FP8Recipe]] = field(
        default_factory=lambda: {"forward": {}, "backward": {}})
    # fp8_checkpoint: scales in force at the original forward, stashed per module, in call order;
    # `replay` is set while the recompute consumes them.
    stash: dict[EmulatedFP8Linear, deque[torch.Tensor]] | None = None
    replay: dict[EmulatedFP8Linear, deque[torch.Tensor]] | None = None


_STATE = _AutocastState()


def is_fp8_enabled() -> bool:
    return _STATE.enabled


def active_recipe() -> FP8Recipe | None:
    """The recipe emulated layers cast with right now; None where FP8 is off."""
    return _STATE.recipe if is_fp8_enabled() else None


@contextmanager
def fp8_autocast(enabled: bool = True, recipe: FP8Recipe | None = None) -> Iterator[None]:
    """Run `EmulatedFP8Linear` layers in FP8 (`enabled`) or in high precision, as TE's autocast.

    From TE 2.20.2's `pytorch/quantization.py`: entering saves the state and sets FP8 on or off
    with this region's recipe, so a nested `enabled=False` region runs layers in high precision
    and records no amax, and a nested recipe replaces the enclosing one (`recipe=None` means the
    default recipe, not the enclosing one: `autocast_enter`, l. 740-756); exiting restores the
    saved state (`autocast.__exit__`, l. 1058). Only an enabled autocast that leaves the last
    open region, with grad enabled, updates forward scales (`autocast_exit`, l. 779), so a nested
    region never does; amaxes recorded without an update (no_grad, a disabled outermost region)
    wait for the next one. Each layer is updated with the recipe it cast under, as TE keys its
    amax buffers by recipe (l. 550, 675). TE updates every layer it registered at each such
    exit, cast or not, but its fused update leaves a slot with nothing recorded alone
    (`numerics.delayed_scale_update`), so updating only the layers that cast since their last
    update, as here, ends in the same state.
    """
    saved = _STATE.enabled, _STATE.recipe
    _STATE.enabled, _STATE.recipe = enabled, recipe or FP8Recipe()
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.enabled, _STATE.recipe = saved
        _STATE.depth -= 1
        if enabled and _STATE.depth == 0 and torch.is_grad_enabled():
            _update_pending("forward")


def _update_pending(direction: Direction) -> None:
    """One scale update for every layer with amaxes pending in `direction`, in call order."""
    pending, _STATE.pending[direction] = _STATE.pending[direction], {}
    for module, recipe in pending.items():
        module._update_scales(recipe, direction)


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
    """FP8 on or off with the recipe as at checkpoint time (autocasts inside the function decide
    for their region), stashed scales, no amax recorded; one region deeper, so no exit inside
    updates scales (TE's recompute autocast, distributed.py:811-816)."""
    saved = _STATE.depth, _STATE.enabled, _STATE.recipe, _STATE.replay
    _STATE.depth, _STATE.enabled, _STATE.recipe, _STATE.replay = (saved[0] + 1, enabled, recipe,
                                                                  scales)
    try:
        yield
    finally:
        _STATE.depth, _STATE.enabled, _STATE.recipe, _STATE.replay = saved


def fp8_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Activation checkpointing that is safe for `EmulatedFP8Linear` (cf. TE's checkpoint).

    Plain `torch.utils.checkpoint` recomputes during backward, outside `fp8_autocast` and after
    the forward scales were updated, so the saved activations differ from the original forward
    (reentrant mode even back-propagates through a non-FP8 graph and never updates the backward
    scales). Here the recompute runs under the original recipe with the scales in force at the
    original forward and records no amax. That holds too when `function` opens its own
    `fp8_autocast` and is checkpointed outside FP8, as in TE 2.20.2 (distributed.py:257-271):
    the inner region's exit in the recompute is not the outermost one, so it updates nothing.
    Non-reentrant; `kwargs` go to torch's checkpoint.
    """
    scales: dict[EmulatedFP8Linear, deque[torch.Tensor]] = {}
    enabled, recipe = _STATE.enabled, _STATE.recipe
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (_stashing(scales), _replaying(scales, enabled, recipe)), **kwargs)


class ScalingMeta(nn.Module):
    """`scale` [n] and `amax_history` [history_len, n], as TE's FP8TensorMeta holds them.

    The history is empty until the first delayed-scaling forward sizes it by the recipe (or
    `fp8_state` restores a checkpoint's). Non-persistent buffers: they follow `.to(device)` but
    stay out of the model state_dict.
    """

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("scale", torch.ones(n), persistent=False)
        self.register_buffer("amax_history", torch.zeros(0, n), persistent=False)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, recipe):
        meta = module.fp8_meta["scaling_fwd"]
        fmt = recipe.format_for("forward")
        scales = module._cast_scales(meta, (x, weight), fmt, recipe)
        qx = quantize_dequantize(x, scales[FWD_INPUT], fmt)
        qw = quantize_dequantize(weight, scales[FWD_WEIGHT], fmt)
        ctx.save_for_backward(qx, qw)
        ctx.module, ctx.recipe, ctx.has_bias = module, recipe, bias is not None
        return nn.functional.linear(qx, qw, bias)

    @staticmethod
    def backward(ctx, grad_out):
        qx, qw = ctx.saved_tensors
        module, recipe = ctx.module, ctx.recipe
        meta = module.fp8_meta["scaling_bwd"]
        fmt = recipe.format_for("backward")
        scale = module._cast_scales(meta, (grad_out,), fmt, recipe)[BWD_GRAD_OUTPUT]
        qg = quantize_dequantize(grad_out, scale, fmt)
        grad_x = qg @ qw
        grad_w = qg.reshape(-1, qg.shape[-1]).t() @ qx.reshape(-1, qx.shape[-1])
        # TE's fused bgrad + cast reduces the high-precision gradient (module/base.py,
        # grad_output_preprocess: tex.bgrad_quantize)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        _queue_backward_update(module, recipe)
        return grad_x, grad_w, grad_b, None, None


def _queue_backward_update(module: EmulatedFP8Linear, recipe: FP8Recipe) -> None:
    """Update every backward scale once, when the whole backward pass has finished.

    Every call queues a callback (the first to run updates all modules, the rest find nothing
    to do): autograd drops the callbacks of a backward that raises, so a single callback queued
    by the first module would leave the list non-empty and no later backward would queue one.
    """
    _STATE.pending["backward"].setdefault(module, recipe)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _update_pending("backward"))


class EmulatedFP8Linear(nn.Linear):
    """`nn.Linear` whose GEMMs see FP8-rounded inputs inside `fp8_autocast` (a plain Linear
    outside it). Parameter names are unchanged, so optimizers and checkpoints line up."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.reset_scaling_state()

    def reset_scaling_state(self) -> None:
        """Fresh scales (1) and empty histories, on CPU when the weights are on `meta`.

        Never on `meta`: FSDP materialises a module with meta buffers by `to_empty` plus
        LLM-Foundry's param_init_fn, which knows nothing of these, so the scales would be
        uninitialised memory. LLM-Foundry keeps its own buffers on CPU for the same reason;
        FSDP moves them to the GPU with the rest of the module.
        """
        device = self.weight.device if self.weight.device.type != "meta" else "cpu"
        self.fp8_meta = nn.ModuleDict({"scaling_fwd": ScalingMeta(3), "scaling_bwd": ScalingMeta(2)})
        self.fp8_meta.to(device)

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

    def _fit_history(self, meta: ScalingMeta, recipe: FP8Recipe) -> None:
        """Resize the history to the recipe's length keeping its rows and the scales, as TE's
        `adjust_amax_history_length` does when a delayed recipe's length changes: the first
        rows are kept when it shrinks, zero rows appended when it grows."""
        history, length = meta.amax_history, recipe.amax_history_len
        if history.shape[0] > length:
            meta.amax_history = history[:length].clone()
        elif history.shape[0] < length:
            meta.amax_history = nn.functional.pad(history, (0, 0, 0, length - history.shape[0]))

    def _cast_scales(self, meta: ScalingMeta, tensors: tuple[torch.Tensor, ...], fmt: str,
                     recipe: FP8Recipe) -> torch.Tensor:
        """The scales to cast `tensors` with; records their amaxes in history slot 0."""
        if (recipe.scaling == "delayed" and _STATE.replay is not None
                and meta is self.fp8_meta["scaling_fwd"]):
            return _STATE.replay[self].popleft()  # recompute: the original forward's scales
        amaxes = torch.stack([t.detach().abs().max().float() for t in tensors])
        if recipe.scaling == "current":
            return torch.stack([current_scale(a, fmt, power_2=recipe.use_power_2_scales)
                                for a in amaxes])
        n = len(tensors)
        self._fit_history(meta, recipe)
        meta.amax_history[0, :n] = torch.maximum(meta.amax_history[0, :n], amaxes)
        if _STATE.stash is not None and meta is self.fp8_meta["scaling_fwd"]:
            _STATE.stash.setdefault(self, deque()).append(meta.scale[:n].clone())
        return meta.scale[:n]

    def _update_scales(self, recipe: FP8Recipe, direction: Direction) -> None:
        fmt = recipe.format_for(direction)
        if recipe.scaling != "delayed":
            return
        meta = self.fp8_meta["scaling_fwd" if direction == "forward" else "scaling_bwd"]
        meta.amax_history, meta.scale = delayed_scale_update(
            meta.amax_history, meta.scale, FP8_MAX[fmt], recipe.amax_compute_algo, recipe.margin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fp8_enabled():
            return super().forward(x)
        recipe = _STATE.recipe
        if _STATE.replay is None:
            _STATE.pending["forward"].setdefault(self, recipe)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self, recipe)
