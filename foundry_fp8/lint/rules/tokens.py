"""How many tokens reach TE's FP8 GEMMs outside the train micro-batch (FP8006's): Composer's
generate callback, and MPT dropping padding tokens before its FFN."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from foundry_fp8.lint.config import as_int, fc_type_name, get, is_fp8, uses_te
from foundry_fp8.lint.known import MPT_FFN_DEFAULTS
from foundry_fp8.lint.registry import Hit, LintContext, rule, section
from foundry_fp8.lint.rules.model import mpt_modules, mpt_value, te_swap_options
from foundry_fp8.lint.rules.ours import converts_any
from foundry_fp8.lint.rules.train import COMPOSER, FOUNDRY, TE28
from foundry_fp8.options import OptionError
from foundry_fp8.shapes import FP8_TOKEN_MULTIPLE, tokens_fit_fp8

TE_ASSERT = (f"{TE28} transformer_engine/pytorch/utils.py:433 assert_dim_for_fp8_exec (called by "
             "module/linear.py:168, layernorm_linear.py:150, layernorm_mlp.py:217 under FP8)")
GENERATE = "callbacks.generate_callback"


def _pads_in_ffn(config: Mapping[str, Any]) -> bool:
    """MPT keeps padding tokens in its FFN (`use_pad_tok_in_ffn`, default true)."""
    return section(config, "model").get("use_pad_tok_in_ffn", True) is not False


def _batches(prompts: int, batch_size: int) -> set[int]:
    """The prompt counts Generate.generate hands model.generate: `batch_size` at a time, the
    rest last (composer/callbacks/generate.py)."""
    size = min(batch_size, prompts)
    return {size} | ({prompts % size} if prompts % size else set())


def _rows_per_prompt(options: Mapping[str, Any]) -> int | None:
    """Sequences transformers' generate runs per prompt (`_expand_inputs_for_generation`):
    num_beams for beam search, else num_return_sequences; None when not whole numbers."""
    beams = as_int(options.get("num_beams", 1))
    sequences = as_int(options.get("num_return_sequences", 1))
    if beams is None or sequences is None:
        return None
    return beams if beams > 1 else sequences


@rule("FP8039", "error", "`callbacks.generate_callback` with TE layers under amp_fp8, with prompt "
      f"batches that are not a multiple of {FP8_TOKEN_MULTIPLE} (or MPT dropping padding)",
      why="Composer's Generate callback runs model.generate inside "
      "get_precision_context(state.precision), whose amp_fp8 branch enters TE's fp8_autocast "
      "enabled (Composer's eval forward passes fp8_autocast_enabled=False; this does not). It "
      "generates batch_size prompts at a time (default: all of them), each expanded to num_beams "
      "(beam search) or num_return_sequences sequences, so every forward feeds TE's layers rows "
      "x tokens inputs, 1 token per row in each decode step: TE asserts the rows of an FP8 GEMM "
      f"input are a multiple of {FP8_TOKEN_MULTIPLE}, and the run crashes at the callback's "
      "first interval (the end of training at the latest) unless every batch is. With "
      "model.use_pad_tok_in_ffn false MPT drops the left padding before its FFN, so no batch "
      "size is safe. te_swap's emulated backend is not TE: not reported. With te_swap's te "
      "backend (it keeps the model's own TE layers in its plan, with the ones it converts) every "
      "TE FP8 layer runs an eval-mode no-grad forward in TE's disabled region, as HF generate's "
      "are: an info (checked against a TE stand-in, not yet on a GPU).",
      source=f"{COMPOSER} composer/callbacks/generate.py Generate.__init__ and generate, "
      "composer/core/precision.py get_precision_context, composer/trainer/trainer.py (eval "
      f"forward: fp8_autocast_enabled=False); {TE_ASSERT}; {FOUNDRY} "
      "llmfoundry/callbacks/__init__.py (generate_callback), llmfoundry/models/mpt/"
      "modeling_mpt.py prepare_inputs_for_generation, llmfoundry/models/layers/blocks.py "
      "MPTBlock.apply_ffn; transformers 4.51 generation/utils.py generate "
      "(_expand_inputs_for_generation); foundry_fp8/composer/te_swap.py "
      "_eval_in_high_precision",
      fix="drop generate_callback from FP8 runs, or give it a multiple of "
      f"{FP8_TOKEN_MULTIPLE} prompts and a batch_size that is a multiple of "
      f"{FP8_TOKEN_MULTIPLE} (with use_pad_tok_in_ffn left at true)")
def generate_under_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    options = section(config, "callbacks").get("generate_callback")
    if not (is_fp8(config) and uses_te(config) and isinstance(options, Mapping)):
        return
    prompts = options.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        return
    high = _generate_in_high_precision(config)
    for hit in _generate_crashes(config, options, prompts):
        yield replace(hit, severity="info", message=_HIGH_PRECISION) if high else hit


#: FP8039's info under te_swap's te backend (`_generate_in_high_precision`).
_HIGH_PRECISION = ("generate's decode steps do not fit TE's FP8 GEMMs, but algorithms.te_swap "
                   "(backend te) runs every TE FP8 layer's eval-mode no-grad forward (HF "
                   "generate's), the model's own included, in high precision (checked on a TE "
                   "stand-in, not yet on a GPU)")


def _generate_in_high_precision(config: Mapping[str, Any]) -> bool:
    """te_swap's te backend under amp_fp8 hooks every TE FP8 module of its plan, converted or
    the model's own (`fc_type: te`, `te_ln_mlp`: `already_fp8`), into TE's disabled region for
    a forward in eval mode without grad (composer/te_swap.py `_eval_in_high_precision`), from
    INIT (again at FIT_START) to FIT_END; Generate's end-of-training run is at
    BATCH_CHECKPOINT, before FIT_END (composer/utils/misc.py create_interval_scheduler)."""
    swap = te_swap_options(config)
    return swap is not None and swap.backend == "te"


def _generate_crashes(config: Mapping[str, Any], options: Mapping[str, Any],
                      prompts: list[Any]) -> Iterator[Hit]:
    """FP8039's error: the batches Generate's decode steps would hand TE's FP8 GEMMs."""
    batch_size = options.get("batch_size")
    if not _pads_in_ffn(config):
        yield Hit(GENERATE, "generate_callback runs model.generate under amp_fp8's TE autocast, "
                  "and with model.use_pad_tok_in_ffn false MPT drops the prompts' left padding "
                  "before its FFN, whose TE GEMMs then get any number of rows: TE asserts a "
                  f"multiple of {FP8_TOKEN_MULTIPLE} and the run crashes at the callback")
        return
    size, per_prompt = as_int(batch_size) if batch_size is not None else len(prompts), \
        _rows_per_prompt(options)
    if size is None or size <= 0 or per_prompt is None or per_prompt <= 0:
        return  # Composer or transformers refuse these themselves
    rows = sorted(n * per_prompt for n in _batches(len(prompts), size))
    if all(tokens_fit_fp8(r) for r in rows):
        return
    key = f"{GENERATE}.batch_size" if "batch_size" in options else f"{GENERATE}.prompts"
    yield Hit(key, f"generate_callback runs model.generate under amp_fp8's TE autocast with "
              f"{' and '.join(map(str, rows))} sequences per forward ({len(prompts)} prompts, "
              f"batch_size {batch_size if batch_size is not None else 'unset: all of them'}); "
              "each decode step feeds TE's GEMMs one token per sequence, and TE asserts a "
              f"multiple of {FP8_TOKEN_MULTIPLE} rows: the run crashes at the callback")


