"""Which modules a user's regexes select (te_swap's `include`/`exclude`, fp8_stats' `layers`/
`exclude`/`dump_layers`), matched so that no pattern can hang a run; and te_swap's decision for
one module (convert it, or why not), torch-free, so that `foundry_fp8.swap.plan_swap` (on the
built model) and the linter (on the modules an MPT config describes) decide alike.

Python's `re` backtracks without limit: `^([\\w.]+)+!` on a 40-character module name never
returns. We match with the `regex` module (a dependency of transformers, so already installed
with LLM-Foundry), whose engine cuts most such backtracking short, and with its `timeout`: a
pattern that still takes longer than MATCH_TIMEOUT_S on one module name stops the run with one
line naming the option, instead of hanging INIT. Torch-free; the style is torchao's
`module_filter_fn(module, fqn) -> bool`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Collection
from typing import Any

import regex

from foundry_fp8.blocks import BLOCK_CONTAINERS, block_index
from foundry_fp8.options import OptionError, Problem, SwapConfig
from foundry_fp8.shapes import (
    FP8_DIM_MULTIPLE,
    FP8_TOKEN_MULTIPLE,
    dim_fits_fp8,
    tokens_fit_fp8,
)

#: Why te_swap keeps an MoE router and experts held as weight tensors (its plan and the
#: linter's prediction of it say the same words).
MOE_ROUTER_KEPT = ("MoE router: its logits choose the experts, kept in high precision (as "
                   "Megatron-LM's router)")
MOE_EXPERTS_KEPT = "MoE experts as weight tensors: no nn.Linear to convert, high precision"

#: The norm classes whose forward TE's norms compute, by the (module, class) that defines it ->
#: TE's `normalization`: torch's LayerNorm and RMSNorm (and any subclass or alias that keeps
#: their forward: `norms.register("my_ln", func=torch.nn.LayerNorm)`), and the subclasses whose
#: own forward runs their parent's function only in the autocast dtype (F.layer_norm /
#: F.rms_norm on the downcast input, weight and bias, autocast off): LLM-Foundry's
#: `low_precision_layernorm` and `low_precision_rmsnorm` (llmfoundry/models/layers/norm.py,
#: 0.21-0.22) and Composer's LowPrecisionLayerNorm algorithm's (composer/algorithms/
#: low_precision_layernorm/low_precision_layernorm.py, 0.32). te_swap converts or fuses a norm of
#: one of these (`swap.norm_forward_reason`), and the linter predicts it from the class an MPT's
#: norm_type names (`lint.rules.model`); both read them by name, importing neither.
TE_NORMS = {
    ("torch.nn.modules.normalization", "LayerNorm"): "LayerNorm",
    ("torch.nn.modules.normalization", "RMSNorm"): "RMSNorm",
    ("llmfoundry.models.layers.norm", "LPLayerNorm"): "LayerNorm",
    ("llmfoundry.models.layers.norm", "LPRMSNorm"): "RMSNorm",
    ("composer.algorithms.low_precision_layernorm.low_precision_layernorm",
     "LPLayerNorm"): "LayerNorm",
}


def known_class(where: str, qualname: str,
                known: Collection[tuple[str, str]]) -> tuple[str, str] | None:
    """The one of `known` (module, class) that the class `qualname` of module `where` is, or is
    a Hugging Face remote-code copy of: an MPT exported by LLM-Foundry or taken from the Hub
    with `trust_remote_code` loads LLM-Foundry's files as `transformers_modules.<folder>.<file>`
    (the same file name)."""
    return next(((home, name) for home, name in known if qualname == name and (
        where == home or (where.startswith("transformers_modules.")
                          and where.rpartition(".")[2] == home.rpartition(".")[2]))), None)


def te_norm(where: str, qualname: str) -> str | None:
    """TE's normalization that computes the forward the class `qualname` of module `where`
    defines (`TE_NORMS`); None: another function, which a TE norm would replace silently."""
    found = known_class(where, qualname, TE_NORMS)
    return TE_NORMS[found] if found else None


#: Seconds one search may take (regex checks its timeout coarsely: it returns within ~4x).
MATCH_TIMEOUT_S = 0.05


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def search(key_path: str, pattern: str, name: str) -> bool:
    """Whether `pattern` (the option at `key_path`) matches somewhere in module name `name`;
    OptionError (one line) when the search runs out of time."""
    try:
        return _compiled(pattern).search(name, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        section, _, key = key_path.rpartition(".")
        raise OptionError(section, Problem(
            key, "value", f"regex {pattern!r} takes more than {MATCH_TIMEOUT_S:g} s on module "
            f"name {name!r} (catastrophic backtracking)",
            "simplify it: no nested repetition such as ([\\w.]+)+")) from None


def nearest_name(pattern: str, names: list[str]) -> str:
    """The module name nearest `pattern`'s text (its escapes and anchors dropped), for a
    message: the name a user meant."""
    text = regex.sub(r"\\(.)", r"\1", pattern).strip("^$")
    return max(names, key=lambda name: difflib.SequenceMatcher(None, text, name).ratio())


def prefixed_fix(key_path: str, pattern: str, names: list[str]) -> str | None:
    """For a pattern anchored at `^` that matches none of `names`: the same pattern under
    Composer's `model.` prefix, where that one matches."""
    if not pattern.startswith("^") or pattern.startswith(r"^model\."):
        return None
    prefixed = r"^model\." + pattern[1:]
    return f"`{prefixed}`" if any(search(key_path, prefixed, n) for n in names) else None


