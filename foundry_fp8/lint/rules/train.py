"""The train config's own keys and sections: precision, retired and unknown top-level keys,
section shapes, `${oc.env:...}`, micro-batch tokens, text loaders, omegaconf's `???`, and
autoresume with an offline W&B logger, a W&B `dir` placeholder nothing fills, an asynchronous
MLflow logger to a local file store."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from foundry_fp8.lint.config import (
    as_int,
    as_number,
    get,
    has_fp8_layers,
    is_fp8,
    native_te_layers,
    precision,
    te_swap,
)
from foundry_fp8.lint.known import (
    EVAL_CONFIG_KEYS,
    EVAL_LOADER_LABEL,
    EVAL_MODEL_KEYS,
    FILLED_KEYS,
    FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO,
    FOUNDRY_PAD_TRIM_MULTIPLE,
    FP8_RECIPE_FIX,
    LOADER_BUILDER_KEYS,
    LOADER_BUILDERS,
    MAPPING,
    MAPPINGS,
    MPT_MODEL_NAMES,
    MPT_NUMBER_KEYS,
    NULL,
    PRECISIONS,
    SCALARS,
    SECTION_SHAPES,
    STRING,
    STRINGS,
    TEXT_LOADER_DEFAULTS,
    TRAIN_CONFIG_KEYS,
    TRAIN_REQUIRED_KEYS,
    TRAIN_SCALAR_TYPES,
    belongs_under,
    did_you_mean,
    move_fix,
    omegaconf_takes,
)
from foundry_fp8.lint.registry import (
    MISSING,
    Hit,
    LintContext,
    join_key,
    mandatory_keys,
    rule,
    section,
)
from foundry_fp8.mlflow_facts import (
    RACE,
    THREADPOOL_ENV,
    WORKAROUNDS,
    composer_tracking_uri,
    file_store,
    races,
)
from foundry_fp8.shapes import FP8_DIM_MULTIPLE, FP8_TOKEN_MULTIPLE, dim_fits_fp8, tokens_fit_fp8
from foundry_fp8.te.facts import TE_GEMM_LEADING_DIM_ERROR, TE_GEMM_LEADING_DIM_FROM, dotted

COMPOSER = "Composer 0.32.1"
FOUNDRY = "LLM-Foundry 0.22.0"
TE28 = "TE 2.8"


@rule("FP8001", "error", "`precision: amp_fp8` with nothing that would run in FP8",
      why="Composer's amp_fp8 only enters TE's fp8_autocast, which changes TE modules alone; "
      "with no TE layer the run trains without FP8 behind one warning. Not reported where "
      "FP8028 applies (te_swap's emulated backend, which runs FP8 numerics at any precision).",
      source=f"{COMPOSER} composer/core/precision.py get_precision_context; {FOUNDRY} "
      "llmfoundry/command_utils/train.py validate_config ('fp8 only supported for te.Linear "
      "layers'); foundry_fp8/swap.py would_run_fp8",
      fix="add `algorithms: {te_swap: {}}` or `model.fc_type: te`")
def fp8_without_fp8_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not is_fp8(config) or has_fp8_layers(config):
        return
    # model keys asking for TE layers written at the top level, where MPT never reads them
    stray = [f"`{k}`" for k in config if isinstance(k, str) and k not in TRAIN_CONFIG_KEYS
             and native_te_layers({"model": {k: config[k]}})]
    if stray:
        yield Hit("precision", f"precision amp_fp8, but no layer would run in FP8: the top-level "
                  f"{', '.join(stray)} asking for TE layers is not read (MPT reads it under "
                  "`model:`), and there is no te_swap algorithm",
                  fix=f"move {', '.join(stray)} under `model:`")
    else:
        yield Hit("precision", "precision amp_fp8, but no layer would run in FP8 (no fc_type: "
                  "te, no ffn_type: te_ln_mlp, no te_swap algorithm)")


def train_seq_len(config: Mapping[str, Any]) -> tuple[str, int | None]:
    """(key, value) of the length the train loader cuts samples to: its dataset's
    `max_seq_len` (what LLM-Foundry's text and finetuning loaders read), else the top-level
    one (which train() itself reads only for ICL evaluation); value None when not an int."""
    dataset = section(section(config, "train_loader"), "dataset")
    key = "train_loader.dataset.max_seq_len" if "max_seq_len" in dataset else "max_seq_len"
    return key, as_int(get(config, key))


#: Where TE's GEMM checks an FP8 operand's leading dim (the inner dim of a TN GEMM) for 16.
TE_GEMM_LEADING_DIM = (
    f"TE v{dotted(TE_GEMM_LEADING_DIM_FROM)} transformer_engine/common/gemm/cublaslt_gemm.cu:"
    "146-148 and :227-229 "
    "CanonicalizeGemmInput (v2.18: :160-162, :251-253; "
    "https://github.com/NVIDIA/TransformerEngine/pull/2261)")
#: Where TE asks the token count for a multiple of 16, not of 8 (FP8006's warning).
TE_TOKENS_BY_16 = (
    "TE 2.8 tests/pytorch/test_sanity.py:72-80 is_fp8_supported (v2.18: :69-77); "
    f"{TE_GEMM_LEADING_DIM}, transformer_engine/pytorch/module/linear.py (the wgrad GEMM's "
    f"layout NT, v2.18:1196); {COMPOSER} composer/trainer/trainer.py:2599 and :3438")


@rule("FP8006", "error", f"tokens per micro-batch not divisible by {FP8_TOKEN_MULTIPLE} (a "
      f"warning: by {FP8_DIM_MULTIPLE}) with TE layers in FP8",
      why="A GEMM input is (micro-batch x sequence length, features): TE asserts the leading "
      f"dims' product is divisible by {FP8_TOKEN_MULTIPLE} (an error). A multiple of "
      f"{FP8_TOKEN_MULTIPLE} that is not one of {FP8_DIM_MULTIPLE} passes that assert, but TE's "
      "own tests treat FP8 as supported only when batch x seqlen is divisible by "
      f"{FP8_DIM_MULTIPLE}, Composer's Trainer says 'FP8 in TE requires all eval data sizes to "
      f"be divisible by {FP8_DIM_MULTIPLE}', and the token count is the inner dim of the "
      "weight-gradient GEMM, whose FP8 operands' leading dim TE's GEMM checks from "
      f"v{dotted(TE_GEMM_LEADING_DIM_FROM)} ('{TE_GEMM_LEADING_DIM_ERROR}', citing cuBLAS's "
      "tensor-core "
      "requirements; on Hopper, whose FP8 GEMMs are TN only, that leading dim is the inner "
      "one): a warning, since that backward failure is read in TE's sources and has "
      "not been run on a GPU. The sequence length is the train loader's `dataset.max_seq_len`; "
      "the top-level `max_seq_len` only where the loader gives none. The finetuning loader's "
      "`pad_to_longest` pads each batch only to its longest example, any length up to that "
      "max_seq_len, so only a micro-batch size that is a multiple of "
      f"{FP8_TOKEN_MULTIPLE} passes TE's assert on every batch (an error otherwise); its "
      "`allow_pad_trimming` cuts every batch after the first to its longest example rounded up "
      f"to a multiple of {FOUNDRY_PAD_TRIM_MULTIPLE}, which an odd micro-batch size then leaves "
      f"off a multiple of {FP8_DIM_MULTIPLE} on some batches (a warning). A `packing_ratio` "
      "other than 1 packs examples into bins padded back to max_seq_len (BinPackCollator): no "
      "shorter batches; `packing_ratio: auto` picks a ratio by profiling the data, 1 (no "
      f"packing) for a max_seq_len up to {FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO} and possibly "
      "above it, so there these findings are at most a warning. With "
      "`device_train_microbatch_size: auto` Composer starts at the device batch size and halves "
      "it at each CUDA out-of-memory down to 1, so the findings are judged at 1, as warnings "
      "(the run meets that size only after out-of-memory errors). Where the GPU count is "
      "known (`--gpus`, an MCLI run config's `compute.gpus`; in a run, the "
      "device_train_batch_size LLM-Foundry wrote) the micro-batches judged are those TE gets: "
      "a micro-batch size above the sequences per GPU is cut to them, and one that does not "
      "divide them leaves a last, smaller micro-batch (Composer's split_batch); under `auto` "
      "the first micro-batch is the sequences per GPU, an error where that one crashes. With "
      "pad_to_longest and the finetuning loader's drop_last false (its default) each epoch's "
      "last batch holds any count of sequences: a warning.",
      source=f"{TE28} transformer_engine/pytorch/utils.py:433 assert_dim_for_fp8_exec; "
      f"{TE_TOKENS_BY_16}; "
      f"{FOUNDRY} llmfoundry/data/text_data.py StreamingTextDataset (max_seq_len from the "
      "loader's dataset), llmfoundry/data/finetuning/dataloader.py build_finetuning_dataloader "
      "(dataset_cfg['max_seq_len']) and build_collate_fn (allow_pad_trimming, pad_to_longest), "
      "llmfoundry/data/finetuning/collator.py Seq2SeqFinetuningCollator (pad_to_longest:339-345, "
      "the trimming to multiple_of = 8:408-421), build_collate_fn's BinPackCollator "
      "(dataloader.py:668-714) and llmfoundry/data/packing.py (_convert_to_batch pads every bin "
      "to max_seq_len; auto_packing_ratio), llmfoundry/command_utils/train.py (the "
      "top-level max_seq_len: icl_seq_len's default); Composer 0.32.1 composer/trainer/"
      "trainer.py _adjust_device_train_microbatch_size (max(int(size / 2), 1)) and "
      "_get_initial_device_train_microbatch_size (auto: the per-rank batch size), "
      "composer/core/data_spec.py _split_tensor (tensor.split); "
      f"{FOUNDRY} llmfoundry/utils/config_utils.py:444-458 calculate_batch_size_info",
      fix="pick device_train_microbatch_size and a sequence length whose product is a multiple "
      f"of {FP8_DIM_MULTIPLE}")
def tokens_per_microbatch(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    te_layers = native_te_layers(config) or (swap is not None and swap.get("backend") == "te")
    if not (is_fp8(config) and te_layers):
        return
    auto = config.get("device_train_microbatch_size") == "auto"
    micro = 1 if auto else as_int(config.get("device_train_microbatch_size"))
    key, seq = train_seq_len(config)
    if micro is None or seq is None:
        return
    batch = device_batch_size(config, ctx)
    first = [replace(hit, message=f"device_train_microbatch_size auto: {_per_gpu(config, batch, ctx)}"
                     ", Composer's first micro-batch (_get_initial_device_train_microbatch_size): "
                     f"at {batch}, {hit.message}", fix=_SPLIT_FIX)
             for hit in tokens_per_microbatch_of(config, batch, key, seq, False)] \
        if auto and batch else []
    if any(hit.severity is None for hit in first):  # the size every run starts at: it crashes
        yield from first
        return
    if auto:  # any size from the device batch down to 1 may run: judge the last one
        for hit in tokens_per_microbatch_of(config, micro, key, seq):
            yield replace(hit, severity="warning", message=f"{AUTO_MICRO_BATCH}{hit.message}")
        return
    judged = [[replace(hit, message=why + hit.message, fix=_SPLIT_FIX if why else hit.fix)
               for hit in tokens_per_microbatch_of(config, size, key, seq, not why)]
              for size, why in micro_batch_sizes(config, micro, ctx)]
    hits = next((hits for hits in judged if any(h.severity is None for h in hits)),
                next((hits for hits in judged if hits), []))
    yield from hits
    if not any(h.severity is None for h in hits):
        yield from _last_batch_of_epoch(config, seq)


def _last_batch_of_epoch(config: Mapping[str, Any], seq: int) -> Iterator[Hit]:
    """FP8006's warning for the finetuning loader's last batch of an epoch: with drop_last
    false (build_finetuning_dataloader's default) it holds whatever sequences remain, any count,
    and pad_to_longest pads it to its own longest example."""
    loader = section(config, "train_loader")
    if _padded_to(config, seq)[0] != "pad_to_longest" or loader.get("drop_last") is True:
        return
    key = "train_loader.drop_last" if "drop_last" in loader else \
        "train_loader.dataset.pad_to_longest"
    yield Hit(key, "the finetuning loader keeps each epoch's last, smaller batch (drop_last "
              f"{loader.get('drop_last', 'unset: false, its default')}), so a micro-batch then "
              "holds k x L tokens for any k sequences left over and L their longest (up to "
              f"{seq}), pad_to_longest's: where k x L is not a multiple of {FP8_TOKEN_MULTIPLE} "
              "TE's FP8 forward asserts and the run crashes at the end of an epoch, after training "
              "it (unless the dataset's size per GPU is a multiple of the batch)",
              severity="warning", fix="train_loader.drop_last: true, or drop "
              "train_loader.dataset.pad_to_longest")


def device_batch_size(config: Mapping[str, Any], ctx: LintContext) -> int | None:
    """The sequences each GPU's train loader batches: in a run, the `device_train_batch_size`
    LLM-Foundry's update_batch_size_info wrote into the config it hands callbacks; in a file,
    global_train_batch_size over the GPU count where that is known (`--gpus`, an MCLI run
    config's `compute.gpus`) and divides it (else calculate_batch_size_info raises, FP8043)."""
    if ctx.scope == "run":
        return as_int(config.get("device_train_batch_size"))
    size = as_int(config.get("global_train_batch_size"))
    if ctx.gpus is None or ctx.gpus <= 0 or size is None or size <= 0 or size % ctx.gpus:
        return None
    return size // ctx.gpus


def micro_batch_sizes(config: Mapping[str, Any], micro: int,
                      ctx: LintContext) -> list[tuple[int, str]]:
    """The micro-batch sizes TE's GEMMs get, each with the words that say why it is not the
    `micro` written ('' for it): calculate_batch_size_info cuts a micro-batch size above the
    device batch size to it, and Composer's split_batch (`tensor.split`) leaves a last,
    smaller micro-batch where the size does not divide the device batch."""
    batch = device_batch_size(config, ctx)
    if batch is None or micro <= 0:
        return [(micro, "")]
    per_gpu = _per_gpu(config, batch, ctx)
    sizes = [(micro, "")] if micro <= batch else [(batch, (
        f"{per_gpu}, and LLM-Foundry's calculate_batch_size_info cuts "
        f"device_train_microbatch_size {micro} to it: "))]
    cut = min(micro, batch)
    if batch % cut:
        sizes.append((batch % cut, f"{per_gpu}, which Composer's split_batch cuts into "
                      f"micro-batches of {cut} and a last one of {batch % cut}: at "
                      f"{batch % cut}, "))
    return sizes


def _per_gpu(config: Mapping[str, Any], batch: int | None, ctx: LintContext) -> str:
    """Where `device_batch_size`'s answer comes from, as FP8006's messages say it."""
    if ctx.scope == "run":
        return f"LLM-Foundry's device_train_batch_size is {batch}"
    return (f"global_train_batch_size {config.get('global_train_batch_size')} over {ctx.gpus} "
            f"GPUs ({ctx.gpus_text()}) is {batch} sequences per GPU")


_SPLIT_FIX = ("a device_train_microbatch_size that divides the sequences per GPU "
              "(global_train_batch_size / GPUs) and is a multiple of "
              f"{FP8_DIM_MULTIPLE} where it can be, or drop train_loader.dataset's pad_to_longest")


#: FP8006's words where the micro-batch size is `auto`.
AUTO_MICRO_BATCH = ("device_train_microbatch_size auto: Composer starts at the device batch "
                    "size and halves it at each CUDA out-of-memory, down to 1 "
                    "(_adjust_device_train_microbatch_size), so at 1: ")


def tokens_per_microbatch_of(config: Mapping[str, Any], micro: int, key: str,
                             seq: int, written: bool = True) -> Iterator[Hit]:
    """FP8006's findings for micro-batches of `micro` sequences of up to `seq` tokens;
    `written`: `micro` is the config's device_train_microbatch_size (not one derived from it)."""
    size = "device_train_microbatch_size" if written else "sequences per micro-batch"
    shown = f"{micro} x {seq} = {micro * seq} tokens per micro-batch ({size} x {key})"
    size = f"device_train_microbatch_size {micro}" if written else f"{micro} sequences per " \
        "micro-batch"
    padding, maybe = _padded_to(config, seq)
    if not tokens_fit_fp8(micro * seq):
        yield Hit(key, f"{shown} is not divisible by {FP8_TOKEN_MULTIPLE}, as TE's FP8 GEMMs "
                  "require")
    elif padding == "pad_to_longest" and not tokens_fit_fp8(micro):
        yield Hit(f"train_loader.dataset.{padding}", f"{maybe}pad_to_longest pads each batch "
                  f"only to its longest example, so a micro-batch holds {micro} x L tokens for "
                  f"any L up to {seq}: with {size} (not a multiple of {FP8_TOKEN_MULTIPLE}) TE's FP8 forward asserts a multiple of "
                  f"{FP8_TOKEN_MULTIPLE} and raises at the first batch whose longest example "
                  "misses it", severity="warning" if maybe else None, fix=_PADDING_FIX)
    elif not dim_fits_fp8(micro * seq):  # the inner dim of the weight-gradient GEMM
        yield Hit(key, f"{shown} is a multiple of {FP8_TOKEN_MULTIPLE}, which TE's forward "
                  f"assert asks, but not of {FP8_DIM_MULTIPLE}: TE's own tests run FP8 only "
                  f"when batch x sequence length is a multiple of {FP8_DIM_MULTIPLE}, and the "
                  "token count is the inner dim of the weight-gradient GEMM, whose FP8 operands "
                  f"TE >= {dotted(TE_GEMM_LEADING_DIM_FROM)} checks for a leading dim "
                  f"divisible by {FP8_DIM_MULTIPLE} ('{TE_GEMM_LEADING_DIM_ERROR}'); that the "
                  "backward fails so is read in TE's sources and has not "
                  "been run on a GPU", severity="warning")
    elif padding is not None and not dim_fits_fp8(
            micro * (1 if padding == "pad_to_longest" else FOUNDRY_PAD_TRIM_MULTIPLE)):
        lengths = "any L up to" if padding == "pad_to_longest" else \
            f"L the longest example rounded up to a multiple of {FOUNDRY_PAD_TRIM_MULTIPLE}, up to"
        yield Hit(f"train_loader.dataset.{padding}", f"{maybe}{padding} gives batches of "
                  f"{micro} x L tokens for {lengths} {seq}: with {size}, some are not a multiple of {FP8_DIM_MULTIPLE}, the token count TE's "
                  "own tests ask for and the inner dim of the weight-gradient GEMM that TE >= "
                  f"{dotted(TE_GEMM_LEADING_DIM_FROM)} checks ('{TE_GEMM_LEADING_DIM_ERROR}'); "
                  "read in TE's sources, not run on a GPU",
                  severity="warning", fix=_PADDING_FIX)


#: The train loader whose collator can pad a batch to less than max_seq_len
#: (llmfoundry/data/finetuning/dataloader.py build_collate_fn).
_SHORT_PADDING_LOADER = "finetuning"
_PADDING_FIX = (f"a device_train_microbatch_size that is a multiple of {FP8_DIM_MULTIPLE}, or "
                "drop train_loader.dataset's pad_to_longest and allow_pad_trimming (every batch "
                "is then padded to max_seq_len)")


def _padded_to(config: Mapping[str, Any], seq: int) -> tuple[str | None, str]:
    """The finetuning collator's option that makes a batch shorter than max_seq_len, read by
    truth value as the collator reads it: `pad_to_longest` (any length, the trimming after it
    keeps that length), else `allow_pad_trimming` (a multiple of 8); None when neither, or when
    a `packing_ratio` other than 1 wraps the collator in BinPackCollator, which pads every bin
    back to max_seq_len (dataloader.py build_collate_fn, packing.py _convert_to_batch). With
    `packing_ratio: auto` above FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO the profiled ratio may be 1
    or not: the second item is then the words that say so (the finding is at most a warning)."""
    loader = section(config, "train_loader")
    if loader.get("name") != _SHORT_PADDING_LOADER:
        return None, ""
    dataset = section(loader, "dataset")
    ratio, maybe = dataset.get("packing_ratio"), ""
    if ratio == "auto" and seq > FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO:
        maybe = ("if packing_ratio: auto picks 1 (no packing; it profiles the data and keeps the "
                 "largest ratio that wastes no example), ")
    elif ratio is not None and ratio != "auto" and ratio != 1:  # LLM-Foundry's `== 1.0`
        return None, ""
    return next((k for k in ("pad_to_longest", "allow_pad_trimming") if dataset.get(k)),
                None), maybe


#: Keys that configs written for older Composer / LLM-Foundry or for DeepSpeed carry, which
#: this Composer/LLM-Foundry refuses; the message says what replaced them.
RETIRED_TOP_LEVEL = {
    "precision_config": (
        "LLM-Foundry 0.22's train config has no precision_config (Composer's Trainer argument "
        "is not reachable from the YAML)",
        FP8_RECIPE_FIX),
    "deepspeed_config": (
        "Composer 0.32 has no DeepSpeed support left and LLM-Foundry 0.22's train config has no "
        "deepspeed_config", "shard with `fsdp_config` instead"),
}
RETIRED_FSDP = {
    "device_mesh": (
        "Composer raises: giving the device mesh in the FSDP config was deprecated in 0.24.0",
        "use data_parallel_shard_degree and/or data_parallel_replicate_degree"),
}


@rule("FP8007", "error", "keys this Composer / LLM-Foundry no longer accept "
      "(`precision_config`, `deepspeed_config`, `fsdp_config.device_mesh`)",
      why="LLM-Foundry refuses top-level keys outside its TrainConfig; Composer removed "
      "DeepSpeed and raises on a device mesh in the FSDP config. The message names the "
      "replacement (for precision_config: our te_swap fp8_recipe).",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig and "
      f"make_dataclass_and_log_config; {COMPOSER} composer/utils/parallelism.py "
      "FSDPConfig.__init__, composer/trainer/trainer.py (no deepspeed_config); "
      "https://github.com/mosaicml/composer/pull/3732 (DeepSpeed removed)",
      fix="see the message", unresolved=True)
def retired_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, (message, fix) in RETIRED_TOP_LEVEL.items():
        if key in config:
            yield Hit(key, message, fix=fix)
    fsdp = config.get("fsdp_config")
    if ctx.fsdp_version == 1 and isinstance(fsdp, Mapping):
        for key, (message, fix) in RETIRED_FSDP.items():
            if key in fsdp:
                yield Hit(f"fsdp_config.{key}", message, fix=fix)


@rule("FP8009", "error", "unknown top-level keys (did-you-mean, or where the key belongs)",
      why="LLM-Foundry raises 'Unused parameters [...] found in cfg' for any top-level key that "
      "is not a TrainConfig field. A key read in another section is told where it belongs (a "
      "top-level attn_config or fc_type under model:, Accelerate's fp8_config as te_swap's "
      "fp8_recipe) instead of a spelling guess (foundry_fp8/lint/known.py home_of).",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py make_dataclass_and_log_config, "
      "TrainConfig",
      fix="fix the spelling, or move the value under `variables:`", scope="file", unresolved=True)
def unknown_top_level_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key in config:
        if not isinstance(key, str):
            continue  # FP8022: keys must be strings
        if key in TRAIN_CONFIG_KEYS or key in RETIRED_TOP_LEVEL:
            continue
        if key in ctx.interpolated:  # a value kept for `${key}`, as older LLM-Foundry allowed
            yield Hit(join_key("", key), f"LLM-Foundry 0.22 refuses unknown top-level key `{key}`, "
                      f"which this file reads as `${{{key}}}`: such values belong under "
                      "`variables:`", fix=f"move `{key}` under `variables:` and read it as "
                      f"`${{variables.{key}}}`")
        else:
            yield Hit(join_key("", key), f"LLM-Foundry 0.22 refuses unknown top-level key `{key}`"
                      + (belongs_under(key, "") or did_you_mean(key, TRAIN_CONFIG_KEYS)),
                      fix=move_fix(key, ""))


@rule("FP8011", "error", "`precision` that Composer does not know (did-you-mean)",
      why="Composer's Precision enum has fp32, amp_fp16, amp_bf16 and amp_fp8 (any case); "
      "anything else fails when the Trainer is built.",
      source=f"{COMPOSER} composer/core/precision.py Precision",
      fix="precision: amp_fp8 (or amp_bf16, amp_fp16, fp32)", also=("eval",))
def precision_value(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if "precision" in config and precision(config) not in PRECISIONS:
        value = config["precision"]
        yield Hit("precision", f"Composer has no precision {value!r}"
                  + did_you_mean(str(value).lower(), PRECISIONS))


@rule("FP8017", "error", "`${oc.env:...}` interpolations",
      why="train_from_yaml and eval_from_yaml call omegaconf's clear_resolver('oc.env') before "
      "loading the YAML, so `llmfoundry train` (and eval) fails with 'Unsupported "
      "interpolation type oc.env'.",
      source=f"{FOUNDRY} llmfoundry/command_utils/train.py train_from_yaml, "
      "llmfoundry/command_utils/eval.py eval_from_yaml",
      fix="put the value in the YAML or pass it as a command-line override "
      "(`llmfoundry train x.yaml key=value`)", scope="file", also=("eval",), unresolved=True)
def oc_env_interpolation(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key in ctx.env_keys:
        yield Hit(key, "LLM-Foundry (train_from_yaml, eval_from_yaml) clears omegaconf's oc.env "
                  "resolver, so ${oc.env:...} fails to resolve")


_LOADERS = ("train_loader", "eval_loader")


def loader_sections(config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any], bool]]:
    """(key, loader, listed) for each loader section; `listed`: one of several eval loaders."""
    for name in (*_LOADERS, "eval_loaders"):
        value = config.get(name)
        items = [(name, value, False)] if isinstance(value, Mapping) else \
            [(f"{name}.{i}", v, name != "train_loader") for i, v in enumerate(value)] \
            if isinstance(value, list) else []
        for key, loader, listed in items:
            if isinstance(loader, Mapping):
                yield key, loader, listed


def _text_loaders(config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key, loader, _ in loader_sections(config):
        if loader.get("name") == "text":
            yield key, loader


@rule("FP8018", "error", "text loader with `num_workers: 0` but prefetch/persistent workers",
      why="build_text_dataloader defaults prefetch_factor to 2 and persistent_workers to true, "
      "and torch's DataLoader raises for either with num_workers 0.",
      source=f"{FOUNDRY} llmfoundry/data/text_data.py build_text_dataloader; torch 2.7.0 "
      "torch/utils/data/dataloader.py DataLoader.__init__",
      fix="prefetch_factor: null and persistent_workers: false", also=("eval",))
def text_loader_without_workers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    wanted = {"prefetch_factor": "null", "persistent_workers": "false"}
    for key, loader in _text_loaders(config):
        if loader.get("num_workers") != 0:
            continue
        for option, default in TEXT_LOADER_DEFAULTS.items():
            value = loader.get(option, default)
            # torch refuses any prefetch_factor but None, and any truthy persistent_workers
            if (value is not None) if option == "prefetch_factor" else bool(value):
                where = f"{key}.{option}" if option in loader else f"{key}.num_workers"
                yield Hit(where, f"text loader with num_workers: 0 needs {option}: "
                          f"{wanted[option]} (LLM-Foundry's default is {default}; torch's "
                          "DataLoader raises)", fix=f"set {key}.{option}: {wanted[option]}")


@rule("FP8047", "error", "a `text` or `finetuning` loader key its builder does not take "
      "(`label` on a single `eval_loader` included), or one of several eval loaders without "
      "`label`",
      why="build_dataloader pops `name` and hands every other key of a loader section to "
      "build_text_dataloader or build_finetuning_dataloader, which raise TypeError 'unexpected "
      "keyword argument' for a key they do not take, once the tokenizer is built. `label` is "
      "popped from the items of an `eval_loader` list alone; each of them needs one: train's "
      "validate_config raises ValueError without it or with a null one, eval's "
      "build_eval_loaders KeyError without it (eval takes a null label, logging the loader as "
      "eval/None).",
      source=f"{FOUNDRY} llmfoundry/data/dataloader.py build_dataloader, llmfoundry/data/"
      "text_data.py build_text_dataloader, llmfoundry/data/finetuning/dataloader.py "
      "build_finetuning_dataloader, llmfoundry/utils/builders.py build_eval_loaders "
      "(label popped when is_multi_eval), llmfoundry/command_utils/train.py validate_config",
      fix="fix the spelling or move the key under `dataset:`; give `label` to each item of an "
      "eval_loader list, and to no single eval_loader", also=("eval",))
def loader_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, loader, listed in loader_sections(config):
        # whatever the loader's name: the label is read before any builder is looked up
        if listed and ctx.family == "eval" and EVAL_LOADER_LABEL not in loader:
            yield Hit(key, f"one of several eval loaders without `{EVAL_LOADER_LABEL}`: LLM-Foundry's "
                      "eval refuses it (KeyError 'label' in build_eval_loaders)",
                      fix=f"add `{EVAL_LOADER_LABEL}: <name>`")
        elif listed and ctx.family != "eval" and loader.get(EVAL_LOADER_LABEL) is None:
            yield Hit(key, f"one of several eval loaders without `{EVAL_LOADER_LABEL}` (absent or "
                      "null): `llmfoundry train` refuses it (ValueError 'each one must include the `label` "
                      "attribute' in validate_config)", fix=f"add `{EVAL_LOADER_LABEL}: <name>`")
        if loader.get("name") not in LOADER_BUILDERS:
            continue  # another registered builder: its keywords are its own
        for option in loader:
            if not isinstance(option, str) or option in LOADER_BUILDER_KEYS or (
                    listed and option == EVAL_LOADER_LABEL):
                continue
            hint = " (only the items of an `eval_loader` list take a label)" \
                if option == EVAL_LOADER_LABEL else belongs_under(option, key) \
                or did_you_mean(option, LOADER_BUILDER_KEYS)
            yield Hit(join_key(key, option), f"the {loader['name']} loader's builder takes no "
                      f"`{option}`: building it raises TypeError (unexpected keyword argument)"
                      + hint, fix=move_fix(option, key) or f"remove `{option}`")


def shape_hits(config: Mapping[Any, Any], shapes: Mapping[str, tuple[str, ...]]) -> Iterator[Hit]:
    """Top-level keys that are not strings, sections in none of their `shapes` (a config
    dataclass's container fields: SECTION_SHAPES, EVAL_SECTION_SHAPES), and keys that are not
    strings inside those sections' mappings (`dict[str, Any]`)."""
    yield from _non_string_keys("", config)
    for key, allowed in shapes.items():
        value = config.get(key)
        if key not in config or any(_shape_fits(value, shape) for shape in allowed):
            mappings = [value] if isinstance(value, Mapping) else \
                value if _shape_fits(value, MAPPINGS) else []
            for index, mapping in enumerate(mappings):
                prefix = key if isinstance(value, Mapping) else f"{key}.{index}"
                yield from _non_string_keys(prefix, mapping)
        else:
            yield _wrong_shape(key, value, allowed)


def _item_fits(item: Any, shape: str) -> bool:
    """An item of a list section: a mapping, or a scalar omegaconf makes a string (bool too)."""
    return isinstance(item, Mapping) if shape == MAPPINGS else isinstance(item, (str, int, float))


def _shape_fits(value: Any, shape: str) -> bool:
    if shape == NULL:
        return value is None
    if shape == STRING:
        return isinstance(value, str)
    if shape == MAPPING:
        return isinstance(value, Mapping)
    if shape == STRINGS:
        return isinstance(value, Mapping) and all(omegaconf_takes(v, (str,))
                                                  for v in value.values())
    return isinstance(value, list) and all(_item_fits(v, shape) for v in value)


def shown(value: Any) -> str:
    """A value as a message names it: null, or its type and (the start of) its repr."""
    return "null" if value is None else f"{type(value).__name__} {value!r:.60}"


def _wrong_shape(key: str, value: Any, shapes: tuple[str, ...]) -> Hit:
    listed = next((s for s in shapes if s in (MAPPINGS, SCALARS)), None)
    if listed and isinstance(value, list):  # the list is fine, one of its items is not
        bad = next(i for i, v in enumerate(value) if not _item_fits(v, listed))
        item = "a mapping" if listed == MAPPINGS else "a string"
        return Hit(f"{key}.{bad}", f"each item of `{key}` must be {item}, got "
                   f"{shown(value[bad])}", fix=f"write item {bad} of {key} as {item}")
    if STRINGS in shapes and isinstance(value, Mapping):  # a mapping, with a value that is not
        bad = next(k for k, v in value.items() if not omegaconf_takes(v, (str,)))
        return Hit(join_key(key, bad), f"each value of `{key}` must be a string (or a number or "
                   f"boolean, made one), got {shown(value[bad])}",
                   fix=f"write {join_key(key, bad)} as a string")
    what = shapes[0] if len(shapes) == 1 else f"{', '.join(shapes[:-1])} or {shapes[-1]}"
    return Hit(key, f"`{key}` must be {what}, got {shown(value)}",
               fix=f"write {key} as {shapes[0]}")


#: What update_batch_size_info reads with `cfg[key]`, in its order (config_utils.py:498-500).
BATCH_KEYS = ("global_train_batch_size", "device_train_microbatch_size")

#: TrainConfig's scalar fields FP8022 leaves alone: `precision` (FP8011 judges every value),
#: the sizes FP8043 judges, and the three update_config_with_batch_size_info overwrites whatever
#: the file gave (config_utils.py:483-486).
TYPED_ELSEWHERE = frozenset({"precision", "max_seq_len", *BATCH_KEYS, "n_gpus",
                              "device_train_batch_size", "device_train_grad_accum"})
_TYPE_NAMES = {int: "an integer", float: "a float", bool: "a boolean", str: "a string",
               type(None): "null"}


def scalar_type_hits(config: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]],
                     elsewhere: frozenset[str], owner: str) -> Iterator[Hit]:
    """The scalar fields of the dataclass `owner` (TrainConfig, EvalConfig; their types
    `fields`) holding a value omegaconf's structured config refuses, but those another rule
    judges (`elsewhere`)."""
    for key, types in fields.items():
        value = config.get(key, MISSING)
        if key in elsewhere or value == MISSING or omegaconf_takes(value, types):
            continue
        names = [t.__name__ for t in types if t is not type(None)]
        hint = names[0] if len(names) == 1 else f"Union[{', '.join(names)}]"
        hint = f"Optional[{hint}]" if type(None) in types else hint
        exact = " (a Union takes its members' types as they are, converting nothing)" \
            if len(names) > 1 else ""
        yield Hit(key, f"`{key}` must be {' or '.join(_TYPE_NAMES[t] for t in types)}{exact}, "
                  f"got {shown(value)}: {owner} types it {hint} and omegaconf refuses the "
                  "value (ValidationError) before anything is built",
                  fix=f"write {key} as " + " or ".join(_TYPE_NAMES[t] for t in types
                                                       if t is not type(None)))


def _ffn_type_refused(model: Mapping[str, Any]) -> str | None:
    """Why train's validate_config raises on `model.ffn_config.ffn_type`, or None. It reads
    `'te' in ffn_type` unless `fc_type` is the string 'te' (TypeError for a value that is no
    container), then `ffn_type in ffns_with_megablocks`, a registry that hashes it (TypeError
    for a list or mapping) (LLM-Foundry 0.22.0 llmfoundry/command_utils/train.py:95-147)."""
    ffn = model.get("ffn_config")
    if not isinstance(ffn, Mapping) or "ffn_type" not in ffn or isinstance(ffn["ffn_type"], str):
        return None
    value = ffn["ffn_type"]
    if isinstance(value, (list, Mapping)):
        return ("reads `ffn_type in ffns_with_megablocks`, a registry lookup that hashes it "
                "(TypeError: unhashable)")
    if model.get("fc_type", "torch") != "te":
        return "reads `'te' in ffn_type` where fc_type is not 'te' (TypeError)"
    return None


def _non_string_keys(prefix: str, mapping: Mapping[Any, Any]) -> Iterator[Hit]:
    for key in mapping:
        if not isinstance(key, str):
            yield Hit(join_key(prefix, key), f"key `{key}` is read as {type(key).__name__}, not a "
                      "string (YAML reads unquoted numbers, true/false, yes/no and on/off so); "
                      "LLM-Foundry's config keys must be strings", fix="quote the key")


@rule("FP8022", "error", "a section in a shape LLM-Foundry refuses (`callbacks:` as a list, "
      "`icl_tasks:` as a mapping), a setting of a type TrainConfig refuses "
      "(`max_duration: 1.5`, `log_to_console: null`, `run_name: [a]`), a key that is not a "
      "string, a key LLM-Foundry fills itself (`eval_loaders` next to `eval_loader`), or "
      "`model.ffn_config` that is not a mapping (train's validate_config calls its `.get`) or "
      "whose `ffn_type` is no string where validate_config refuses it",
      why="make_dataclass_and_log_config builds TrainConfig through omegaconf's structured "
      "config, which refuses a section whose shape its field type does not admit "
      "(`dict[str, Any]`: a mapping with string keys; `list[dict[str, Any]]`; `list[str]`), "
      "and a setting its field's type does not take: an int field converts an int or a "
      "string int() reads (not a float or a boolean), a bool field a boolean, an int, or a "
      "string of an int or of yes/no/on/off/true/false/y/n, a str field any scalar; a Union "
      "field (`max_duration`, `eval_interval`: Union[int, str]; `dist_timeout`: Union[int, "
      "float]) takes its members' types as they are, converting nothing (1.5 and true are "
      "refused for max_duration, '600' for dist_timeout); null only where Optional. It asserts "
      "that top-level keys are strings. It first accepts a list `eval_loader` (as "
      "eval_loaders) and a string `icl_tasks` or `eval_gauntlet` (a path, as icl_tasks_str / "
      "eval_gauntlet_str), refusing those filled keys next to their source. train's "
      "validate_config then reads `'te' in ffn_type` unless fc_type is the string 'te' "
      "(TypeError for null, a number or a boolean) and `ffn_type in ffns_with_megablocks` "
      "(TypeError for a list or a mapping). `precision` is FP8011's, `max_seq_len` and the "
      "batch sizes FP8043's.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig, "
      "make_dataclass_and_log_config, forbid_config_key, llmfoundry/command_utils/train.py "
      "validate_config; omegaconf 2.4 OmegaConf.structured, nodes.py IntegerNode, FloatNode, "
      "BooleanNode, StringNode, base.py UnionNode (members' `convert` flag off); the same "
      "field types and verdicts in LLM-Foundry 0.21.0 with omegaconf 2.2.3",
      fix="write the section or setting in one of the shapes or types the message names")
def section_shapes(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    """Sections whose YAML shape TrainConfig refuses, keys that are not strings where
    LLM-Foundry reads them (top level, a section's own keys), and keys it fills itself."""
    yield from shape_hits(config, SECTION_SHAPES)
    model = section(config, "model")
    if "ffn_config" in model and not isinstance(model["ffn_config"], Mapping):
        # train.py validate_config reads model.get('ffn_config', {}).get('ffn_type', 'mptmlp')
        # for every model (LLM-Foundry 0.22.0 llmfoundry/command_utils/train.py:130)
        yield Hit("model.ffn_config", f"`model.ffn_config` must be a mapping, got "
                  f"{shown(model['ffn_config'])}: train's validate_config calls its .get() "
                  "(AttributeError) before building anything",
                  fix="write model.ffn_config as a mapping ({ffn_type: mptmlp}), or remove it")
    why = _ffn_type_refused(model)
    if why:
        yield Hit("model.ffn_config.ffn_type", f"`model.ffn_config.ffn_type` is "
                  f"{shown(model['ffn_config']['ffn_type'])}, not a string: train's "
                  f"validate_config {why} before building anything",
                  fix="write ffn_type as a string (mptmlp, mptglu, te_ln_mlp), or remove it")
    yield from scalar_type_hits(config, TRAIN_SCALAR_TYPES, TYPED_ELSEWHERE, "TrainConfig")
    yield from filled_key_hits(config)


def filled_key_hits(config: Mapping[str, Any]) -> Iterator[Hit]:
    """Keys make_dataclass_and_log_config fills itself (FILLED_KEYS) given next to their
    source, which it refuses (train and eval alike)."""
    for key, (source, even_null) in FILLED_KEYS.items():
        if key in config and source in config and (even_null or config[source] is not None):
            yield Hit(key, f"LLM-Foundry fills `{key}` from `{source}` itself and refuses both in "
                      "one config ('should not be set')", fix=f"remove {key}; give it as {source}")


@rule("FP8036", "error", "omegaconf's `???` (a value still to be given) left in the config",
      why="omegaconf reads `???` (quoted or not) as a missing value. make_dataclass_and_log_config "
      "reads every TrainConfig (or EvalConfig) field, so a top-level `???` raises "
      "MissingMandatoryValue before anything is built. Below the top level LLM-Foundry checks "
      "nothing: it hands the text '???' to whatever reads the key (MPTConfig, a logger, a "
      "callback), an error where that is an MPT number (MPT raises, as for FP8035's strings), "
      "else a warning. Under `variables` a `???` is only an error once an interpolation uses "
      "it, which fails to resolve (exit 2). One finding per `???`: other rules do not judge "
      "the text.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py make_dataclass_and_log_config "
      "(`dataclass_dict_config[key]` for each field); omegaconf 2.4 MISSING; checked with "
      "make_dataclass_and_log_config on `???` at the top level, under model, loggers, "
      "callbacks, code_paths and eval_loader",
      fix="write the value, or give it on the command line (`llmfoundry train x.yaml "
      "key=value` replaces a `???`)", also=("eval",), unresolved=True)
def mandatory_values(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    mpt = isinstance(section(config, "model").get("name"), str) \
        and section(config, "model")["name"] in MPT_MODEL_NAMES
    for key in mandatory_keys(config):
        if "." not in key:
            yield Hit(key, f"`{key}` is `???`, omegaconf's mark for a value still to be given: "
                      "LLM-Foundry raises MissingMandatoryValue ('Missing mandatory value: "
                      f"{key}') before building anything")
        elif mpt and key.removeprefix("model.") in MPT_NUMBER_KEYS:
            yield Hit(key, f"`{key}` is `???`, omegaconf's mark for a value still to be given: "
                      "LLM-Foundry hands MPT the text '???' and MPT raises building the model")
        else:
            yield Hit(key, f"`{key}` is `???`, omegaconf's mark for a value still to be given: "
                      "LLM-Foundry does not check values below the top level and hands the text "
                      f"'???' to what reads `{key.rpartition('.')[2]}`", severity="warning")


#: The required keys that, next to a top-level setting, make a file a train config rather than
#: a fragment: those only a training run reads (not an eval config's keys, not a `model:`/
#: `tokenizer:` section).
TRAIN_ONLY_KEYS = tuple(k for k in TRAIN_REQUIRED_KEYS
                        if k not in EVAL_CONFIG_KEYS and k not in EVAL_MODEL_KEYS)


def foreign_top_level(config: Mapping[Any, Any], read: frozenset[str]) -> list[str]:
    """The top-level keys of a file that is no LLM-Foundry train or eval config, nor a part of
    one (an inference benchmark's, mkdocs', a CI workflow's, found next to train configs in a
    checkout): it has no key only a train config has (TRAIN_ONLY_KEYS), and more of its keys
    are none that TrainConfig or EvalConfig takes than are (a key the file reads as `${key}`
    counts as theirs: older configs kept variables at the top level). Empty for any other
    file: linted as a train config, each such key is FP8009's."""
    keys = [str(k) for k in config]
    if any(k in TRAIN_ONLY_KEYS for k in keys):
        return []
    foreign = [k for k in keys if k not in TRAIN_CONFIG_KEYS and k not in EVAL_CONFIG_KEYS
               and k not in EVAL_MODEL_KEYS and k not in RETIRED_TOP_LEVEL and k not in read]
    return foreign if 2 * len(foreign) > len(keys) else []


def _setting(config: Mapping[str, Any]) -> str | None:
    """The first top-level setting TrainConfig reads (a value, not a section, even an empty
    one): a file giving one is meant to run, not to be a part; `optimizer:`, `scheduler:`,
    `train_loader:` are sections like `model:`."""
    return next((k for k, v in config.items() if k in TRAIN_CONFIG_KEYS
                 and k not in SECTION_SHAPES and not isinstance(v, (Mapping, list))), None)


def whole_train_config(config: Mapping[str, Any]) -> bool:
    """A file meant to be `llmfoundry train`'s whole config, not a fragment merged into one: it
    gives a top-level setting and a key only a train config has (FP8038's error case)."""
    return _setting(config) is not None and any(key in config for key in TRAIN_ONLY_KEYS)


def _refusal(key: str) -> str:
    return (f"KeyError '{key}' in update_batch_size_info" if key in BATCH_KEYS
            else f"MissingMandatoryValue: Missing mandatory value: {key}")


@rule("FP8038", "error", "a top-level key `llmfoundry train` needs is absent (`max_seq_len`, "
      "`tokenizer`, `global_train_batch_size`, ...)",
      why="make_dataclass_and_log_config reads every TrainConfig field, and those whose default "
      "is omegaconf's MISSING (model, tokenizer, optimizer, scheduler, train_loader, "
      "max_duration, max_seq_len) raise MissingMandatoryValue when the file does not give "
      "them; before that its update_batch_size_info transform reads global_train_batch_size "
      "and device_train_microbatch_size with `cfg[key]` (KeyError) and fills "
      "device_train_batch_size and device_eval_batch_size itself. Files only, and only those "
      "giving a top-level setting (a value that is not a section): nothing for a file of "
      "sections alone (a `model:` or `optimizer:`/`scheduler:` fragment, LLM-Foundry's "
      "icl_tasks and eval_gauntlet files). An error in a file giving a setting and any of "
      f"{', '.join(f'`{k}`' for k in TRAIN_ONLY_KEYS)}, which only a train config has; one "
      "warning naming every absent key in a file giving a setting and none of them "
      "(`precision: amp_bf16` alone), which `llmfoundry train` refuses as is and which may "
      "be a fragment merged into a whole config. A `???` is FP8036's.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig, "
      "make_dataclass_and_log_config, update_batch_size_info (a config_transforms entry, "
      "llmfoundry/utils/__init__.py; train() applies transforms='all')",
      fix="add the key, or give it on the command line (`llmfoundry train x.yaml key=value`) "
      "and lint the file as it runs: `foundry-fp8 lint x.yaml --override key=value`",
      scope="file")
def required_keys_absent(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    absent = [key for key in TRAIN_REQUIRED_KEYS if key not in config]
    setting = _setting(config)
    if setting is None:
        return
    if whole_train_config(config):
        for key in absent:
            yield Hit(key, f"`{key}` is absent: `llmfoundry train` refuses the config before "
                      f"building anything ({_refusal(key)})")
        return
    if absent:
        named = ", ".join(f"`{k}`" for k in absent)
        # update_batch_size_info's reads come before the dataclass's
        first = next((k for k in BATCH_KEYS if k in absent), absent[0])
        yield Hit(setting, f"a train config without {named}: `llmfoundry train` refuses this file "
                  f"as is ({_refusal(first)}); fine only if it is a fragment merged into a "
                  "whole config", severity="warning")


#: Where `llmfoundry train` reads a built-by-name section's `name` with `[...]` or `.pop()`,
#: KeyError when absent (LLM-Foundry 0.22.0 llmfoundry/command_utils/train.py line, what reads
#: it); the model's also in validate_config next to a text loader or icl_tasks, :84 and :90.
NAME_READS = {
    "tokenizer": (368, "`train_cfg.tokenizer['name']` (a tokenizer section that is not empty), "
                  "before the loaders are built"),
    "scheduler": (373, "`train_cfg.scheduler.pop('name')`, before the loaders are built"),
    "model": (515, "`model_config.pop('name')`, once the tokenizer and loaders are built"),
    "optimizer": (538, "`train_cfg.optimizer.pop('name')`, once the model is built"),
}

#: What a null or empty (`''`) name of each built-by-name section meets when LLM-Foundry 0.22.0
#: builds it (a loader's is the `loader` entry); tests/test_lint_names.py and
#: tests/test_lint_names_eval.py run train() and evaluate() on each.
NAME_LOOKUPS = {
    "loader": "build_dataloader looks it up in LLM-Foundry's dataloaders registry: RegistryError "
              "\"Cant't find '{name}' in registry\"",
    "tokenizer": "build_tokenizer hands it to transformers' AutoTokenizer.from_pretrained, which "
                 "finds no tokenizer by that name (OSError; HFValidationError for '')",
    "model": "build_composer_model looks it up in the models registry: RegistryError (train: "
             "AssertionError at train.py:516 for null, `assert isinstance(name, str)`)",
    "optimizer": "build_optimizer looks it up in the optimizers registry: RegistryError",
    "scheduler": "build_scheduler looks it up in the schedulers registry: RegistryError",
}


def unnamed(section: Mapping[str, Any]) -> str | None:
    """How a section LLM-Foundry builds by its `name` lacks one: "absent", "null" or "empty"
    (`''`); None where it has one (any other value is looked up as written)."""
    if "name" not in section:
        return "absent"
    name = section["name"]
    return "null" if name is None else "empty" if name == "" else None


def null_name_hit(key: str, kind: str, how: str, command: str) -> Hit:
    """The finding for a section whose `name` is null or empty (`how`), built as a `kind`
    (a NAME_LOOKUPS key) by `command`."""
    shown = "None" if how == "null" else ""
    return Hit(join_key(key, "name"), f"`{key}.name` is {how}: `{command}` fails before it "
               f"{'trains' if command == 'llmfoundry train' else 'evaluates this model'} ("
               f"{NAME_LOOKUPS[kind].format(name=shown)})")


@rule("FP8053", "error", "a loader (`train_loader`, `eval_loader` or one of its items), "
      "`model`, `tokenizer`, `optimizer` or `scheduler` without `name`, or with a null or empty "
      "one, in a whole train config",
      why="LLM-Foundry builds each of these by its `name` and reads it with `[...]` or `.pop()`: "
      "train's validate_config reads every loader's name (train_loader, each eval_loader item "
      "after its label check, a single eval_loader) and, next to a text loader or icl_tasks, "
      "the model's, before anything is built (KeyError 'name'); train() then reads the "
      "tokenizer's (where the section is not empty), the scheduler's, the model's and the "
      "optimizer's, each before training starts. A null or empty name passes validate_config "
      "and is looked up as a name when the section is built: no registry holds it (RegistryError; "
      "the model's null name fails train()'s `assert isinstance(name, str)`), and transformers "
      "finds no tokenizer by it, each before training starts. Files that are whole train "
      "configs only (FP8038's error case: a setting and a key only a train config has): a "
      "fragment merged into a base config takes the base's name. Eval configs: FP8309.",
      source=f"{FOUNDRY} llmfoundry/command_utils/train.py:71-90 validate_config, :368, :373, "
      ":515-516, :538; llmfoundry/data/dataloader.py:31 build_dataloader (cfg.pop('name')); "
      "llmfoundry/utils/registry_utils.py:139 construct_from_registry; llmfoundry/utils/"
      "builders.py:493-521 build_tokenizer; tests/test_lint_names.py runs validate_config on "
      "each absent loader and model name and train() on the tokenizer and scheduler (:515 and "
      ":538, after the loaders are built, read only), and train() on every null and empty name",
      fix="add `name:` (a loader: text or finetuning; the builder's registered name)",
      scope="file")
def sections_without_name(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not whole_train_config(config):
        return
    loaders = list(loader_sections(config))
    for key, loader, _ in loaders:
        how = unnamed(loader)
        if how == "absent":
            yield Hit(key, f"`{key}` has no `name`: `llmfoundry train` refuses the config before "
                      "building anything (KeyError 'name' in validate_config, which reads each "
                      "loader's name)")
        elif how:
            yield null_name_hit(key, "loader", how, "llmfoundry train")
    validated = config.get("icl_tasks") is not None \
        or any(loader.get("name") == "text" for _, loader, _ in loaders)
    for key, (line, read) in NAME_READS.items():
        value = config.get(key)
        if not isinstance(value, Mapping) or (key == "tokenizer" and not value):
            continue
        how = unnamed(value)
        if how and how != "absent":
            yield null_name_hit(key, key, how, "llmfoundry train")
        if how != "absent":
            continue
        where = "validate_config (:84/:90, next to a text loader or icl_tasks), before " \
            "building anything" if key == "model" and validated else f"train.py:{line} {read}"
        yield Hit(key, f"`{key}` has no `name`: `llmfoundry train` raises KeyError 'name' in "
                  f"{where}")


def _global_batch_refused(size: Any, micro: Any) -> str | None:
    """Why calculate_batch_size_info, then TrainConfig, refuse a global_train_batch_size
    whatever the world size; None when they take it."""
    if isinstance(size, float):
        if size.is_integer():  # divisible by the world size or not, the float is refused
            return ("a float: calculate_batch_size_info raises 'Global batchsize "
                    f"{size} is not divisible by' the GPU count, or where it is, TrainConfig's "
                    "Optional[int] field refuses the float (ValidationError)")
        return (f"not a whole number: calculate_batch_size_info raises 'Global batchsize {size} "
                "is not divisible by' the GPU count (ValueError)")
    if isinstance(size, bool):
        return ("a boolean, which TrainConfig's Optional[int] field refuses (ValidationError), "
                "if calculate_batch_size_info has not raised on it already")
    if not isinstance(size, int):
        return "not a number: `global_train_batch_size % world_size` raises TypeError"
    if size == 0 and as_number(micro) is not None and micro > 0:
        return ("with a micro-batch size: calculate_batch_size_info cuts the micro-batch to "
                "the device batch size, 0, and divides by it (ZeroDivisionError)")
    return None


def _micro_batch_refused(micro: Any, size: Any) -> str | None:
    """Why calculate_batch_size_info, then TrainConfig, refuse a device_train_microbatch_size
    whatever the world size; None when they take it."""
    if isinstance(micro, bool):
        return ("a boolean, which TrainConfig's field (an int, a float or 'auto') refuses "
                "(ValidationError; false divides by zero before that)")
    if isinstance(micro, float) and math.isnan(micro):
        return ("calculate_batch_size_info raises 'cannot convert float NaN to integer' "
                "(ValueError) in math.ceil(device batch size / micro-batch size)")
    if isinstance(micro, (int, float)):
        if micro == 0 and as_int(size) is not None and size >= 0:
            return ("calculate_batch_size_info divides the device batch size by it "
                    "(ZeroDivisionError)")
        return None
    if micro == "auto":
        return None
    return ("neither a number nor 'auto': calculate_batch_size_info raises 'Not sure how to "
            "parse device_microbatch_size' (ValueError)")


@rule("FP8043", "error", "`max_seq_len`, `global_train_batch_size` or "
      "`device_train_microbatch_size` that `llmfoundry train` refuses before building anything "
      "(`.nan`, `.inf`, a float where an integer goes, a string, 0 where it divides)",
      why="make_dataclass_and_log_config first runs its update_batch_size_info transform, whose "
      "calculate_batch_size_info takes `global_train_batch_size % world_size` (a float that is "
      "not a whole number, NaN or infinity is 'not divisible'; a string or null raises "
      "TypeError), divides the device batch size by the micro-batch size (0, or a micro-batch "
      "cut to a device batch size of 0: ZeroDivisionError) and rounds it up with math.ceil "
      "(NaN: ValueError), and takes only numbers and 'auto' as micro-batch sizes; then "
      "omegaconf types TrainConfig's fields: `max_seq_len` is an int (omegaconf converts an int "
      "or a string of one, and refuses any float, even 64.0, a boolean or null), "
      "`global_train_batch_size` an Optional[int]. Each refusal holds whatever the GPU count, "
      "but one: a global batch the GPU count (`--gpus`, an MCLI run config's `compute.gpus`) "
      "does not divide; negative sizes and infinite micro-batches pass this step and are not judged here.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py:437-443 (not divisible), :444, "
      ":450-458 (the micro-batch cut to the device batch, math.ceil), :460 (not sure how to "
      "parse), calculate_batch_size_info called by update_batch_size_info :496, a transform "
      "make_dataclass_and_log_config applies (:342) before om.structured(TrainConfig(...)) "
      "(:361; max_seq_len: int :111, global_train_batch_size: Optional[int] :176); omegaconf "
      "2.4 nodes.py IntegerNode; tests/test_lint_numbers.py runs make_dataclass_and_log_config "
      "on each",
      fix="write max_seq_len and global_train_batch_size as integers (the global batch a "
      "multiple of the GPU count), device_train_microbatch_size as a positive integer or auto",
      scope="file")
def train_sizes_refused(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    size, micro = config.get("global_train_batch_size"), config.get("device_train_microbatch_size")
    if "max_seq_len" in config \
            and not omegaconf_takes(config["max_seq_len"], TRAIN_SCALAR_TYPES["max_seq_len"]):
        value = config["max_seq_len"]
        yield Hit("max_seq_len", f"max_seq_len is {value!r:.40}: TrainConfig types it int, and "
                  f"omegaconf raises 'Value {value!s:.40} of type {type(value).__name__} could "
                  "not be converted to Integer' (ValidationError)")
    why = _global_batch_refused(size, micro) if "global_train_batch_size" in config else None
    if why:
        yield Hit("global_train_batch_size", f"global_train_batch_size is {size!r:.40}: {why}")
    elif as_int(size) is not None and ctx.gpus is not None and ctx.gpus > 0 \
            and size % ctx.gpus:
        yield Hit("global_train_batch_size", f"global_train_batch_size {size} is not divisible "
                  f"by the {ctx.gpus} GPUs ({ctx.gpus_text()}): calculate_batch_size_info "
                  f"raises 'Global batchsize {size} is not divisible by' the world size "
                  "(ValueError) before building anything")
    why = _micro_batch_refused(micro, size) if "device_train_microbatch_size" in config else None
    if why:
        yield Hit("device_train_microbatch_size",
                  f"device_train_microbatch_size is {micro!r:.40}: {why}")


#: W&B modes in which a run has no server-side entity or project (wandb.init: offline and
#: dryrun give run.entity '', disabled gives run.project ''), read from `init_kwargs.mode`,
#: `init_kwargs.settings.mode`, then WANDB_MODE / WANDB_DISABLED (wandb 0.18 wandb_init.py).
WANDB_NOT_ONLINE = ("offline", "dryrun", "disabled")


def _wandb_mode(logger: Any, ctx: LintContext) -> tuple[str | None, str]:
    """(mode, where it comes from) of a `loggers.wandb` section, as wandb.init settles it: its
    own `init_kwargs.mode`, then `init_kwargs.settings.mode`, then the environment."""
    init = section(logger, "init_kwargs")
    for key, value in (("init_kwargs.mode", init.get("mode")),
                       ("init_kwargs.settings.mode", section(init, "settings").get("mode"))):
        if isinstance(value, str) and value:
            return value.strip().lower(), f"loggers.wandb.{key}"
    return ctx.wandb_mode, "the environment (WANDB_MODE / WANDB_DISABLED)"


@rule("FP8037", "error", "`autoresume: true` with a W&B logger that is not online (offline, "
      "dryrun, disabled): the first run crashes in Composer's Trainer (Composer #2680)",
      why="With autoresume and no latest checkpoint in save_folder yet (the first run), "
      "Trainer.__init__ asks every logger to download it (trainer.py:1888, "
      "_try_checkpoint_download), after Event.INIT set the W&B logger's entity and project from "
      "wandb.run (wandb_logger.py:202-213): an offline run has entity '', a disabled one "
      "project '', and WandBLogger.download_file raises RuntimeError('get_file_artifact can only "
      "be called after running init()') (wandb_logger.py:276-277), which "
      "_try_checkpoint_download does not catch (only NotImplementedError and "
      "FileNotFoundError, trainer.py:1846): the run dies before training. Giving "
      "loggers.wandb.entity and project does not avoid it: offline, download_file then asks the "
      "W&B server (wandb.Api(), api.artifact), which fails without an API key (UsageError, not "
      "caught) or waits on the network. A warning with `fsdp_config.state_dict_type: sharded`, "
      "where Composer looks for a local symlink instead, except on one GPU (LLM-Foundry drops "
      "FSDP there). Judged from the config's W&B mode, else WANDB_MODE (or WANDB_DISABLED) "
      "in an MCLI run config's `env_variables` or its command's exports, else where the "
      "linter runs.",
      source=f"{COMPOSER} composer/trainer/trainer.py:1437 (Event.INIT), :1618-1687 "
      "(autoresume), :1821-1849 (_try_checkpoint_download), :1888; "
      "composer/loggers/wandb_logger.py:185-215 (init) and :261-277 (download_file); wandb 0.18.7 "
      "(offline run.entity '', disabled run.project ''); "
      "https://github.com/mosaicml/composer/issues/2680; "
      f"{FOUNDRY} llmfoundry/command_utils/train.py:594 (autoresume=train_cfg.autoresume), "
      ":320-330 (FSDP dropped on one GPU)",
      fix="for an offline or disabled W&B run drop `autoresume` and resume with `load_path: "
      "<save_folder>/latest-rank0.pt` (runs after the first); or log to W&B online")
def autoresume_offline_wandb(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    autoresume = config.get("autoresume")
    loggers = section(config, "loggers")
    if not (autoresume is True or (isinstance(autoresume, str)
                                   and autoresume.strip().lower() == "true")) \
            or "wandb" not in loggers:
        return
    mode, where = _wandb_mode(loggers["wandb"], ctx)
    if mode not in WANDB_NOT_ONLINE:
        return
    sharded = str(section(config, "fsdp_config").get("state_dict_type", "")).lower() == "sharded"
    yield Hit("autoresume", f"autoresume with the W&B logger in {mode} mode ({where}): a run "
              "that finds no latest checkpoint in a local save_folder (the first run; every run "
              "when save_folder is remote) asks W&B for one, and "
              "WandBLogger.download_file raises RuntimeError('get_file_artifact can only be "
              "called after running init()'), which Composer's Trainer does not catch (Composer "
              "#2680)" + ("; with sharded FSDP checkpoints Composer skips that download on more "
                          "than one GPU, but not on one, where LLM-Foundry drops FSDP"
                          if sharded else ""),
              severity="warning" if sharded else None)


@rule("FP8057", "warning", "a `{placeholder}` in `loggers.wandb.init_kwargs.dir` "
      "(`dir: runs/{run_name}`): nothing fills it, and W&B writes the run to the system's temp "
      "folder instead",
      why="Composer's WandBLogger hands init_kwargs to wandb.init as written (it fills only "
      "`name`, with the run name, wandb_logger.py:190-199; `{run_name}` is filled in "
      "save_folder and our paths, not here). W&B takes `dir` as the folder to put its `wandb/` "
      "folder in, and where that folder is not writable (os.access, False for a folder that "
      "does not exist, such as the literal `runs/{run_name}`) it writes the run under the "
      "system's temp folder (/tmp/wandb/offline-run-...) with one 'wasn't writable' warning: "
      "the .wandb file is not where the config says, and a temp cleaner may remove it. "
      "OmegaConf's `${run_name}` is another matter: LLM-Foundry resolves it when it loads the "
      "YAML.",
      source=f"{COMPOSER} composer/loggers/wandb_logger.py:82-102 (init_kwargs kept), "
      ":185-206 (wandb.init(**init_kwargs)); wandb 0.18.7 sdk/wandb_settings.py:73-92 "
      "(_get_wandb_dir: os.access(root_dir, W_OK), else tempfile.gettempdir()), :1899 "
      "(dir= is root_dir); "
      f"{FOUNDRY} llmfoundry/utils/config_utils.py to_container (resolve=True)",
      fix="an OmegaConf interpolation (`dir: runs/${run_name}`) or a literal folder, created "
      "before the run (W&B creates only its `wandb/` folder inside it)")
def wandb_dir_placeholder(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    folder = section(section(section(config, "loggers"), "wandb"), "init_kwargs").get("dir")
    placeholder = re.search(r"\{[^{}]*\}", folder) if isinstance(folder, str) else None
    if placeholder:
        yield Hit("loggers.wandb.init_kwargs.dir",
                  f"loggers.wandb.init_kwargs.dir {folder!r:.80}: nothing fills "
                  f"{placeholder.group()} (Composer hands init_kwargs to wandb.init as "
                  "written), so the folder does not exist and W&B writes the run under the "
                  "system's temp folder (/tmp/wandb/...) with one 'wasn't writable' warning")


@rule("FP8051", "warning", "`loggers.mlflow` writing asynchronously (no `synchronous: true`) "
      "to a local file store (a `file:` or plain-path tracking_uri, or none: MLflow's "
      "./mlruns) in a config with fp8_stats: MLflow can drop whole batches of metrics",
      why="Composer's MLFlowLogger logs asynchronously unless `synchronous: true`, and takes "
      "`databricks` under DATABRICKS_TOKEN when it is given none, else MLflow's tracking URI: "
      "the one mlflow.set_tracking_uri set in the run's process (an earlier MLflow logger, or "
      "the user's code), which MLflow takes before MLFLOW_TRACKING_URI, else "
      "MLFLOW_TRACKING_URI, else ./mlruns. MLflow writes the queued batches from "
      f"{THREADPOOL_ENV} threads (10 when unset), and its file store creates a new metric's "
      "folder with an unguarded os.makedirs: two threads creating the same folder raise "
      "`[Errno 17] File exists`, and MLflow logs 'Failed to log run data' and drops the whole "
      "batch, several steps of every metric with Composer's 10 s logging buffer, the loss "
      "included. fp8_stats' first logging step brings many new keys at once "
      "(fp8_<stat>/<tensor>/<layer>), which makes the race likely. `foundry-fp8 lint` cannot "
      f"see the run's environment, so it judges the file alone; in the run, `fp8_lint` judges "
      "the URI Composer takes and MLflow's pool under the run's environment, as `fp8_stats` "
      "does (`foundry_fp8.mlflow_facts.races`).",
      source=f"{COMPOSER} composer/loggers/mlflow_logger.py:153 (synchronous), :160 and "
      ":193-196 (logging_buffer_seconds), :217-222 (tracking_uri), :441-445 (log_metrics); "
      "mlflow 2.21-2.22 utils/async_logging/async_logging_queue.py:206, :338 (pool size), "
      "utils/file_utils.py:215-222 (make_containing_dirs), store/tracking/file_store.py:989, "
      "tracking/_tracking_service/utils.py:22 and :69-76 (set_tracking_uri keeps its URI in "
      "the module), :125-128 (get_tracking_uri: that URI before MLFLOW_TRACKING_URI), :185-186 "
      "(file store schemes), tracking/registry.py:"
      "75-78; foundry_fp8/mlflow_facts.py; foundry_fp8/composer/stats.py mlflow_races",
      fix=WORKAROUNDS)
def mlflow_file_store_race(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    loggers = section(config, "loggers")
    if "mlflow" not in loggers or "fp8_stats" not in section(config, "callbacks"):
        return
    mlflow = section(loggers, "mlflow")
    # MLFlowLogger passes `synchronous` on to mlflow.log_metrics, which reads it by truth
    synchronous = bool(mlflow.get("synchronous"))
    if any(f"loggers.mlflow.{k}" in ctx.env_keys for k in ("tracking_uri", "synchronous")):
        return
    if ctx.environ is not None:  # the run: decided as fp8_stats decides it
        uri = composer_tracking_uri(mlflow.get("tracking_uri"), ctx.environ)
        if not races(uri, synchronous, ctx.environ):
            return
        tail = ""
        default = "MLflow's default tracking URI (./mlruns, a local file store)"
    else:
        uri = mlflow.get("tracking_uri")
        if synchronous or (uri is not None and not file_store(str(uri))):
            return
        tail = (f" (the linter cannot see the run's environment: {THREADPOOL_ENV}=1 there also "
                "avoids it)")
        default = "MLflow's default tracking URI (./mlruns, a local file store, unless " \
            "MLFLOW_TRACKING_URI or DATABRICKS_TOKEN says otherwise where the run starts)"
    store = f"the local file store {uri!r:.60}" if uri is not None else default
    yield Hit("loggers.mlflow.synchronous" if "synchronous" in mlflow else "loggers.mlflow",
              f"loggers.mlflow logs asynchronously to {store}: {RACE}{tail}")
