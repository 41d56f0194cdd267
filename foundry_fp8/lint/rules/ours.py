"""Our entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_guard`, `fp8_lint`, `jsonl`): where
LLM-Foundry's registries look for them, their options (foundry_fp8.lint.values, with the option
dataclasses the constructors build, `foundry_fp8.options`, so the linter and the run agree), and
how they combine with precision."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import PurePath
from typing import Any

from foundry_fp8.filters import (
    fuse_reason,
    layernorm_reason,
    linear_reason,
    module_filter_fn,
    nearest_name,
    prefixed_fix,
    search,
)
from foundry_fp8.lint.config import (
    fc_type_name,
    get,
    has_fp8_state,
    is_fp8,
    native_te_layers,
    precision,
    te_swap,
)
from foundry_fp8.lint.entries import entry_point_names, our_entries
from foundry_fp8.lint.known import (
    FOUNDRY_REGISTRY,
    MPT_MODEL_NAMES,
    PRECISIONS,
    REGISTRY_GROUPS,
    did_you_mean,
)
from foundry_fp8.lint.registry import Hit, LintContext, join_key, rule, section
from foundry_fp8.lint.rules.fsdp import STATE_DICT_DEFAULT
from foundry_fp8.lint.rules.model import (
    MPT_LM_HEAD,
    MPTModule,
    mpt_modules,
    mpt_value,
    te_swap_options,
)
from foundry_fp8.lint.rules.train import COMPOSER, FOUNDRY
from foundry_fp8.lint.values import built_options, option_problems
from foundry_fp8.options import (
    ENTRIES,
    FP8StatsOptions,
    OptionError,
    SwapConfig,
    TESwapOptions,
    batch_count,
    checks,
    defaults,
)
from foundry_fp8.paths import path_problem, repeated_run_folder, run_folder, safe_run_name
from foundry_fp8.recipe import FP8Recipe, run_fp8_recipe, step0_scaling
from foundry_fp8.sdpa_facts import SDPA
from foundry_fp8.te.facts import (
    MIN_FP8_CAPABILITY,
    TE_PICKLE_GUARD_FIXES,
    TE_PICKLE_GUARD_FROM,
    dotted,
    refuses_pickled_extra_state,
)

OUR_OPTIONS = "foundry_fp8/options.py ENTRIES"


def _entry_items(config: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(key, entry, options) for each of our entries the config uses."""
    for (section_name, name), entry in our_entries().items():
        block = section(config, section_name)
        if name in block:
            yield f"{section_name}.{name}", entry, block[name]


def _option_hits(config: Mapping[str, Any], kinds: tuple[str, ...]) -> Iterator[Hit]:
    """Our entries' option problems of these kinds (foundry_fp8.lint.values)."""
    for key, entry, options in _entry_items(config):
        if isinstance(options, Mapping):
            for problem in option_problems(entry, options):
                if problem.kind in kinds:
                    yield Hit(f"{key}.{problem.option}", problem.message, fix=problem.fix)


@rule("FP8008", "error", "FP8 recipe problems in te_swap's `fp8_recipe` or fp8_stats' "
      "`recipe` (pure E5M2, keys TE removed such as `interval`, unknown keys and values)",
      why="Shared with foundry_fp8.recipe, which te_swap's and fp8_stats' option dataclasses "
      "use (fp8_stats' `recipe` is a scaling name or a recipe mapping), so the linter and the "
      "run agree. margin and amax_history_len have bounds (recipe.MAX_MARGIN, MAX_HISTORY).",
      source="foundry_fp8/recipe.py recipe_problems (TE's DelayedScaling; TE 2.20 "
      "transformer_engine/common/recipe/delayed_scaling.cu:300 for the margin); "
      "foundry_fp8/options.py Recipe",
      fix="see the message")
def recipe_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _option_hits(config, ("recipe",))


@rule("FP8019", "error", f"unknown options of our entries ({', '.join(ENTRIES)}) (did-you-mean)",
      why="LLM-Foundry passes an entry's mapping as keyword arguments, so an unknown option "
      "fails at construction. The option lists are the fields of our option dataclasses.",
      source=f"{OUR_OPTIONS}; {FOUNDRY} llmfoundry/utils/builders.py build_callback (reserved "
      "train_config)",
      fix="fix the spelling", also=("eval",), unresolved=True)