def module_filter_fn(section: str, layers: str | None, exclude: str | None,
                     include_key: str = "layers") -> Callable[[Any, str], bool]:
    """torchao-style `(module, fqn) -> bool`: `fqn` matches `layers` (None: any) and not
    `exclude`; `section` and `include_key` name the options in errors."""
    def selected(module: Any, fqn: str) -> bool:
        del module
        return ((layers is None or search(f"{section}.{include_key}", layers, fqn))
                and not (exclude is not None and search(f"{section}.exclude", exclude, fqn)))

    return selected


# -- te_swap's decision for one module -------------------------------------------------------

#: The te_swap options a keep reason can name to relax, in the order advice lists them.
RELAXABLE = ("keep_first/last_blocks", "include", "exclude", "min_gemm_size", "module_filter_fn",
             "keep_lm_head")


class Reason(str):
    """Why te_swap keeps a module (its words), with what would convert it, kept here beside the
    words so that te_swap's refusal advises from this and never from the wording: `relax`, the
    te_swap option that kept it (one of RELAXABLE); `fix`, another change that converts it; both None where
    nothing does (keyword-only, no defaults: each reason says so explicitly)."""

    relax: str | None
    fix: str | None

    def __new__(cls, text: str, *, relax: str | None, fix: str | None) -> Reason:
        reason = super().__new__(cls, text)
        reason.relax, reason.fix = relax, fix
        return reason

    def __getnewargs_ex__(self) -> tuple[tuple[str], dict[str, str | None]]:
        """So that a plan pickles and copies with its advice."""
        return (str(self),), {"relax": self.relax, "fix": self.fix}


def filter_reason(name: str, config: SwapConfig, n_blocks: int,
                  module: Any = None) -> Reason | None:
    """Reasons shared by every kind: block position, regexes, the user's filter (`module` is
    what it is given; the linter has none, and a YAML cannot give a filter function)."""
    block = block_index(name)
    if block is not None and (block < config.keep_first_blocks
                              or block >= n_blocks - config.keep_last_blocks):
        return Reason(f"block {block} kept in high precision (keep_first/last_blocks)",
                      relax="keep_first/last_blocks", fix=None)
    if config.include and not search(f"{config.PATH}.include", config.include, name):
        return Reason("not matched by include", relax="include", fix=None)
    if config.exclude and search(f"{config.PATH}.exclude", config.exclude, name):
        return Reason("matched by exclude", relax="exclude", fix=None)
    if (config.module_filter_fn is not None
            and not _user_filter(config.module_filter_fn, config.PATH, module, name)):
        return Reason("rejected by module_filter_fn", relax="module_filter_fn", fix=None)
    return None


def _user_filter(fn: Callable[[Any, str], Any], path: str, module: Any, name: str) -> bool:
    """The user's `module_filter_fn` on one module; one that raises is named with the module it
    failed on (its own exception, bare, named neither; chained as the cause)."""
    try:
        return bool(fn(module, name))
    except OptionError:  # our own filters' (`module_filter_fn` below): already one line
        raise
    except Exception as error:
        raise OptionError(path, Problem(
            "module_filter_fn", "value", f"raised {type(error).__name__}: {error} on module "
            f"{name!r}", "make it return True or False for every module it is given")) from error


