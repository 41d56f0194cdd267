"""`te_swap`: the Composer algorithm that puts a model's layers in FP8, with the chosen recipe.

At INIT (Composer runs it before FSDP wraps the model; LLM-Foundry has already built the
optimizer) it converts with `swap.convert_to_fp8` (which plans, refuses runs where nothing would
compute in FP8 and moves the optimizer to the new parameters) and prints and logs the coverage
table with the recipe.

The recipe reaches the layers one way per path, so exactly one recipe is ever active:
- `te` + `delayed`: Composer's own `amp_fp8` autocast builds `DelayedScaling(**precision_config)`
  on every batch, so the recipe goes into the run state's precision config (see
  `_set_precision_config`).
- `te` + `current`: Composer cannot build `Float8CurrentScaling`, so TE's autocast with it is
  entered around the model's training forward, inside Composer's (forward hooks on the model run
  inside Composer's precision context). TE 2.20 (`pytorch/quantization.py`): an autocast saves
  the global FP8 state on entry and restores it on exit, TE modules read the innermost recipe,
  and only the outermost exit runs the delayed-scaling amax reduction and scale update, which
  finds nothing to do (current-scaling modules register no amax buffers). A module sees one
  recipe type throughout, so TE's "Recipe type changed" warning does not fire.
- `emulate`: `emulate.fp8_autocast(recipe)` around the model's training forward, the same way.
Eval forwards stay in high precision, as Composer runs them (`fp8_autocast_enabled=False`);
with `te`, also those without grad that Composer's Generate callback runs inside an enabled TE
autocast, while a fit() runs (`_eval_in_high_precision`).
Every hook te_swap puts on the model comes off at the Trainer's close (`TESwap.close`), so
the next Trainer on the same model (a notebook's next stage) adds its own, once.
"""

from __future__ import annotations

import logging
import re
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from composer.core import Algorithm, Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from torch import nn

from foundry_fp8.composer.destinations import deliver, flush_mlflow
from foundry_fp8.composer.failures import device_failure
from foundry_fp8.composer.plain import export_plain, load_plain, load_sharded_plain
from foundry_fp8.health.keys import MODULES_CONVERTED, MODULES_IN_FP8
from foundry_fp8.options import SwapConfig, build
from foundry_fp8.recipe import FP8Recipe, RecipeError, is_same_delayed_recipe, run_fp8_recipe
from foundry_fp8.swap import (
    PLAIN_KEYS,
    SwapPlan,
    convert_to_fp8,
    coverage_table,
    fp8_module_counts,
)
from foundry_fp8.te.facts import Version

log = logging.getLogger(__name__)

#: LLM-Foundry's train() warns this (llmfoundry/command_utils/train.py, validate_config) before
#: any algorithm exists, so it cannot be filtered from here; te_swap answers it at INIT.
FOUNDRY_FP8_WARNING = "fp8 only supported for te.Linear layers"


