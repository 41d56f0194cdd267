"""Tensor parallelism (`tp_config`) with TE layers: torch's parallel styles shard nn.Linear and
nn.Embedding only, and TE's modules are neither."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from foundry_fp8.lint.config import fc_type_name, get, is_fp8
from foundry_fp8.lint.known import MPT_FFN_DEFAULTS
from foundry_fp8.lint.registry import Hit, LintContext, rule, section
from foundry_fp8.lint.rules.model import mpt_modules, mpt_value, te_swap_options
from foundry_fp8.lint.rules.ours import converts_any
from foundry_fp8.lint.rules.train import COMPOSER, FOUNDRY
from foundry_fp8.options import OptionError

#: The modules LLM-Foundry's `ffn` strategy shards (llmfoundry/tp/ffn_tp_strategy.py TP_LAYERS,
#: ColwiseParallel and RowwiseParallel), the only strategy its registry holds.
TP_SHARDED = (".ffn.up_proj", ".ffn.down_proj")


def _te_at_sharded_layers(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, what) where TE modules stand at the FFN projections the `ffn` strategy shards:
    the model's own (fc_type te in MPTMLP/MPTGLU; te_ln_mlp, which has no projections at all)
    or te_swap's te backend converting one under amp_fp8 (it converts at INIT, before
    Composer's TP wrap); None when none does, or the model is not modelled."""
    model = section(config, "model")
    ffn_type = get(model, "ffn_config.ffn_type") or MPT_FFN_DEFAULTS["ffn_type"]
    if ffn_type == "te_ln_mlp":
        return "model.ffn_config.ffn_type", "te_ln_mlp"
    if fc_type_name(model) == "te" and ffn_type in ("mptmlp", "mptglu"):
        return "model.fc_type", "fc_type te"
    swap, modules = te_swap_options(config), mpt_modules(model)
    if swap is None or swap.backend != "te" or modules is None or not is_fp8(config):
        return None
    try:
        converts = converts_any([m for m in modules if m.name.endswith(TP_SHARDED)], swap,
                                int(mpt_value(model, "n_layers")))
    except OptionError:  # a regex that takes too long: te_swap stops with its own error
        return None
    return ("algorithms.te_swap", "te_swap's te backend") if converts else None


@rule("FP8060", "error", "`tp_config` (tensor parallelism) with TE layers in MPT's FFN "
      "(`fc_type: te`, `ffn_type: te_ln_mlp`, te_swap's te backend converting `ffn.up_proj` or "
      "`ffn.down_proj`)",
      why="LLM-Foundry's `ffn` tensor-parallel strategy (the only one its registry holds) plans "
      "ColwiseParallel for each block's ffn.up_proj and RowwiseParallel for ffn.down_proj, and "
      "Composer's Trainer applies the plan (prepare_tp_module, parallelize_module) after the "
      "INIT event, where te_swap has already converted those layers. torch's parallel styles "
      "shard only nn.Linear and nn.Embedding, and TE's Linear is a TransformerEngineBaseModule: "
      "NotImplementedError 'ColwiseParallel currently only support nn.Linear and nn.Embedding!' "
      "when the Trainer is built. With te_ln_mlp the FFN has no up_proj/down_proj and the "
      "strategy itself raises RuntimeError ('requires `model` to have layers') before that. "
      "On one GPU LLM-Foundry drops tp_config: not reported.",
      source=f"{FOUNDRY} llmfoundry/tp/ffn_tp_strategy.py ffn_tp_strategy, "
      "llmfoundry/command_utils/train.py (tp_config dropped on one GPU, build_tp_strategies); "
      f"{COMPOSER} composer/trainer/trainer.py (Event.INIT, then _wrap_model_for_distributed: "
      "TP wrap), composer/distributed/dist_strategy.py prepare_tp_module; torch 2.7 "
      "torch/distributed/tensor/parallel/style.py ColwiseParallel._apply, RowwiseParallel._apply; "
      "TE 2.8 transformer_engine/pytorch/module/linear.py (class Linear("
      "TransformerEngineBaseModule)), module/base.py (TransformerEngineBaseModule(torch.nn.Module))",
      fix="drop tp_config and shard with fsdp_config alone, or keep the FFN out of TE: "
      "fc_type torch and te_swap's exclude: '\\.ffn\\.(up|down)_proj$'")
def tensor_parallel_te(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    tp = config.get("tp_config")
    if not isinstance(tp, Mapping) or tp.get("strategy") != "ffn" or ctx.gpus == 1:
        return
    found = _te_at_sharded_layers(config)
    if found is None:
        return
    key, what = found
    if what == "te_ln_mlp":
        yield Hit("tp_config.strategy", "tp_config's ffn strategy shards each block's "
                  "ffn.up_proj and ffn.down_proj, and ffn_type te_ln_mlp builds a te.LayerNormMLP "
                  "without them: LLM-Foundry's ffn_tp_strategy raises RuntimeError ('requires "
                  "`model` to have layers') before training")
        return
    yield Hit("tp_config.strategy", f"tp_config's ffn strategy shards each block's ffn.up_proj "
              f"and ffn.down_proj with torch's ColwiseParallel/RowwiseParallel, which take only "
              f"nn.Linear, and {what} ({key}) makes them TE modules: Composer's tensor-parallel "
              "wrap raises NotImplementedError ('ColwiseParallel currently only support "
              "nn.Linear and nn.Embedding!') when the Trainer is built")