def entry_options_unknown(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, entry, options in _entry_items(config):
        if options is not None and not isinstance(options, Mapping):
            yield Hit(key, f"{entry.name}'s options must be a mapping, got "
                      f"{type(options).__name__}", fix=f"write `{entry.name}: {{}}`")
    yield from _option_hits(config, ("unknown", "reserved"))


@rule("FP8020", "error", "options of our entries with the wrong type (a `Literal` value "
      "outside its choices, `\"true\"` for a bool, `true` for an int)",
      why="Checked by each option's declared check; a Literal admits only its values, a bool "
      "only true/false, an int neither a bool nor a float.",
      source="foundry_fp8/options.py (the option dataclasses' fields)",
      fix="give a value of the annotated type", also=("eval",))
def entry_option_types(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _option_hits(config, ("type",))


@rule("FP8021", "error", "te_swap's `te` backend (its default) without amp_fp8",
      why="TE layers compute in FP8 only inside Composer's amp_fp8 autocast; te_swap refuses "
      "the run at INIT when nothing would run in FP8.",
      source="foundry_fp8/swap.py convert_to_fp8, would_run_fp8 (called by "
      "foundry_fp8/composer/te_swap.py TESwap._convert)",
      fix="precision: amp_fp8, or te_swap backend: emulate")
def te_swap_without_amp_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    if swap is not None and swap.get("backend") == "te" and not is_fp8(config) \
            and precision(config) in PRECISIONS:
        yield Hit("algorithms.te_swap", f"te_swap's backend te converts layers to TE, which "
                  f"computes in FP8 only under precision amp_fp8, not {precision(config)}; "
                  "te_swap refuses the run at INIT")


def _kept(module: MPTModule, swap: SwapConfig, n_blocks: int) -> str | None:
    """Why te_swap keeps one of an MPT's modules (None: it converts it), by the decisions
    `foundry_fp8.swap.plan_swap` takes (foundry_fp8/filters.py). A LayerNorm or a fusable MLP
    passing them counts as converted although te_swap still declines those on the meta device:
    the rule speaks only where nothing at all converts."""
    if module.te:
        return "a TE module the model builds itself"
    if module.kind == "linear":  # te_swap's option and shape rules first, then the MoE's
        return linear_reason(module.name, module.in_features, module.out_features, swap,
                             n_blocks) or module.kept
    if module.kind == "moe_experts":
        return module.kept
    if module.kind == "layernorm":
        return layernorm_reason(module.name, module.bias, swap, n_blocks) \
            if swap.convert_layernorm else "convert_layernorm is off"
    return fuse_reason(module.name, module.in_features, module.out_features, swap, n_blocks) \
        if swap.fuse_ln_mlp else "fuse_ln_mlp is off"


def converts_any(modules: list[MPTModule], swap: SwapConfig, n_blocks: int) -> bool:
    """Whether te_swap with these options converts any of an MPT's modules."""
    return any(_kept(m, swap, n_blocks) is None for m in modules)


#: FP8034's fix where every linear is one of the model's own TE modules (`fc_type: te`).
TE_LAYERS_FIX = ("set model.fc_type: torch so that te_swap converts the linears itself, or "
                 "drop te_swap and train the model's own TE layers with precision: amp_fp8 on "
                 "a GPU with TransformerEngine")


@rule("FP8034", "error", "te_swap options under which it converts no layer of an MPT "
      "(keep_first/last_blocks covering every block, an include matching no layer, a "
      "min_gemm_size above every GEMM), so te_swap refuses the run",
      why="te_swap plans its conversions at INIT, after the model is built, and refuses the "
      "run ('no module would run in FP8') when it converts nothing and no TE layer of the "
      "model's own runs under amp_fp8, whatever `strict` says. The linter lists the modules "
      "LLM-Foundry builds for the MPT config (names as te_swap sees them: "
      "model.transformer.blocks.N.attn.Wqkv, model.lm_head; a torch_dmoe block's router linear "
      "and experts, which te_swap always keeps; megablocks' MoE is not modelled) and decides "
      "each one with te_swap's own functions (foundry_fp8/filters.py). The key is the te_swap option that, "
      "at its default, would let a layer convert. Only MPT (`mpt_causal_lm`) models are "
      "judged; te_swap's backend te without amp_fp8 is FP8021's.",
      source="foundry_fp8/swap.py convert_to_fp8, _refusal, plan_swap, would_run_fp8 "
      "(called by foundry_fp8/composer/te_swap.py TESwap._convert); foundry_fp8/filters.py linear_reason, layernorm_reason, "
      f"fuse_reason; {FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py, "
      "llmfoundry/models/layers/blocks.py, attention.py, ffn.py (the modules and their names)",
      fix="relax the option the message names (keep_first/last_blocks, include/exclude, "
      "min_gemm_size), or drop te_swap")
def te_swap_converts_nothing(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap_options(config)
    if swap is None or (swap.backend == "te" and not is_fp8(config)) \
            or (is_fp8(config) and native_te_layers(config)):
        return
    model = section(config, "model")
    modules = mpt_modules(model)
    if modules is None:
        return
    n_blocks = int(mpt_value(model, "n_layers"))
    given = section(section(config, "algorithms"), "te_swap")
    options = [o for o in checks(SwapConfig) if o in given and o != "module_filter_fn"]
    try:
        if converts_any(modules, swap, n_blocks):
            return
        culprits = [o for o in options if converts_any(
            modules, replace(swap, **{o: defaults(SwapConfig)[o]}), n_blocks)]
    except OptionError:  # a regex that takes too long: te_swap stops with its own error
        return
    linears = sum(m.kind == "linear" for m in modules)
    said = ", ".join(f"{o}: {given[o]!r}" for o in culprits) or "; ".join(sorted(
        {str(_kept(m, swap, n_blocks)) for m in modules if m.kind == "linear"})[:3])
    message = (f"te_swap would convert none of this MPT's {linears} linears ({said}) and no "
               "other layer runs in FP8: te_swap refuses the run at INIT ('no module would run "
               "in FP8')")
    if not culprits and all(m.te for m in modules if m.kind == "linear"):
        # no option of te_swap's to relax: the model's own TE layers (fc_type te), which run
        # in FP8 only under amp_fp8, are what te_swap leaves alone
        yield Hit("model.fc_type", message, fix=TE_LAYERS_FIX)
        return
    yield Hit(f"algorithms.te_swap.{culprits[0]}" if culprits else "algorithms.te_swap",
              message)




@rule("FP8048", "warning", "`fp8_stats` `layers`/`exclude` that select none of an MPT's "
      "linear layers (an error with `strict: true`)",
      why="fp8_stats watches the linear layers (torch's, te_swap's, TE's) whose names `layers` "
      "finds (re.search) and `exclude` does not; when none is left it warns once at the start "
      "and logs nothing for the whole run (strict: true stops the run instead). The linter "
      "lists the linears LLM-Foundry builds for the MPT config, under the names fp8_stats "
      "sees (model.transformer.blocks.N.attn.Wqkv, ...). MPT models whose TE layers or "
      "te_swap fusions rename or merge layers (fc_type te, te_ln_mlp, fuse_ln_mlp, "
      "convert_layernorm) are not judged.",
      source="foundry_fp8/monitor.py select_layers, no_layers_message; foundry_fp8/composer/"
      "stats.py _failed (NoLayersError); foundry_fp8/filters.py module_filter_fn; "
      f"{FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py, llmfoundry/models/layers/blocks.py",
      fix="a regex that re.search finds in the layer names the message shows")
def fp8_stats_selects_nothing(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    judged = _stats_layers(config)
    if judged is None:
        return
    built, names = judged
    monitor = built.monitor
    selected = module_filter_fn(type(monitor).PATH, monitor.layers, monitor.exclude)
    try:
        if any(selected(None, name) for name in names):
            return
    except OptionError:  # a regex that takes too long: fp8_stats stops with its own error
        return
    layers_alone = module_filter_fn(type(monitor).PATH, monitor.layers, None)
    key = "exclude" if monitor.exclude is not None and any(layers_alone(None, n) for n in names) \
        else "layers"
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    yield Hit(f"callbacks.fp8_stats.{key}", f"fp8_stats' {key} {getattr(monitor, key)!r:.60} "
              f"leaves none of this MPT's {len(names)} linear layers ({shown}): fp8_stats "
              + ("stops the run (strict: true)" if built.strict else
                 "warns once and logs nothing for the whole run"),
              severity="error" if built.strict else "warning")


def _stats_layers(config: Mapping[str, Any]) -> tuple[FP8StatsOptions, list[str]] | None:
    """fp8_stats' options and the names of the linears it may watch in this MPT, as it sees
    them; None without fp8_stats, for a model not modelled, or one whose TE layers or te_swap
    fusions rename or merge layers."""
    callbacks = section(config, "callbacks")
    built = built_options("fp8_stats", callbacks["fp8_stats"]) if "fp8_stats" in callbacks \
        else None
    modules = mpt_modules(section(config, "model")) if isinstance(built, FP8StatsOptions) \
        else None
    swap = te_swap_options(config)
    if modules is None or any(m.te for m in modules) or (
            swap is not None and (swap.fuse_ln_mlp or swap.convert_layernorm)):
        return None
    return built, [m.name for m in modules if m.kind == "linear"]


@rule("FP8055", "warning", "a te_swap `exclude` that matches none of the layers te_swap "
      "decides on in an MPT, so it keeps nothing in high precision (`^transformer\\.`: the names "
      "begin with Composer's `model.`)",
      why="te_swap searches `exclude` (regex.search, foundry_fp8/filters.py) in the module "
      "names of the model Composer wraps (model.transformer.blocks.N.attn.Wqkv, "
      "model.lm_head); one that matches none of them keeps nothing in high precision, and the "
      "layers the user meant to keep out train in FP8. The run warns once at INIT, inside a "
      "long log; the linter says it before the run, at its line, with the nearest real name. "
      "The names are those LLM-Foundry builds for the MPT config (the linear layers, and the "
      "LayerNorms and MLPs te_swap can convert or fuse); other models (hf_causal_lm) are not "
      "judged: their names are known only once built.",
      source="foundry_fp8/swap.py convert_to_fp8 (the run's warning); foundry_fp8/filters.py "
      f"search, filter_reason; {FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py, "
      "llmfoundry/models/layers/blocks.py, attention.py, ffn.py (the modules and their names)",
      fix="a regex that regex.search finds in the full names (`^model\\.transformer\\.blocks"
      "\\.0\\.`, or unanchored `blocks\\.0\\.`)")
def te_swap_exclude_matches_nothing(config: Mapping[str, Any],
                                    ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap_options(config)
    modules = mpt_modules(section(config, "model")) if swap is not None and swap.exclude \
        else None
    if not modules:
        return
    key = f"{swap.PATH}.exclude"
    names = [m.name for m in modules]
    try:
        if any(search(key, swap.exclude, name) for name in names):
            return
        fix = prefixed_fix(key, swap.exclude, names)
    except OptionError:  # a regex that takes too long: te_swap stops with its own error
        return
    nearest = nearest_name(swap.exclude, names)
    yield Hit(key, f"te_swap's exclude '{swap.exclude}' matches none of the {len(names)} module "
              f"names of this MPT that te_swap decides on (nearest: '{nearest}'), so it keeps "
              "nothing in high precision: those layers train in FP8",
              fix=f"write {fix}, searched in the full names" if fix else None)


@rule("FP8056", "warning", "fp8_stats options that do nothing in an MPT: an `exclude` that "
      "leaves out none of the layers `layers` watches, a `dump_layers` that matches none of the "
      "watched layers, dump options (`dump_layers`, `dump_folder`, `dump_max_mb`) without "
      "`dump_steps`",
      why="fp8_stats watches the linear layers whose full names (model.transformer.blocks.N."
      "attn.Wqkv) `layers` finds (regex.search) and `exclude` does not, and saves tensors only at "
      "`dump_steps`, of the watched layers `dump_layers` finds. An `exclude` that matches none of "
      "the watched layers changes nothing, silently (often `^blocks`: the metric keys' shorter "
      "names); the dump options do nothing without dump_steps, silently; a dump_layers that "
      "matches none of the watched layers saves nothing (the run warns at FIT_START). Judged "
      "on the linears LLM-Foundry builds for an MPT config, as FP8048.",
      source="foundry_fp8/monitor.py select_layers, dump_layers_of, no_dump_layers_message; "
      "foundry_fp8/options.py Schedule.dumps; foundry_fp8/composer/stats.py _fit_start "
      "(dump_folder only with dump_steps); foundry_fp8/filters.py module_filter_fn",
      fix="a regex that regex.search finds in the full names the message shows; or set "
      "dump_steps (or drop the dump options)")
def fp8_stats_filter_does_nothing(config: Mapping[str, Any],
                                  ctx: LintContext) -> Iterator[Hit]:
    judged = _stats_layers(config)
    if judged is None:
        return
    built, names = judged
    monitor, path = built.monitor, type(built).PATH
    written = section(section(config, "callbacks"), "fp8_stats")
    try:
        watched = [n for n in names if module_filter_fn(path, monitor.layers, None)(None, n)]
        kept = [n for n in watched if module_filter_fn(path, None, monitor.exclude)(None, n)]
        if monitor.exclude is not None and watched and kept == watched:
            fix = prefixed_fix(f"{path}.exclude", monitor.exclude, watched)
            yield Hit(f"{path}.exclude", f"fp8_stats' exclude '{monitor.exclude}' matches none "
                      f"of the {len(watched)} layers it watches (nearest: '"
                      f"{nearest_name(monitor.exclude, watched)}'), so it leaves out nothing",
                      fix=f"write {fix}, searched in the full names" if fix else None)
        dump_options = [o for o in ("dump_layers", "dump_folder", "dump_max_mb") if o in written]
        if dump_options and not built.schedule.dump_steps:
            yield Hit(f"{path}.{dump_options[0]}", f"fp8_stats' {', '.join(dump_options)} "
                      "without dump_steps: fp8_stats dumps only at dump_steps, so no tensor is "
                      "saved", fix="add `dump_steps: [<batch>, ...]`, or drop "
                      + ", ".join(dump_options))
        elif monitor.dump_layers is not None and kept and not any(
                module_filter_fn(path, monitor.dump_layers, None, "dump_layers")(None, n)
                for n in kept):
            yield Hit(f"{path}.dump_layers", f"fp8_stats' dump_layers '{monitor.dump_layers}' "
                      f"matches none of the {len(kept)} watched layers (nearest: '"
                      f"{nearest_name(monitor.dump_layers, kept)}'), so dump_steps "
                      f"{sorted(built.schedule.dump_steps)} save nothing",
                      fix=(f"write {fix}, searched in the full names" if (fix := prefixed_fix(
                          f"{path}.dump_layers", monitor.dump_layers, kept)) else None))
    except OptionError:  # a regex that takes too long: fp8_stats stops with its own error
        return


@rule("FP8058", "warning", "an fp8_stats schedule that misses the run: `dump_steps` at or past "
      "max_duration (`max_duration: 1000ba` with `dump_steps: [1000]`), or no logging "
      "step before it (`start` or `interval` past it), or none but step 0 in a run that resumes",
      why="fp8_stats logs and dumps at the batch count a batch starts at: 0 to max_duration - 1 "
      "(`foundry_fp8.composer.stats.last_batch`), so a dump step of max_duration or more never "
      "comes and saves nothing, silently. A schedule with no logging step in the run logs no "
      "FP8 statistics (the run warns at FIT_START); under delayed scaling (te_swap's recipe, "
      "amp_fp8's, else fp8_stats' what-if `recipe`) a schedule whose only step in the run is 0 "
      "judges nothing either: step 0 casts at the initial scale 1. A run that resumes starts "
      "at its checkpoint's batch count, after step 0 (Composer restores the timestamp): with "
      "`load_path` (not `load_weights_only`) such a schedule logs no FP8 statistics at all, "
      "whatever the scaling; with `autoresume`, the first launch logs step 0 and every "
      "relaunch that resumes logs nothing. Judged where max_duration is a number of batches "
      "(`1000ba`); the schedule's own `next_log` decides.",
      source="foundry_fp8/options.py Schedule.dumps, next_log; foundry_fp8/composer/stats.py "
      "last_batch, _fit_start (judged from the resumed batch count), _say_unlogged; "
      f"{COMPOSER} composer/core/time.py (an int max_duration is epochs), "
      "composer/trainer/trainer.py (autoresume loads the latest checkpoint with "
      "load_weights_only False)",
      fix="dump steps below max_duration's batch count; a start and interval that reach a "
      "batch before the run's end (after step 0 under delayed scaling or in a resumed run)")
def fp8_stats_schedule_misses_the_run(config: Mapping[str, Any],
                                      ctx: LintContext) -> Iterator[Hit]:
    stats = section(section(config, "callbacks"), "fp8_stats")
    built = built_options("fp8_stats", stats) if "fp8_stats" in section(config, "callbacks") \
        else None
    duration = config.get("max_duration")
    batches = batch_count(duration) if isinstance(duration, str) else None
    if not isinstance(built, FP8StatsOptions) or batches is None or not batches >= 1 \
            or not float(batches).is_integer():
        return
    schedule, last = built.schedule, int(batches) - 1
    path = type(built).PATH
    missed = sorted(step for step in schedule.dump_steps if step > last)  # type: ignore[union-attr]
    if missed:
        yield Hit(f"{path}.dump_steps", f"fp8_stats' dump_steps {missed} come at or after "
                  f"max_duration {duration!r}: the run's last batch starts at batch count "
                  f"{last}, so {'they save' if len(missed) > 1 else 'it saves'} nothing",
                  fix=f"dump steps from 0 to {last}")
    first = schedule.next_log(-1)
    later = schedule.next_log(0)
    if first != 0 or (later is not None and later <= last):
        resumed = None  # a first logging step after 0 is one a resumed run may reach
    elif config.get("load_path") and not config.get("load_weights_only"):
        resumed = "load_path"
    else:
        resumed = "autoresume" if config.get("autoresume") is True else None
    # delayed scaling casts a fresh run's step 0 at its initial scale 1: it judges nothing
    # (the run says so at FIT_START, foundry_fp8.composer.stats `_judged_from`)
    step0_only = first == 0 and resumed != "load_path" \
        and _step0_scaling(config, built) == "delayed"
    judged = later if step0_only or resumed else first
    if judged is not None and judged <= last:
        return
    key = "end" if judged is None and "end" in stats else \
        "start" if "start" in stats and schedule.start > last else "interval"
    relaunch = "; a relaunch that autoresumes starts at its checkpoint's batch count, after " \
        "step 0, and logs no FP8 statistics"
    what = ("no batch but step 0", "a run resumed from load_path starts at its checkpoint's "
            "batch count, after step 0 (Composer restores the timestamp): no FP8 statistics "
            "at all") if resumed == "load_path" else \
        ("no other batch", "only step 0, which delayed scaling casts with its initial scale 1: "
         "no layer is judged" + (relaunch if resumed else "")) if step0_only else \
        ("no other batch", "it logs step 0 alone" + relaunch) if resumed else \
        ("no batch", "no FP8 statistics at all")
    yield Hit(f"{path}.{key}", f"fp8_stats logs at {what[0]} of this run (interval "
              f"{schedule.interval}, start {schedule.start}, end {schedule.end}; max_duration "
              f"{duration!r}: batches 0 to {last}): {what[1]}")


def _step0_scaling(config: Mapping[str, Any], stats: FP8StatsOptions) -> str | None:
    """The scaling fp8_stats judges step 0 under (`foundry_fp8.recipe.step0_scaling`), read from
    the YAML: te_swap's recipe, Composer's under amp_fp8 (LLM-Foundry passes no
    precision_config), else fp8_stats' what-if; None where te_swap refuses its options (the run
    stops at te_swap's own error)."""
    if "te_swap" not in section(config, "algorithms"):
        swap = None
    elif (options := te_swap_options(config)) is None:
        return None
    else:
        swap = options.fp8_recipe
    run = run_fp8_recipe(swap, config.get("precision"), None)  # type: ignore[arg-type]
    return step0_scaling(run, stats.monitor.recipe)  # type: ignore[arg-type]


@rule("FP8059", "warning", "te_swap options that change nothing: `fuse_ln_mlp` or "
      "`convert_layernorm` under `backend: emulate`, `keep_lm_head: false` for an MPT whose LM "
      "head is tied to its embedding (MPT's default)",
      why="The emulated backend converts linear layers only: with it, te_swap keeps every "
      "norm and MLP these options name and lists them in its coverage table as needing backend "
      "te; the same layers train as without the option. A tied LM head is the embedding's "
      "weight (F.linear on wte.weight), no module: te_swap keeps it whatever keep_lm_head says. "
      "The tie is judged for MPT models (`tie_word_embeddings`, default true) only.",
      source="foundry_fp8/filters.py backend_reason, layernorm_reason, fuse_reason, "
      "linear_reason; foundry_fp8/swap.py plan_swap (the tied head's row); "
      f"{FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py MPTForCausalLM.__init__ (no lm_head "
      "when tied)",
      fix="see the message")
def te_swap_option_changes_nothing(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap_options(config)
    if swap is None:
        return
    given = section(section(config, "algorithms"), "te_swap")
    for option in ("fuse_ln_mlp", "convert_layernorm"):
        if swap.backend == "emulate" and getattr(swap, option):
            yield Hit(f"{swap.PATH}.{option}", f"te_swap's {option} with backend emulate: the "
                      "emulated backend converts linear layers only, so te_swap keeps those "
                      "layers as they are (its coverage table: 'needs backend te')",
                      fix=f"backend te (precision amp_fp8, a GPU with TransformerEngine), or drop "
                      f"{option}")
    modules = mpt_modules(section(config, "model")) if "keep_lm_head" in given \
        and not swap.keep_lm_head else None
    if modules and not any(m.name == MPT_LM_HEAD for m in modules):
        yield Hit(f"{swap.PATH}.keep_lm_head", "te_swap's keep_lm_head: false, but this MPT ties "
                  "its LM head to the embedding (tie_word_embeddings, default true): no module "
                  "to convert, the head stays in high precision",
                  fix="model.tie_word_embeddings: false for an LM head of its own (one more "
                  "vocab x d_model weight), or drop keep_lm_head")


@rule("FP8023", "error", "option values of our entries that their constructors refuse "
      "(negative counts, thresholds out of range, fp8_stats' `end` not after its `start`, "
      "regexes that do not compile, unknown choices such as `fail_on: warning`, unknown "
      "`{placeholders}` in paths)",
      why="LLM-Foundry builds algorithms, callbacks and loggers before training, so a value of "
      "the right type that the constructor refuses still stops the run. Each option's check is "
      "declared once, on its field of a frozen options dataclass (foundry_fp8/options.py), "
      "which every constructor builds first, so the linter and the run agree; every wrong item "
      "of a list is reported at its own key.",
      source="foundry_fp8/options.py (TESwapOptions, SwapConfig, FP8StatsOptions, Schedule, "
      "MonitorConfig, FP8StateOptions, FP8LintOptions, JSONLOptions); "
      f"{COMPOSER} composer/core/time.py Time.from_timestring (batch intervals read alike)",
      fix="see the message", also=("eval",))
def entry_option_values(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _option_hits(config, ("value",))


def _yaml_run_folder(config: Mapping[str, Any]) -> tuple[PurePath, str]:
    """The run folder `paths.run_folder` finds for this YAML, and the run name it is filled
    with: the YAML's `run_name`, else `<run_name>` (Composer's generated or RUN_NAME's name,
    filled alike into `save_folder` and our paths)."""
    name = config.get("run_name")
    name = name if isinstance(name, str) and name else "<run_name>"
    save_folder = config.get("save_folder")
    filled = save_folder.replace("{run_name}", safe_run_name(name)) \
        if isinstance(save_folder, str) else None
    return run_folder(filled, name), name


@rule("FP8052", "warning", "a relative `loggers.jsonl.path` or fp8_stats `dump_folder` that "
      "begins with the run folder's last parts (`path: runs/{run_name}/metrics.jsonl`, the old "
      "default, with the default run folder `runs/<run_name>`)",
      why="A relative path is taken inside the run folder (the parent of a local save_folder, "
      "else runs/<run_name>); before, it was taken in the working directory, and such a path "
      "named a file inside the run folder. Taken inside it, it would double the folder "
      "(runs/X/runs/X/metrics.jsonl), and a run upgraded mid-way would leave its metrics in "
      "two files, each read as the whole run. The run takes it the old way and warns "
      "(foundry_fp8/paths.py repeated_run_folder, whatever the working directory, so lint, "
      "the run and `foundry-fp8 report` agree; say_repeated, once per run, by the jsonl logger "
      "at INIT and by fp8_stats at FIT_START wherever `dump_folder` is set, dumps or none; "
      "fp8_lint in the run counts the finding without printing it): no run is refused for a YAML that worked, and its files stay in one "
      "place.",
      source=f"foundry_fp8/paths.py run_folder, repeated_run_folder, say_repeated; "
      "foundry_fp8/composer/jsonl_logger.py init, composer/stats.py _fit_start, composer/lint.py "
      f"SAID_BY_THE_RUN; {COMPOSER} "
      "composer/trainer/trainer.py (run_name: COMPOSER_RUN_NAME, RUN_NAME, else generated)",
      fix="the path inside the run folder (`path: metrics.jsonl`)")
def repeated_run_folders(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    folder, name = _yaml_run_folder(config)
    written = section(section(config, "loggers"), "jsonl")
    jsonl = built_options("jsonl", written) if "jsonl" in section(config, "loggers") else None
    base = folder
    if jsonl is not None and not path_problem(jsonl.path, file=True):
        key = "loggers.jsonl.path"
        repeated = repeated_run_folder(jsonl.path, folder, name, key)
        if repeated is not None and "path" in written:
            yield Hit(key, repeated[1], fix=repeated[2])
        filled = PurePath(jsonl.path.format_map({"run_name": safe_run_name(name)}))
        base = (folder / repeated[0] if repeated else folder / filled).parent
    stats = section(section(config, "callbacks"), "fp8_stats")
    template = stats.get("dump_folder")
    if isinstance(template, str) and built_options("fp8_stats", stats) is not None \
            and not path_problem(template):
        key = "callbacks.fp8_stats.dump_folder"
        repeated = repeated_run_folder(template, base, name, key)
        if repeated is not None:
            yield Hit(key, repeated[1], fix=repeated[2])


@rule("FP8033", "error", "an entry of ours without the entry it acts through (`fp8_guard` "
      "without `fp8_stats`)",
      why="fp8_guard acts on the statistics fp8_stats computes, and refuses the run at FIT_START "
      "(after the model is built and converted) when callbacks has no fp8_stats. Which entry "
      "needs which is declared once, on the entry (foundry_fp8/options.py ENTRIES, "
      "Entry.needs), which the callback's own check reads too.",
      source="foundry_fp8/options.py Entry.needs, Entry.need_problem; "
      "foundry_fp8/composer/guard.py FP8Guard.fit_start",
      fix="see the message")
def entry_needs(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, entry, _ in _entry_items(config):
        for problem in entry.spec.missing(section(config, entry.section)):
            yield Hit(key, f"{entry.name} {problem.detail}: it refuses the run when training "
                      "starts, after the model is built", fix=problem.fix)


def registered_names(section_name: str) -> frozenset[str]:
    """The names LLM-Foundry's registry for a section holds: its built-ins, and every entry
    point of the matching groups (ours and other plugins'), read from package metadata
    without importing anything."""
    names = set(FOUNDRY_REGISTRY[section_name])
    names |= {name for (where, name) in our_entries() if where == section_name}
    for group in REGISTRY_GROUPS[section_name]:
        names |= entry_point_names(group)
    return frozenset(names)


@rule("FP8026", "error", "an entry LLM-Foundry's registries do not hold under that section "
      "(our `te_swap` under `callbacks:`, a misspelled `fp8_stat:`) (did-you-mean)",
      why="LLM-Foundry builds `callbacks:`, `algorithms:` and `loggers:` entries by name from "
      "separate registries (construct_from_registry) and raises for a name its registry does "
      "not hold. The names are LLM-Foundry's built-ins and the entry points installed packages "
      "register (ours too), read from package metadata. Files only: in a run, LLM-Foundry's "
      "registry (which tests and scripts can fill at runtime) has already answered.",
      source=f"{FOUNDRY} llmfoundry/registry.py, llmfoundry/utils/builders.py build_callback, "
      "build_algorithm, build_logger, llmfoundry/utils/registry_utils.py "
      "construct_from_registry; setup.cfg [options.entry_points]",
      fix="move the entry to the section the message names, or fix the spelling",
      scope="file", also=("eval",), unresolved=True)
def unknown_entries(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for section_name in REGISTRY_GROUPS:
        for name in section(config, section_name):
            if not isinstance(name, str) or name in registered_names(section_name):
                continue
            home = next((s for s in REGISTRY_GROUPS if name in registered_names(s)), None)
            if home:
                kind = section_name[:-1]  # callback, algorithm, logger
                article = "an" if kind[0] in "aeiou" else "a"
                yield Hit(join_key(section_name, name), f"`{name}` is not {article} {kind}: "
                          f"LLM-Foundry's {section_name} registry does not hold it, its "
                          f"{home} registry does", fix=f"move it to `{home}:`")
            else:
                yield Hit(join_key(section_name, name), f"LLM-Foundry has no {section_name[:-1]} "
                          f"named `{name}`" + did_you_mean(name, registered_names(section_name)))


#: Keys with which a run saves checkpoints it resumes from (a CheckpointSaver for save_folder;
#: autoresume reloads the latest of them).
RESUME_KEYS = ("save_folder", "autoresume")


#: The TE releases that refuse their own pickled delayed-scaling `_extra_state`, as messages say.
GUARDED_TE = (f"{', '.join(map(dotted, TE_PICKLE_GUARD_FIXES))} and >= "
              f"{dotted(TE_PICKLE_GUARD_FROM)}")


def _native_te_key(config: Mapping[str, Any]) -> str:
    """The model key that makes the model build TE layers itself."""
    model = section(config, "model")
    return "model.fc_type" if fc_type_name(model) == "te" else "model.ffn_config.ffn_type"


def _delayed(config: Mapping[str, Any]) -> bool:
    """Whether TE layers run delayed scaling: Composer's amp_fp8 recipe, unless te_swap sets
    another."""
    swap = te_swap_options(config)
    recipe = swap.fp8_recipe if isinstance(swap, TESwapOptions) else None
    return not isinstance(recipe, FP8Recipe) or recipe.scaling == "delayed"


@rule("FP8027", "warning", "FP8 layers without fp8_state in a run that saves, resumes or "
      "loads checkpoints (te_swap: FP8 scales reset at every resume, a loaded checkpoint's are "
      "not restored; `fc_type: te` on a TE that refuses its own pickled state: the resume fails)",
      why="te_swap's emulated layers keep their FP8 scales and amax histories in tensors that "
      "are not in Composer's checkpoint, and te_swap leaves its TE layers' `_extra_state` out "
      "of it (a pickled state that a model without te_swap has no key for, and that TE "
      f"{GUARDED_TE} refuse to load unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1; so older "
      "TE, which would load it, resumes fresh too); fp8_state saves and restores them. te_swap "
      "logs the same warning at INIT when the run has a checkpoint saver and no fp8_state. "
      "The model's own TE layers (`fc_type: te`, `ffn_type: te_ln_mlp`) under amp_fp8's "
      f"delayed scaling save TE's pickled `_extra_state`, which TE {GUARDED_TE} refuse at load: "
      "with such a TE installed a resume fails (a warning; info where the linter finds no TE; "
      "nothing on older TE, which loads it). fp8_state stores a pickled `None` there and keeps "
      "the state itself. A run that only loads another's checkpoint (`load_path`, no "
      "`save_folder`) resumes nothing of its own: without fp8_state it drops the FP8 state "
      "that checkpoint's fp8_state entry holds (Composer restores a callback entry only into "
      "that callback), so te_swap's layers start fresh; with `load_weights_only` no run "
      "restores it, fp8_state or not, so that alone is not said. Such a run with the model's "
      "own TE layers and no fp8_state is warned too (`load_weights_only` included: the model's "
      "weights hold `_extra_state`): a checkpoint saved without fp8_state holds TE's pickled "
      f"state, which TE {GUARDED_TE} refuse to load; with fp8_state the run's team saved "
      "inert state, so it is not said.",
      source="foundry_fp8/composer/state.py FP8State; foundry_fp8/composer/te_swap.py (its INIT "
      "warning, issue 19 item 5); TE transformer_engine/pytorch/_extra_state.py "
      f"should_load_extra_state_pickle (TE {GUARDED_TE}: foundry_fp8/te/facts.py "
      "refuses_pickled_extra_state); "
      f"{FOUNDRY} llmfoundry/command_utils/train.py (save_folder, load_path, autoresume, "
      f"load_weights_only); {COMPOSER} composer/core/state.py State.load_state_dict (callback "
      "entries restored only into the run's own callbacks); foundry_fp8/composer/state.py "
      "_report_loaded_entries (a weights-only load starts fresh)",
      fix="add `callbacks: {fp8_state: {}}`")
def fp8_layers_without_fp8_state(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    resumes = [k for k in RESUME_KEYS if config.get(k)]
    load_path = bool(config.get("load_path"))
    loads = load_path and not config.get("load_weights_only")
    if has_fp8_state(config) or not (resumes or load_path):
        return
    if te_swap(config) is not None and (resumes or loads):
        lost = "the FP8 scales and amax histories of the checkpoint load_path names are not " \
            "restored (Composer restores them only into fp8_state)"
        if not resumes:
            said = f"load_path is set): {lost} and start fresh"
        elif loads:
            said = f"{resumes[0]} and load_path are set): {lost}, and a resume from this " \
                "run's checkpoints starts them fresh again (they are not in the checkpoint)"
        else:
            said = f"{resumes[0]} is set): a resume from this run's checkpoints starts FP8 " \
                "scales and amax histories fresh (they are not in the checkpoint)"
        yield Hit("algorithms.te_swap", f"te_swap without fp8_state ({said}")
    if not (is_fp8(config) and native_te_layers(config) and _delayed(config)):
        return
    te = ctx.snapshot.te_version if ctx.snapshot is not None else None
    # a run that only loads: its TE layers refuse, at load, another run's pickled state
    # (TE pytorch/_extra_state.py should_load_extra_state_pickle raises RuntimeError 'Refusing
    # to load pickled Transformer Engine extra state'), whatever load_weights_only says
    said, fails, fix = (resumes[0], "a resume from this run's checkpoints", None) if resumes \
        else ("load_path", "loading a checkpoint that such a run saved (TE layers, delayed "
              "scaling, no fp8_state)",
              "load a checkpoint saved with fp8_state, or, for one you trust, set "
              "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 on the training machine")
    if te is None:
        yield Hit(_native_te_key(config), f"TE layers without fp8_state ({said} is set): "
                  f"TransformerEngine {GUARDED_TE} refuse to load the pickled FP8 state they "
                  f"save, so {fails} would fail there (no TE where the linter runs to tell)",
                  severity="info", fix=fix)
    elif refuses_pickled_extra_state(te):
        yield Hit(_native_te_key(config), f"TE layers without fp8_state ({said} is set): "
                  f"TransformerEngine {ctx.snapshot.te} refuses to load the pickled FP8 state "
                  f"(`_extra_state`) they save, so {fails} fails unless "
                  "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (which unpickles whatever the "
                  "checkpoint holds)", fix=fix)



def _load_fails_without_extra_state(config: Mapping[str, Any], ctx: LintContext) -> str | None:
    """How Composer's load of `load_path` fails when the checkpoint lacks the TE modules'
    `_extra_state` keys, as this config loads it; None where it loads (the keys skipped)."""
    fsdp_config = config.get("fsdp_config")
    monolith = False
    if isinstance(fsdp_config, Mapping) and ctx.gpus != 1:  # one GPU: LLM-Foundry drops it
        kind = fsdp_config.get("state_dict_type", STATE_DICT_DEFAULT.get(ctx.fsdp_version))
        if kind == "sharded":
            return "under fsdp_config state_dict_type: sharded DCP raises 'Missing key in " \
                "checkpoint state_dict: state.model.<module>._extra_state'"
        if kind != "full":
            return None
        # Composer's State.load_monolith_rank0_only (LLM-Foundry defaults it on for init_device
        # mixed): rank 0 loads the checkpoint into the model before FSDP wraps it
        monolith = bool(fsdp_config.get("load_monolith_rank0_only", section(
            config, "model").get("init_device") == "mixed")
            and (ctx.fsdp_version == 2 or fsdp_config.get("auto_wrap", True)))
        if not monolith:
            return "under fsdp_config state_dict_type: full torch hands each TE module a " \
                "placeholder for the missing key, which TE refuses ('Unsupported checkpoint " \
                "format.'), strict or not"
    if config.get("load_weights_only") and config.get("load_strict_model_weights", True):
        where = "loaded on rank 0 before FSDP wraps the model (load_monolith_rank0_only)" \
            if monolith else "without FSDP"
        return f"{where}, a strict weights-only load (load_weights_only with " \
            "load_strict_model_weights true, LLM-Foundry's default) stops on the missing keys"
    return None


@rule("FP8054", "warning", "`load_path` into the model's own TE layers (`fc_type: te`, "
      "`ffn_type: te_ln_mlp`) without fp8_state, in a run whose load fails at Trainer init on "
      "a checkpoint without TE's `_extra_state` (a bf16 run's torch layers, te_swap's)",
      why="The model's own TE modules have an `_extra_state` key each (at any precision); a "
      "checkpoint saved by a model without them (torch layers, as in a bf16 run, or te_swap's "
      "TE modules, which leave the key out) has none. Composer 0.32.1 loads the model through "
      "torch's set_model_state_dict: under FSDP with state_dict_type full (FSDP1's default) "
      "torch gives each such module its `_EXTRA_STATE()` placeholder, which TE's "
      "set_extra_state refuses ('Unsupported checkpoint format.'), whatever "
      "load_strict_model_weights says; under state_dict_type sharded (FSDP2's default) DCP "
      "loads into a template that holds the keys and raises 'Missing key in checkpoint "
      "state_dict: state.model.<module>._extra_state'; without FSDP (or with "
      "load_monolith_rank0_only, which loads on rank 0 before wrapping) a weights-only load "
      "with load_strict_model_weights (LLM-Foundry's default: true) stops on the missing "
      "keys, while a non-strict or full-state load skips them. fp8_state prevents all three "
      "(a load pre-hook gives such modules TE's inert state, and the sharded load's template "
      "leaves out the keys the checkpoint lacks). The YAML does not say whether the "
      "checkpoint has the keys (one saved by this same model does), so a warning; "
      "`autoresume` alone resumes the run's own checkpoints, which have them, and is not "
      "said. One GPU (`compute.gpus: 1`, `--gpus 1`) is judged without FSDP, as LLM-Foundry "
      "drops fsdp_config there.",
      source=f"{COMPOSER} composer/core/state.py:1306 load_model_state "
      "(set_model_state_dict, full_state_dict=state_dict_type full), :904 "
      "fsdp_state_dict_type, :916 load_monolith_rank0_only; composer/utils/checkpoint.py:602 "
      "load_sharded_checkpoint (the DCP template), :949 _restore_checkpoint (strict only for "
      "load_weights_only); torch 2.7 torch/distributed/checkpoint/state_dict.py:229 _EXTRA_STATE; "
      "TE 2.20.2 transformer_engine/pytorch/module/base.py:1443 set_extra_state; "
      f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig (load_weights_only False, "
      "load_strict_model_weights True), process_init_device (init_device mixed: "
      "load_monolith_rank0_only); foundry_fp8/composer/state.py, "
      "foundry_fp8/te/extra_state.py inert_when_missing_hook",
      fix="add `callbacks: {fp8_state: {}}`")
def native_te_load_without_fp8_state(config: Mapping[str, Any],
                                     ctx: LintContext) -> Iterator[Hit]:
    if not config.get("load_path") or not native_te_layers(config) or has_fp8_state(config):
        return
    fails = _load_fails_without_extra_state(config, ctx)
    if fails is not None:
        yield Hit("load_path", f"load_path into the model's TE layers ({_native_te_key(config)}) "
                  "without fp8_state: if the checkpoint has no TE `_extra_state` (a bf16 run's "
                  f"torch layers, te_swap's), the load fails at Trainer init: {fails}")


@rule("FP8028", "error", "`precision: amp_fp8` with te_swap's emulated backend and no TE layer",
      why="Emulated FP8 layers run FP8 numerics at any precision; amp_fp8 only enters TE's "
      "autocast, which Composer refuses without TE or a GPU of compute capability "
      f"{dotted(MIN_FP8_CAPABILITY)}+ (and Composer refuses every precision but fp32 on CPU "
      "when the Trainer is built). The emulated backend names a machine without FP8 hardware, "
      "so the linter (`foundry-fp8 lint`, which does not probe the GPU and may run elsewhere) "
      "reports an error saying both outcomes; `fp8_lint`, on the training machine, reports a "
      "warning when that machine has TE and such a GPU (amp_fp8 then does nothing for emulated "
      "layers).",
      source=f"{COMPOSER} composer/core/precision.py _validate_precision, "
      "get_precision_context; foundry_fp8/swap.py would_run_fp8",
      fix="precision: amp_bf16 on a GPU (fp32 on CPU), keeping te_swap: {backend: emulate}")
def amp_fp8_with_emulation(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    if not (is_fp8(config) and swap is not None and swap.get("backend") == "emulate"
            and not native_te_layers(config)):
        return
    snapshot = ctx.snapshot
    if ctx.scope == "file" or snapshot is None:  # not the training machine's GPU
        yield Hit("precision", "precision amp_fp8 with te_swap's emulated backend: Composer "
                  "raises on a machine without TransformerEngine and an FP8 GPU (the machine "
                  "that backend is for; on CPU it refuses any precision but fp32), and on one "
                  "with them amp_fp8 does nothing for emulated layers")
        return
    capable = snapshot.te is not None and snapshot.capability is not None \
        and tuple(snapshot.capability) >= MIN_FP8_CAPABILITY
    yield Hit("precision", "precision amp_fp8 with te_swap's emulated backend: "
              + ("this machine has TransformerEngine and an FP8 GPU, but amp_fp8 does nothing "
                 "for emulated layers" if capable else "this machine lacks TransformerEngine "
                 "or an FP8 GPU, so Composer raises (on CPU it refuses any precision but fp32), "
                 "and emulated layers do not need amp_fp8"),
              severity="warning" if capable else None)


@rule("FP8041", "error", "`model.attn_config.attn_impl: sdpa` in a config with none of our "
      "entries (nothing imports foundry_fp8.attention before LLM-Foundry builds the model)",
      why="MPTConfig accepts attn_impl torch and flash only, and raises 'Unknown "
      "attn_impl=sdpa' unless foundry_fp8.attention was imported before the model is built. "
      "LLM-Foundry's train() builds loggers, callbacks and algorithms by name before the model, "
      "and building any of ours imports foundry_fp8.composer, which imports "
      "foundry_fp8.attention; our `sdpa` attention entry point alone loads only after MPTConfig "
      "has refused it. A warning when the config has `code_paths`, whose files LLM-Foundry "
      "imports first and may import foundry_fp8.attention (the linter does not read them).",
      source=f"{FOUNDRY} llmfoundry/models/mpt/configuration_mpt.py _validate_config, "
      "llmfoundry/command_utils/train.py train (code_paths, then build_logger, build_callback, "
      "build_algorithm before build_composer_model); foundry_fp8/composer/__init__.py, "
      "foundry_fp8/attention.py enable_sdpa_for_mpt; setup.cfg [options.entry_points]",
      fix="add one of our entries, such as `callbacks: {fp8_lint: {}}`, or import "
      "foundry_fp8.attention from a `code_paths` file; or use attn_impl flash or torch")
def sdpa_without_our_entries(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    name = model.get("name")
    if not (isinstance(name, str) and name in MPT_MODEL_NAMES
            and get(model, "attn_config.attn_impl") == SDPA) \
            or next(_entry_items(config), None) is not None:
        return
    code_paths = config.get("code_paths")
    yield Hit("model.attn_config.attn_impl", "attn_impl sdpa needs foundry_fp8.attention "
              "imported before LLM-Foundry builds the model, which building one of our entries "
              "does, and this config has none: MPTConfig raises 'Unknown attn_impl=sdpa'"
              + (" (unless a code_paths file imports foundry_fp8.attention)" if code_paths
                 else ""), severity="warning" if code_paths else None)


@rule("FP8050", "error", "`compile_config: {fullgraph: true}` with FP8 layers (te_swap, any "
      "backend, or the model's own TE layers), whose forwards torch.compile cannot trace",
      why="LLM-Foundry's train passes `compile_config` to Composer's Trainer, which compiles "
      "the model with `torch.compile(model, **compile_config)` after INIT and AFTER_LOAD. The "
      "FP8 layers' forwards are excluded from Dynamo: te.LayerNormLinear's and "
      "te.LayerNormMLP's by TransformerEngine's `no_torch_dynamo` (still so in TE 2.20.2), "
      "whatever the precision, and te_swap's emulated layers by `torch.compiler.disable`. "
      "With fullgraph Dynamo may not break the graph around them, and stops the first batch "
      "with `Unsupported: Skip calling torch.compiler.disable()d function`; te_swap refuses "
      "the run in one line at FIT_START instead. Without fullgraph the model between the FP8 "
      "layers still compiles. te.Linear's forward (fc_type te, te_swap's te backend) carries "
      "`no_torch_dynamo` up to TE 2.18 and in main at d0067d0 (2.20.0.dev0); TE 2.20.2 "
      "removed it: while compiling, te.Linear runs a registered custom op, and breaks the "
      "graph (which fullgraph refuses) only where `_compile_eager_fallback_reason` names a "
      "reason, its eager path `_linear_eager` keeping `no_torch_dynamo`. That fullgraph fails "
      "for te.Linear on TE >= 2.20 is unverified (tests/test_te220_compile_gpu.py decides on "
      "a GPU); the rule keeps its verdict until then.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig.compile_config, "
      "llmfoundry/command_utils/train.py (compile_config to Trainer); "
      f"{COMPOSER} composer/trainer/trainer.py:1765 (`torch.compile(self.state.model, "
      "**compile_config)`, after Event.AFTER_LOAD); torch 2.7 torch/__init__.py:2574 "
      "(`nopython=fullgraph`); TE transformer_engine/pytorch/module/linear.py:1872, "
      "layernorm_linear.py:1674, layernorm_mlp.py:2264 at d0067d0 (`@no_torch_dynamo()` on "
      "forward); TE 2.20.2 transformer_engine/pytorch/module/linear.py:1798 (`_linear_op`, "
      "the custom op), :1894 (`@no_torch_dynamo()` on `_linear_eager`), :2346 (forward, "
      "without it), :2396-2404 (the compiled path and its graph break), :2640 "
      "(`_compile_eager_fallback_reason`), layernorm_linear.py:1674, layernorm_mlp.py:2272 "
      "(`@no_torch_dynamo()` on forward); foundry_fp8/emulate.py (`torch.compiler.disable`); "
      "foundry_fp8/composer/te_swap.py _refuse_fullgraph",
      fix="drop compile_config.fullgraph (the FP8 layers run outside the compiled graph)")
def fullgraph_with_fp8_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    # torch.compile reads fullgraph by truth (`nopython=fullgraph`), as this does
    if not get(config, "compile_config.fullgraph"):
        return
    if te_swap(config) is not None:
        layers = "te_swap's FP8 layers run their forwards outside torch.compile " \
            "(TransformerEngine's `no_torch_dynamo`, the emulation's `torch.compiler.disable`): " \
            "te_swap refuses the run at FIT_START"
    elif native_te_layers(config):
        layers = f"the model's TE layers ({_native_te_key(config)}) run their forwards " \
            "outside torch.compile (TransformerEngine's `no_torch_dynamo`): Dynamo stops the " \
            "first batch with `Unsupported: Skip calling torch.compiler.disable()d function`"
    else:
        return
    yield Hit("compile_config.fullgraph", "compile_config fullgraph: true cannot compile the "
              f"model in one graph: {layers}")