class TESwap(Algorithm):
    """`algorithms: {te_swap: {backend: emulate, keep_first_blocks: 1, fp8_recipe: {...}}}`.

    Options are `TESwapOptions`' fields (`foundry_fp8.options`: SwapConfig's, `fp8_recipe`, see
    `FP8Recipe`, and `strict`): with `strict: false`, a failure of te_swap's own per-forward
    autocast is logged and te_swap stops entering it instead of crashing a single-rank run
    (refusals, bad options, device errors and any failure on several ranks always raise).

    Logs once at INIT, as hyperparameters: `fp8/backend` (`te` or `emulate`), `fp8/recipe`
    (the recipe as a mapping), `fp8/modules_converted`, `fp8/modules_in_fp8` (the modules whose
    GEMMs run in FP8: no LayerNorm, TE's the model was built with too), `fp8/linear_flops_share`
    and `fp8/linear_param_share` (the share, 0 to 1, of the linear layers' FLOPs and parameters
    that run in FP8) and `fp8/coverage` (the coverage table it prints).
    """

    def __init__(self, **options: Any):
        self.options = build("te_swap", options)  # one line naming algorithms.te_swap.<key>
        self.config: SwapConfig = self.options
        self.recipe: FP8Recipe = self.options.fp8_recipe
        self.strict: bool = self.options.strict
        if self.config.backend == "te":
            _check_te_environment(self.recipe)
        self.plan: SwapPlan | None = None
        self._autocast = ExitStack()
        self._hooks: list[Any] = []
        self._eval_hooks: list[Any] = []  # `_eval_in_high_precision`'s, from FIT_START to FIT_END
        self._undo_sharded_load: Callable[[], None] = lambda: None  # INIT to close
        self._model: weakref.ref[nn.Module] | None = None  # the model hooked at INIT

    def match(self, event: Event, state: State) -> bool:
        del state
        return event in (Event.INIT, Event.FIT_START, Event.FIT_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._convert(state, logger)
            _own_bug_warned(_warn_without_fp8_state, state,
                            lost="its check that the run keeps FP8 state in checkpoints")
        elif event == Event.FIT_START:
            _own_bug_warned(_refuse_fullgraph, state.model,
                            lost="its check of compile_config fullgraph (Dynamo would stop the "
                                 "first batch itself)")
            _own_bug_warned(self._hold_eval_in_high_precision, state, lost=_EVAL_LOST)
        else:
            self._exit(state.model, None, None)
            # a user's own FP8 inference after the run (an enabled TE autocast) is left to TE
            for handle in self._eval_hooks:
                handle.remove()
            self._eval_hooks = []
            # te_swap makes Composer log `enabled_algorithms/TESwap` at each fit's start
            _own_bug_warned(flush_mlflow, logger.destinations,
                            lost="flushing MLflow's queue (a second fit() within its "
                                 "logging_buffer_seconds may lose that batch at MLflow)")

    def close(self) -> None:
        """Take te_swap's hooks off the model, leave its autocast and end its sharded loads'
        renaming; run at Trainer.close (also after a fit that raised, which runs no FIT_END) by
        `_CloseWithTrainer`."""
        self._autocast.close()
        self._undo_sharded_load()
        self._remove_hooks()
        for handle in self._eval_hooks:
            handle.remove()
        self._eval_hooks = []
        self._model = None
        _LIVE.discard(self)

    def _convert(self, state: State, logger: Logger) -> None:
        self.close()  # this TESwap given to another Trainer that was never closed
        _refuse_recompute_outside_fp8(state, self.config.backend)
        model = state.model
        _close_unclosed(model)
        self._model = weakref.ref(model)
        _LIVE.add(self)
        state.callbacks.append(_CloseWithTrainer(self))
        _CloseWithTrainer.quiet_on_old_checkpoints()
        precision = state.precision.value
        plan = convert_to_fp8(model, self.config, optimizers=state.optimizers,
                              precision=precision,
                              meta_elsewhere=_meta_on_a_rank(model, self.config))
        self.plan = plan
        exporters = 0
        if any(hasattr(m, PLAIN_KEYS) for m in model.modules()):
            exporters = _own_bug_warned(
                export_plain, state.callbacks,
                lost="the hf_checkpointer's plain export (its HF save may fail on the fused "
                     "names)") or 0
        # also where nothing is fused now: a fused checkpoint's blocks
        _own_bug_warned(load_plain, state, lost=_LAYOUT_LOST)
        self._undo_sharded_load = _own_bug_warned(load_sharded_plain, state,
                                                  lost=_LAYOUT_LOST) or (lambda: None)
        if self.config.backend == "te" and self.recipe.scaling == "delayed":
            _set_precision_config(state, self.recipe)
        else:
            if self.config.backend == "te" and precision == "amp_fp8":
                _keep_composer_recipe_buildable(state)
            # always_call: a forward that raises (Composer's auto micro-batching retries after
            # an OOM) still leaves te_swap's autocast before Composer's, innermost first.
            self._hooks = [model.register_forward_pre_hook(self._enter),
                           model.register_forward_hook(self._exit, always_call=True)]
        _own_bug_warned(self._hold_eval_in_high_precision, state, lost=_EVAL_LOST)
        _own_bug_warned(self._say_coverage, state, logger, plan, exporters,
                        lost="the coverage table and te_swap's hyperparameters (the layers are "
                             "converted)")

    def _say_coverage(self, state: State, logger: Logger, plan: SwapPlan,
                      exporters: int) -> None:
        """The coverage table and the recipe, printed and logged once, at INIT."""
        model, precision, converted = state.model, state.precision.value, len(plan.converted)
        table = coverage_table(plan)
        recipe = self.recipe.as_config()
        print(f"foundry_fp8 te_swap: {converted} modules converted ({self.config.backend}), "
              f"FP8 recipe {recipe}\n{table}", flush=True)
        if precision == "amp_fp8":
            print(f"foundry_fp8 te_swap: ignore LLM-Foundry's warning '{FOUNDRY_FP8_WARNING}' "
                  f"above: {sum(fp8_module_counts(model))} modules run in FP8", flush=True)
        if plan.recompute:
            function = ("transformer_engine.pytorch.checkpoint" if self.config.backend == "te"
                        else "foundry_fp8.emulate.fp8_checkpoint")
            print(f"foundry_fp8 te_swap: transformers gradient checkpointing in "
                  f"{', '.join(n or 'the model' for n in plan.recompute)} recomputes with "
                  f"{function} (the forward's FP8 scales, TE #1190)", flush=True)
        if exporters:
            print(f"foundry_fp8 te_swap: {exporters} hf_checkpointer(s) export the plain model "
                  "its config names (TE's _extra_state left out, fused MLPs under MPT's names)",
                  flush=True)
        coverage = {"fp8/backend": self.config.backend, "fp8/recipe": recipe,
                    MODULES_CONVERTED: converted,
                    MODULES_IN_FP8: sum(d.in_fp8 for d in plan.decisions),
                    "fp8/linear_flops_share": plan.fp8_flops_share,
                    "fp8/linear_param_share": plan.fp8_param_share, "fp8/coverage": table}
        # a logger's failure is not te_swap's (its `strict` is about the autocast): warned
        deliver(logger.destinations, "hyperparameters",
                lambda d: d.log_hyperparameters(coverage), "te_swap")

    def _hold_eval_in_high_precision(self, state: State) -> None:
        """At INIT and again at each later fit()'s FIT_START (FIT_END took them off)."""
        if (self.plan is not None and not self._eval_hooks and self.config.backend == "te"
                and state.precision.value == "amp_fp8"):
            self._eval_hooks = _eval_in_high_precision(state.model, self.plan)

    def _recipe_context(self) -> AbstractContextManager:
        if self.config.backend == "emulate":
            from foundry_fp8.emulate import fp8_autocast

            return fp8_autocast(recipe=self.recipe)
        from foundry_fp8.te import backend

        return backend.te_fp8_autocast(self.recipe)

    def _enter(self, module: nn.Module, args: Any) -> None:
        del args
        try:
            self._autocast.close()  # left open only if the last exit hook could not run
            if not module.training or not self._hooks:
                return
            self._autocast.enter_context(self._recipe_context())
        except Exception as error:
            self._give_up_or_raise(error, "entering")

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """Leaving the recipe autocast runs the forward scale update (outermost exit, as in
        TE): its failure is the autocast's, handled as at entry (`strict`)."""
        del module, args, output
        try:
            self._autocast.close()
        except Exception as error:
            self._autocast = ExitStack()  # whatever it held is left
            self._give_up_or_raise(error, "leaving")

    def _give_up_or_raise(self, error: Exception, doing: str) -> None:
        """`strict: false` trains on without the autocast, on one rank only: on several, the
        others would wait in the amax all-reduce of its exit (TE's too) while this rank went on
        to the next collective (a gloo abort, an NCCL hang or mixed-up gradients). A device error
        (out of memory, CUDA) is raised as it came: the run cannot go on past it."""
        if self.strict or device_failure(error):
            raise error
        if dist.get_world_size() > 1:
            log.error("te_swap: %s the FP8 recipe autocast failed on rank %d; strict: false "
                      "cannot go on without it on several ranks (the others would wait in its "
                      "amax all-reduce)", doing, dist.get_global_rank())
            raise error
        log.exception("te_swap: %s the FP8 recipe autocast failed; te_swap stops entering it "
                      "(strict: false), converted layers run without it", doing)
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


#: Every TESwap that hooked a model (weak: one whose Trainer is dropped goes with it).
_LIVE: weakref.WeakSet[TESwap] = weakref.WeakSet()


def _close_unclosed(model: nn.Module) -> None:
    """Close the te_swap of an earlier Trainer on `model` that was never closed (LLM-Foundry's
    `train()` returns its Trainer unclosed; a fit that raised is never closed). Its hooks stayed
    on the model beside the new ones, and the two pairs ran enter, enter, exit, exit: the first
    exit restored the state from before its own entry under the second's, which then put the
    enabled autocast back, so FP8 stayed on after every training forward, for eval and any
    other model in the process too."""
    for other in list(_LIVE):
        if other._model is not None and other._model() is model:
            log.warning("te_swap: an earlier Trainer on this model was never closed "
                        "(trainer.close()); its te_swap hooks come off the model now")
            other.close()


class _CloseWithTrainer(Callback):
    """Composer's `Trainer.close` closes callbacks only, never algorithms (composer/core/engine.py
    0.32, `Engine._close`): te_swap adds this one at INIT to take its hooks off the model
    then. Each Trainer built on the model would otherwise add another pair, and every training
    forward would nest one more recipe autocast."""

    def __init__(self, swap: TESwap) -> None:
        self.swap = swap

    def close(self, state: State, logger: Logger) -> None:
        del state, logger
        self.swap.close()

    @classmethod
    def quiet_on_old_checkpoints(cls) -> None:
        """It has no state, yet Composer checkpoints every callback by class name and, on load,
        warns of each one the checkpoint lacks (composer/core/state.py:1580 in 0.32,
        `load_state_dict`): a resume from a checkpoint written before te_swap added it (a2e85d1)
        would warn of a private class. Only that warning, of this class, from that module, is
        ignored; set at INIT, as a user's or pytest's `catch_warnings` restores the filters. Not
        when the filters already ignore it: `filterwarnings` clears Python's record of the
        warnings shown once at every call (CPython 3.11 Lib/warnings.py, `_add_filter` calls
        `_filters_mutated`), which shows them again."""
        name = cls.__qualname__
        if _first_filter_for(f"{name} is not in the state_dict. Its state will not be restored.",
                             UserWarning, "composer.core.state") != "ignore":
            warnings.filterwarnings("ignore", message=f"{re.escape(name)} is not in the state_dict",
                                    category=UserWarning, module=r"composer\.core\.state")


#: what te_swap runs without when a part of it outside its autocast fails (`_own_bug_warned`)
_LAYOUT_LOST = ("renaming checkpoints saved in another fuse_ln_mlp/exclude layout on load (a "
                "load in this run's own layout is unaffected)")
_EVAL_LOST = ("holding TE layers' no-grad eval forwards (Composer's Generate callback) in high "
              "precision")


def _own_bug_warned(work: Callable[..., Any], *args: Any, lost: str) -> Any:
    """`work(*args)`, a part of te_swap besides the conversion and the autocast: a bug of ours
    there is one line naming what the run goes on without, never the run's end. te_swap's
    `strict` is about the autocast; a refusal (ValueError: fullgraph) is raised as it is."""
    try:
        return work(*args)
    except ValueError:
        raise
    except Exception:
        log.exception("te_swap: internal error; the run goes on without %s", lost)
        return None


def _first_filter_for(text: str, category: type[Warning], module: str) -> str | None:
    """The action of the first of `warnings.filters` that matches this warning, as
    `warnings.warn_explicit` matches them (CPython 3.11 Lib/warnings.py); None where none does,
    or where the first is one line's (its line is not known here)."""
    for action, message, kind, where, line in warnings.filters:
        if ((message is None or message.match(text)) and issubclass(category, kind)
                and (where is None or where.match(module))):
            return action if line == 0 else None
    return None


def _eval_in_high_precision(model: nn.Module, plan: SwapPlan) -> list[Any]:
    """Backend te under amp_fp8: an eval-mode forward without grad of the model's TE FP8 modules
    runs in high precision, as Composer's own eval (`fp8_autocast_enabled=False`) and te_swap's
    emulated layers do. Composer's Generate callback (LLM-Foundry's `generate_callback`) calls
    `model.generate` in eval mode inside `get_precision_context(state.precision)`
    (composer/callbacks/generate.py:106, 0.32), an enabled TE autocast with Composer's default
    recipe: each decode step's GEMMs would run in FP8 on batch x 1 tokens, which TE's FP8 GEMM
    refuses (`foundry_fp8.shapes`), and add inference amaxes to the training scales. Around
    such a forward, TE's disabled region (`te.backend.te_high_precision`); a forward with grad
    on trains (a user's loop may train in eval mode, dropout off) and is left alone, as TE
    would. The hooks run eagerly under torch.compile (TE's forwards do too); their handles are
    returned, for te_swap to take them off at FIT_END."""
    from foundry_fp8.te import backend, probe

    handles: list[Any] = []
    for decision in plan.decisions:
        if not decision.in_fp8:  # te.LayerNorm too: no GEMM, not FP8
            continue
        module = model.get_submodule(decision.name)
        if probe.te_class_name(module) is None:
            continue
        # a training forward opens nothing (None): these hooks run around every forward
        regions: list[ExitStack | None] = []

        def enter(mod: nn.Module, args: Any, regions: list[ExitStack | None] = regions) -> None:
            del args
            stack = None
            if not mod.training and not torch.is_grad_enabled():
                stack = ExitStack()
                stack.enter_context(backend.te_high_precision(mod))
            regions.append(stack)

        def leave(mod: nn.Module, args: Any, output: Any,
                  regions: list[ExitStack | None] = regions) -> None:
            del mod, args, output
            if regions and (stack := regions.pop()) is not None:
                stack.close()

        handles += [module.register_forward_pre_hook(torch.compiler.disable(enter)),
                    module.register_forward_hook(torch.compiler.disable(leave), always_call=True)]
    return handles


def _refuse_fullgraph(model: nn.Module) -> None:
    """`compile_config: {fullgraph: true}` cannot compile a model with FP8 layers: their forwards
    run outside the graph (TE's `no_torch_dynamo`, module/linear.py:1872; the emulation's
    `torch.compiler.disable`), so Dynamo would stop the first batch with its own traceback.
    Composer compiles after INIT and AFTER_LOAD (trainer.py, `compile_config is not None`), so
    FIT_START, before any batch, is te_swap's first sight of it. torch keeps the flag in
    private attributes (2.7, `_dynamo.convert_frame.ConvertFrameAssert._one_graph`): a torch
    that moved them is not refused here (Dynamo then stops the first batch itself)."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:
        return
    contexts = [getattr(model, "dynamo_ctx", None)]  # a model the user compiled
    forward = getattr(model, "forward", None)  # Composer's compile wraps the forward
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            contexts.append(cell.cell_contents)
        except ValueError:  # an empty cell: a name the forward closes over, not yet bound
            continue
    for context in contexts:
        if not isinstance(context, _TorchDynamoContext):
            continue
        convert = getattr(context.callback, "_torchdynamo_orig_callable", None)
        if getattr(convert, "_one_graph", False) is True:
            raise ValueError(
                "te_swap: compile_config fullgraph: true cannot compile the FP8 layers (their "
                "forwards run outside torch.compile, as TransformerEngine's do); drop fullgraph "
                "(the model between them still compiles)")


def _meta_on_a_rank(model: nn.Module, config: SwapConfig) -> bool:
    """Whether any rank's model holds weights on the meta device (LLM-Foundry's `init_device:
    mixed` puts local rank 0's on the CPU and the others' on meta): the plan's meta-device
    decisions (`fuse_ln_mlp`, `convert_layernorm`) must be every rank's, or rank 0 alone
    fuses and FSDP shards different modules per rank. Asked only where an option reads it: one
    all_gather of a bool at INIT, which every rank runs."""
    if not (config.fuse_ln_mlp or config.convert_layernorm) or dist.get_world_size() == 1:
        return False
    return any(dist.all_gather_object(any(p.is_meta for p in model.parameters())))


def _warn_without_fp8_state(state: State) -> None:
    """A run that saves checkpoints without `fp8_state` resumes with fresh FP8 scales and amax
    histories: the emulated ones are not in the model's state, and te_swap leaves TE's
    `_extra_state` out of it (`swap._save_plain`). Said once, at INIT. fp8_state is known by
    its `keeps_fp8_state` attribute: it imports this module, so this one does not import it."""
    from composer.callbacks import CheckpointSaver

    if (any(isinstance(c, CheckpointSaver) for c in state.callbacks)
            and not any(getattr(c, "keeps_fp8_state", False) for c in state.callbacks)):
        log.warning("te_swap: this run saves checkpoints but has no fp8_state callback: a "
                    "resume from them starts FP8 scales and amax histories fresh; add "
                    "callbacks: {fp8_state: {}} to keep them")


def _refuse_recompute_outside_fp8(state: State, backend: str) -> None:
    """FSDP activation checkpointing as Composer sets it up by default recomputes the blocks in
    the backward outside the FP8 autocast (TE #1190, `te.recompute.recompute_plan`): emulated
    layers stopped the first backward with torch's "A different number of tensors was saved",
    TE layers under FSDP1's default reentrant checkpoint trained on high-precision recompute
    gradients, silently. `fp8_state` (a callback: Composer runs it before te_swap at INIT) sets
    the safe FSDP fields or refuses; without it, te_swap refuses in one line, before the model
    is touched."""
    from foundry_fp8.te.recompute import recompute_plan

    plan = recompute_plan(*recompute_inputs(state), backend == "emulate")
    if plan.refusal is not None:
        raise ValueError(f"te_swap: {plan.refusal.removeprefix('fp8_state: ')}")
    if plan.settings:
        settings = ", ".join(f"{k}: {str(v).lower()}" for k, v in plan.settings.items())
        raise ValueError(
            "te_swap: fsdp_config.activation_checkpointing recomputes the FP8 layers outside FP8 "
            f"(TE #1190); add callbacks: {{fp8_state: {{}}}}, which sets them, or set "
            f"fsdp_config {settings}")


def recompute_inputs(state: State) -> tuple[str, dict[str, Any], int, Version | None]:
    """What `te.recompute.recompute_plan` judges of this run, for te_swap and fp8_state: the
    precision, the FSDP config's recompute fields, its version, and the installed TE's version
    (read only where activation checkpointing meets amp_fp8)."""
    fsdp = state.fsdp_config
    fields = {k: getattr(fsdp, k) for k in ("activation_checkpointing", "te_checkpoint_wrapper",
                                            "activation_checkpointing_reentrant")
              if hasattr(fsdp, k)}
    precision = state.precision.value
    te_version = None
    if precision == "amp_fp8" and fields.get("activation_checkpointing"):
        from foundry_fp8.te.probe import te_version as installed_te_version

        te_version = installed_te_version()
    return precision, fields, state.fsdp_config_version, te_version


def _check_te_environment(recipe: FP8Recipe) -> None:
    """`backend: te` needs TE and a CUDA device (errors name `emulate`), and a GPU/TE that can
    run the recipe; warns where TE's power-of-2 variable disagrees with the recipe."""
    import torch

    from foundry_fp8.te import backend, probe
    from foundry_fp8.te.facts import environment_problems

    backend.require_te()
    backend.require_cuda()
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    version = probe.te_version()
    problems = environment_problems(recipe, capability, version)
    if problems:
        raise RecipeError(problems[0])
    if (conflict := backend.power_2_env_conflict(recipe, version)) is not None:
        log.warning(conflict)


def _keep_composer_recipe_buildable(state: State) -> None:
    """Under te_swap's current scaling, Composer's amp_fp8 still builds its own delayed recipe
    around it on every batch; where TE would refuse that one (te.backend
    `composer_delayed_kwargs`), its precision_config is set as `_set_precision_config` says."""
    from foundry_fp8.te import backend

    kwargs = backend.composer_delayed_kwargs(state.precision_config)
    if kwargs is not None:
        state._precision_config = kwargs


def _set_precision_config(state: State, recipe: FP8Recipe) -> None:
    """Make Composer's `amp_fp8` autocast use `recipe` (a delayed one).

    `State.precision_config` is a read-only property backed by `State._precision_config`, which
    only the Trainer constructor sets (LLM-Foundry 0.22 passes none) and which Composer reads on
    every batch (trainer.py, `get_precision_context(state.precision, state.precision_config)`).
    Setting the backing attribute at INIT, before the first batch, is the one place the
    recipe can enter without patching the Trainer; a different precision_config already given to
    the Trainer is refused rather than overridden, so only one recipe is ever in force. One that
    means the same recipe (`is_same_delayed_recipe`: keys left at TE's defaults, `fp8_format`
    as the string "HYBRID") is replaced by ours, written with TE's `Format` member: Composer
    passes precision_config to TE unchanged, and TE 2.20.2's DelayedScaling, a pydantic
    dataclass, refuses a string `fp8_format`.
    """
    from foundry_fp8.te import backend

    current = state.precision_config
    if current is not None and not is_same_delayed_recipe(current, recipe):
        raise ValueError(f"te_swap.fp8_recipe: the Trainer already has precision_config "
                         f"{dict(current)}; give the recipe in one place only")
    state._precision_config = backend.delayed_scaling_kwargs(recipe)


def run_recipe(state: State) -> FP8Recipe | None:
    """The FP8 recipe this run's FP8 modules follow (`foundry_fp8.recipe.run_fp8_recipe`, read
    from the built run: its TESwap, precision and precision_config; a State driven by hand may
    have no precision_config, which only amp_fp8 without te_swap reads)."""
    swap = next((a.recipe for a in state.algorithms if isinstance(a, TESwap)), None)
    return run_fp8_recipe(swap, state.precision.value, getattr(state, "precision_config", None))