def shape_reason(in_features: int, out_features: int) -> Reason | None:
    """TE's FP8 GEMM rule (`foundry_fp8.shapes`) on a weight [out, in]: in % 16, and out % 16
    too, since out is the last dim of the output gradient the backward GEMMs read."""
    if not (dim_fits_fp8(in_features) and dim_fits_fp8(out_features)):
        return Reason(f"shape {out_features}x{in_features} breaks TE's FP8 rule (weight dims "
                      f"divisible by {FP8_DIM_MULTIPLE})", relax=None, fix=None)
    return None


def gemm_reason(in_features: int, out_features: int, config: SwapConfig) -> Reason | None:
    """Why te_swap keeps a GEMM of these dims: its shape, the tokens per micro-batch, its
    size."""
    shape = shape_reason(in_features, out_features)
    if shape is not None:
        return shape
    tokens = config.tokens_per_microbatch
    if tokens is not None and not tokens_fit_fp8(tokens):
        # the data's size, not a filter: the micro-batch is what to change
        return Reason(f"{tokens} tokens per micro-batch breaks TE's FP8 rule (divisible by "
                      f"{FP8_TOKEN_MULTIPLE})", relax=None,
                      fix=f"make the tokens per micro-batch a multiple of {FP8_TOKEN_MULTIPLE}")
    if min(in_features, out_features) < config.min_gemm_size:
        return Reason(f"smaller than min_gemm_size {config.min_gemm_size}",
                      relax="min_gemm_size", fix=None)
    return None


def backend_reason(config: SwapConfig, what: str, fix: str | None) -> Reason | None:
    """`what` needs TE; `fix`: the change that puts it in FP8, None where TE's module is not
    FP8 either."""
    if config.backend != "te":
        return Reason(f"{what} needs backend te (the emulated backend converts linear layers "
                      "only)", relax=None, fix=fix)
    return None


def linear_reason(name: str, in_features: int, out_features: int, config: SwapConfig,
                  n_blocks: int, module: Any = None, *, lm_head: bool | None = None
                  ) -> Reason | None:
    """Why te_swap keeps a linear layer in high precision; None: it converts it. Only the
    blocks' linears and the LM head are candidates. `lm_head`: whether this is the model's LM
    head (the plan asks the model: GPT-NeoX's is `embed_out`); None: named `...lm_head`."""
    head = name.endswith("lm_head") if lm_head is None else lm_head
    if block_index(name) is None and not head:
        return Reason("outside the transformer blocks ("
                      + ", ".join(f"{c}.<n>" for c in BLOCK_CONTAINERS) + " in module names)",
                      relax=None, fix=None)
    if head and config.keep_lm_head:
        return Reason("LM head kept in high precision (keep_lm_head)", relax="keep_lm_head",
                      fix=None)
    return (filter_reason(name, config, n_blocks, module)
            or gemm_reason(in_features, out_features, config))


def layernorm_reason(name: str, has_bias: bool, config: SwapConfig, n_blocks: int,
                     module: Any = None) -> Reason | None:
    """Why te_swap's `convert_layernorm` keeps a LayerNorm (te_swap also keeps those still on
    the meta device); None: it converts it."""
    # te.LayerNorm is no FP8 module: switching the backend puts nothing more in FP8
    return (backend_reason(config, "convert_layernorm", None)
            or filter_reason(name, config, n_blocks, module)
            or (None if has_bias else Reason("no bias: te.LayerNorm always trains one",
                                             relax=None, fix=None)))


def fuse_reason(name: str, in_features: int, out_features: int, config: SwapConfig,
                n_blocks: int, module: Any = None) -> Reason | None:
    """Why te_swap's `fuse_ln_mlp` does not fuse a block's norm_2 + MLP (`name`: the ffn; the
    dims: its up_proj's) that it could fuse (te_swap also declines those on the meta device)."""
    kept = (filter_reason(name, config, n_blocks, module)
            or gemm_reason(in_features, out_features, config))
    # TE's fused LayerNormMLP is FP8 under amp_fp8: the fix, unless kept on TE too
    return (backend_reason(config, "fuse_ln_mlp",
                           None if kept else "set backend te and precision amp_fp8")
            or kept)