def _te_ffn(config: Mapping[str, Any]) -> str | None:
    """The key that puts TE layers in MPT's FFN under amp_fp8: fc_type te (MPTMLP and MPTGLU
    build their linears with it), ffn_type te_ln_mlp, or te_swap's te backend converting one
    of the FFN's layers; None when none does, or the model is not modelled."""
    model = section(config, "model")
    ffn_type = get(model, "ffn_config.ffn_type") or MPT_FFN_DEFAULTS["ffn_type"]
    if ffn_type == "te_ln_mlp":
        return "model.ffn_config.ffn_type"
    if fc_type_name(model) == "te" and ffn_type in ("mptmlp", "mptglu"):
        return "model.fc_type"
    swap, modules = te_swap_options(config), mpt_modules(model)
    if swap is None or swap.backend != "te" or modules is None:
        return None
    try:
        converts = converts_any([m for m in modules if ".ffn" in m.name], swap,
                                int(mpt_value(model, "n_layers")))
    except OptionError:  # a regex that takes too long: te_swap stops with its own error
        return None
    return "algorithms.te_swap" if converts else None


#: The train loaders that pad every batch: LLM-Foundry's finetuning loader (its collator pads
#: each batch of examples of different lengths).
PADDING_LOADERS = ("finetuning",)


@rule("FP8040", "error", "`model.use_pad_tok_in_ffn: false` with TE layers in MPT's FFN under "
      "amp_fp8",
      why="With use_pad_tok_in_ffn false MPTBlock.apply_ffn drops the padding tokens "
      "(flash-attn's unpad_input over the attention mask) before the FFN, so the FFN's GEMMs "
      "get as many rows as the batch has real tokens, and TE asserts a multiple of "
      f"{FP8_TOKEN_MULTIPLE} for FP8: the first padded batch crashes the run. The finetuning "
      "loader pads every batch (an error); the text loader pads only samples shorter than its "
      "max_seq_len (raw text, tokenized with padding='max_length'; concatenated token samples "
      "fill it), as other loaders may (a warning). The FFN is TE's with fc_type te (MPTMLP, "
      "MPTGLU), ffn_type te_ln_mlp, or te_swap's te backend converting one of its layers.",
      source=f"{FOUNDRY} llmfoundry/models/layers/blocks.py MPTBlock.apply_ffn, "
      "llmfoundry/models/mpt/configuration_mpt.py (use_pad_tok_in_ffn), "
      "llmfoundry/data/text_data.py StreamingTextDataset, llmfoundry/data/finetuning/"
      f"collator.py Seq2SeqFinetuningCollator; {TE_ASSERT}",
      fix="remove model.use_pad_tok_in_ffn (its default, true, keeps the padding tokens in the "
      "FFN)")
def unpadded_ffn_under_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not is_fp8(config) or _pads_in_ffn(config):
        return
    layers = _te_ffn(config)
    if layers is None:
        return
    name = section(config, "train_loader").get("name")
    loader = name if isinstance(name, str) else "train"
    pads = loader in PADDING_LOADERS
    yield Hit("model.use_pad_tok_in_ffn", "use_pad_tok_in_ffn false drops padding tokens before "
              f"MPT's FFN, whose TE layers ({layers}) then get as many rows as a batch has real "
              f"tokens; TE asserts a multiple of {FP8_TOKEN_MULTIPLE} under FP8, so "
              + (f"the {loader} loader's padded batches crash the run" if pads else
                 f"any batch with padding crashes the run (the {loader} loader pads samples "
                 "shorter than max_seq_len)"),
              severity=None if pads else "warning")
