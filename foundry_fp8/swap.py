"""Plan which layers run in FP8, then convert them (torchao's convert style).

`convert_to_fp8` is the one entry point (te_swap's too; torchao's `convert_to_float8_training`
shape): it plans, refuses a model in which nothing would compute in FP8, and converts.
`plan_swap` is pure: it decides, for every candidate module, convert or keep and why.
`apply_swap` replaces the chosen modules in place, copying parameters exactly, keeping attribute
names (so parameter names, optimizers and checkpoints line up) and LLM-Foundry's init attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter
from torch.nn.utils import parametrize
from torch.optim import Optimizer

from foundry_fp8.blocks import block_index
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_checkpoint
from foundry_fp8.filters import (
    MOE_EXPERTS_KEPT,
    MOE_ROUTER_KEPT,
    RELAXABLE,
    Reason,
    fuse_reason,
    known_class,
    layernorm_reason,
    linear_reason,
    nearest_name,
    prefixed_fix,
    search,
    te_norm,
)
from foundry_fp8.fp8_meta import canonical_modules, canonical_name, is_fp8_module
from foundry_fp8.options import OptionError, Problem, SwapConfig
from foundry_fp8.shapes import FP8_DIM_MULTIPLE, FP8_TOKEN_MULTIPLE
from foundry_fp8.te.extra_state import (
    EXTRA_STATE_SUFFIX,
    extra_state_missing,
    has_extra_state,
    inert_extra_state,
)
from foundry_fp8.te.facts import (
    INIT_SCHEMES_WITHOUT_MODULE_INITS,
    LN_MLP_NORMALIZATIONS,
    LN_MLP_SOURCES,
    MPT_DEFAULT_INIT_SCHEME,
    PLAIN_LN_MLP,
    TE_LN_MLP_INIT_SOURCE,
    te_ln_mlp_init_fails,
)
from foundry_fp8.te.probe import te_class_name

#: LLM-Foundry sets these on linear layers (attention.py, ffn.py) and its param_init_fns read
#: them, which matters when `init_device: meta` defers init until after the swap.
KEPT_ATTRIBUTES = ("_fused", "_is_residual")

#: transformers' gradient checkpointing (modeling_utils.py `_set_gradient_checkpointing`, 4.35
#: to 4.51): every module with a true `gradient_checkpointing` flag recomputes its blocks through
#: this attribute, `functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)`
#: unless `gradient_checkpointing_kwargs` say otherwise.
HF_CHECKPOINT_FUNC = "_gradient_checkpointing_func"

Kind = Literal["linear", "layernorm", "ln_mlp", "tied_lm_head", "moe_experts"]

#: An MPT MLP's two linears under `ffn` (LLM-Foundry's MPTMLP), which `fuse_ln_mlp` replaces,
#: with the block's `norm_2`, by one te.LayerNormMLP at `ffn`.
MPT_MLP_LINEARS = ("up_proj", "down_proj")
#: (module, class) of LLM-Foundry's MPTMLP, whose forward `down_proj(act(up_proj(x)))`
#: (llmfoundry/models/layers/ffn.py, 0.21-0.22) is what te.LayerNormMLP computes after its norm.
MPT_MLP_CLASS = ("llmfoundry.models.layers.ffn", "MPTMLP")

#: Set by `apply_swap` on a module whose state_dict keys differ from the unconverted model's:
#: {key under the module: the unconverted model's key under it, or None where it has none}.
PLAIN_KEYS = "_foundry_fp8_plain_keys"


#: MPT's `ffn_config.ffn_act_fn` for TE's LayerNormMLP `gelu`, the tanh form (transformer_engine/
#: common/util/math.h): what an HF export of an all-fused model names (composer/plain.py).
TE_GELU_ACT_FN = {"name": "gelu", "approximate": "tanh"}


def is_te_gelu(act: Any) -> bool:
    """Whether an MPT MLP's built activation is TE's tanh GELU, as LLM-Foundry builds
    `TE_GELU_ACT_FN`: `resolve_ffn_act_fn` binds the dict's keys other than `name` to
    `torch.nn.functional.<name>` as a partial (llmfoundry/models/layers/ffn.py, 0.21-0.22).
    Judged on the module's function, not its config: a block built from `{name: gelu}` or
    MPT's default computes exact GELU."""
    keywords = {k: v for k, v in TE_GELU_ACT_FN.items() if k != "name"}
    return (isinstance(act, functools.partial)
            and act.func is getattr(nn.functional, TE_GELU_ACT_FN["name"])
            and not act.args and act.keywords == keywords)


def te_activation(act: Any) -> Literal["gelu", "relu"] | None:
    """te.LayerNormMLP's `activation` for an MPT MLP's built activation (`resolve_ffn_act_fn`'s
    partial of `torch.nn.functional.<name>`): `gelu` for any GELU (TE's is the tanh form, exact
    only for `TE_GELU_ACT_FN`), `relu` for ReLU (TE's `fmaxf(x, 0.f)`, common/util/math.h:67-69
    at v1.12, 101-103 at v2.18, in `_act_func` since v1.12: torch's relu on every number, only
    a NaN becomes 0), else None (not fused)."""
    if not isinstance(act, functools.partial) or act.args:
        return None
    if act.func is nn.functional.gelu:
        return "gelu"
    if act.func is nn.functional.relu and act.keywords.keys() <= {"inplace"}:
        return "relu"
    return None


def gelu_tanh_error(lo: float = -8.0, hi: float = 8.0, n: int = 16001) -> tuple[float, float]:
    """(max abs, max relative) difference of tanh-approximated vs exact GELU on [lo, hi].

    TE's LayerNormMLP `gelu` is the tanh form; MPT's default GELU is exact (erf). The relative
    difference is taken where |exact GELU| > 0.01 (it is unbounded near the zeros).
    """
    x = torch.linspace(lo, hi, n, dtype=torch.float64)
    exact = nn.functional.gelu(x)
    diff = (nn.functional.gelu(x, approximate=TE_GELU_ACT_FN["approximate"]) - exact).abs()
    big = exact.abs() > 1e-2
    return diff.max().item(), (diff[big] / exact[big].abs()).max().item()


@dataclass(frozen=True)
class Decision:
    """One module: convert or keep, why, and what it weighs (GEMM FLOPs per token, params)."""

    name: str
    kind: Kind
    convert: bool
    reason: str
    in_features: int
    out_features: int
    params: int
    flops: int = 0  # forward GEMM FLOPs per token (`_routed_flops`; a fused LN-MLP's two GEMMs)
    flops_share: float = 0.0  # of all linear-GEMM FLOPs of the model, per token
    #: An FP8 module before the swap (one of TE's the model was built with, run in FP8 under
    #: `amp_fp8`; or ours from an earlier conversion): kept as it is, counted in the FP8 share.
    already_fp8: bool = False

    @property
    def in_fp8(self) -> bool:
        """Whether this module's GEMMs run in FP8 once the plan is applied: a LayerNorm has
        none (te.LayerNorm is a fused kernel in high precision), converted or not."""
        return (self.convert or self.already_fp8) and self.kind != "layernorm"


@dataclass(frozen=True)
class SwapPlan:
    decisions: tuple[Decision, ...]
    backend: str
    #: The model's linear-GEMM FLOPs per token (`linear_flops`), of which each decision's
    #: `flops_share` is; counted before a wrapper (FSDP) shards the weights.
    total_flops: int = 0
    #: Modules whose transformers gradient checkpointing recomputes with `fp8_checkpoint`
    #: (emulate) or TE's checkpoint (te).
    recompute: tuple[str, ...] = ()

    @property
    def converted(self) -> list[Decision]:
        return [d for d in self.decisions if d.convert]

    @property
    def fp8_flops_share(self) -> float:
        """Share of the model's linear-GEMM FLOPs that will run in FP8 (converted or already)."""
        return sum(d.flops_share for d in self.decisions if d.in_fp8)

    @property
    def fp8_param_share(self) -> float:
        """Share of the parameters of GEMM modules (tied LM head included) that run in FP8."""
        gemms = [d for d in self.decisions if d.kind != "layernorm"]
        total = sum(d.params for d in gemms)
        return sum(d.params for d in gemms if d.in_fp8) / total if total else 0.0


def gemm_flops(in_features: int, out_features: int) -> int:
    """Forward FLOPs per token of one GEMM, 2 per multiply-add: the one count behind every
    linear-GEMM FLOPs share (te_swap's plan and coverage table, fp8_guard's budget and
    series)."""
    return 2 * in_features * out_features


def module_flops(module: nn.Module, shapes: Mapping[str, Sequence[int]] | None = None) -> int:
    """Forward GEMM FLOPs per token of a GEMM module: an `nn.Linear` (our EmulatedFP8Linear
    too), transformers' `Conv1D` or TE's Linear/LayerNormLinear by its features, else one of
    TE's GEMM modules by its 2-D weights (a LayerNormMLP's `fc1_weight` and `fc2_weight`); 0
    for any other module. Features first: FSDP1 with use_orig_params leaves each weight a 1-D
    view of its rank's shard, or 0 elements (torch/distributed/fsdp/_flat_param.py
    `_use_sharded_views`), where fp8_guard counts after the wrap; a LayerNormMLP has no
    features, so there its weights' shapes are `shapes`' (`original_shapes` of the model)."""
    if isinstance(module, nn.Linear):
        return gemm_flops(module.in_features, module.out_features)
    if (features := conv1d_features(module)) is not None:
        return gemm_flops(*features)
    if isinstance(module, nn.MultiheadAttention):  # its in_proj; out_proj is a Linear of its own
        return sum(gemm_flops(d, module.embed_dim)
                   for d in (module.embed_dim, module.kdim, module.vdim))
    if te_class_name(module) is None:
        return 0
    # TE's Linear/LayerNormLinear keep their (tensor-parallel partition's) sizes, as their
    # weight has them (TE v1.12 pytorch/module/linear.py:739-772, layernorm_linear.py:899-935)
    features = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    if all(isinstance(f, int) for f in features):
        return gemm_flops(*features)
    flops = 0
    for name in ("weight", "fc1_weight", "fc2_weight"):
        weight = getattr(module, name, None)
        shape = tuple((shapes or {}).get(name, weight.shape if isinstance(weight, torch.Tensor)
                                         else ()))
        if len(shape) == 2:
            flops += gemm_flops(shape[1], shape[0])
    return flops


def original_shapes(model: nn.Module) -> dict[nn.Module, dict[str, torch.Size]]:
    """{module: {parameter name: its shape}} for the parameters FSDP1 flattened in `model`, from
    each FlatParameter's `_param_infos` and `_shapes` (torch/distributed/fsdp/_flat_param.py,
    torch 2.x; `FullyShardedDataParallel._flat_param`); empty for any other model (FSDP2's
    DTensors keep their shapes)."""
    shapes: dict[nn.Module, dict[str, torch.Size]] = {}
    for wrapper in model.modules():
        flat = getattr(wrapper, "_flat_param", None)
        for info, shape in zip(getattr(flat, "_param_infos", ()), getattr(flat, "_shapes", ()),
                               strict=False):
            shapes.setdefault(info.module, {})[info.param_name] = shape
    return shapes


def conv1d_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of transformers' `Conv1D` (GPT-2's and GPT's linear layers:
    `x @ weight + bias` with weight [in, out], transformers/pytorch_utils.py), else None. Read
    by name, without importing transformers."""
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return module.nx, module.nf
    return None


def linear_flops(model: nn.Module) -> int:
    """The model's linear-GEMM FLOPs per token, the total every FLOPs share is of: its GEMM
    modules' (`module_flops`, TE modules it was built with included) and a tied LM head's
    (`F.linear` on the input embedding, no module of its own)."""
    tied = _tied_lm_head(model)
    head = gemm_flops(tied[1], tied[0]) if tied is not None else 0
    moe = _moe_layers(model)
    shapes = original_shapes(model)
    return sum(_routed_flops(m, moe.get(n), shapes) for n, m in model.named_modules()) + head


def _routed_flops(module: nn.Module, moe: tuple[str, float] | None,
                  shapes: Mapping[nn.Module, Mapping[str, Sequence[int]]] | None = None) -> int:
    """`module_flops` per token of the model: an MoE expert's (an experts module of weight
    tensors: `expert_weights_flops`) times the share of the tokens routed to it
    (`_moe_layers`)."""
    shapes = shapes or {}
    flops = module_flops(module, shapes.get(module))
    if moe is None:
        return flops
    return round((flops or expert_weights_flops(module, shapes)) * moe[1])


def expert_weights_flops(experts: nn.Module,
                         shapes: Mapping[nn.Module, Mapping[str, Sequence[int]]]) -> int:
    """Forward GEMM FLOPs per token of an MoE experts module that holds its experts as weight
    tensors, were every expert to see the token: 2 per element of each weight matrix, as each
    expert multiplies the token by its slice of it (LLM-Foundry's dMoE and DBRX's `w1`/`v1`/`w2`,
    [experts x ffn, d_model]; Llama 4's `gate_up_proj` [experts, d_model, 2 x ffn] and
    `down_proj`). Biases and 1-D tensors are added, not multiplied. `shapes`: FSDP1's flattened
    weights' shapes (`original_shapes`)."""
    flops = 0
    for sub in experts.modules():
        own = {n: p.shape for n, p in sub.named_parameters(recurse=False)}
        own.update(shapes.get(sub, {}))
        flops += sum(2 * math.prod(shape) for n, shape in own.items()
                     if len(shape) >= 2 and not n.endswith("bias"))
    return flops


def _n_params(*modules: nn.Module) -> int:
    """Parameters that exist: a lazy module's not yet materialized ones have no size."""
    return sum(p.numel() for m in modules for p in m.parameters(recurse=False)
               if not isinstance(p, UninitializedParameter))


def _lazy_reason(module: nn.Module) -> str | None:
    """Why a lazy layer (`nn.LazyLinear`) stays as it is: its weight has no shape until its
    first forward, after te_swap's INIT, so there is nothing to convert or copy."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return (f"not materialized when te_swap ran: nn.{type(module).__name__} (no size yet, "
                f"so not in the shares)")
    return None


def _fusable_mlp(block: nn.Module) -> tuple[str | None, nn.Module | None]:
    """(why not, ffn) for fusing an MPT block's `norm_2` + `ffn` into `te.LayerNormMLP`."""
    ffn, norm = getattr(block, "ffn", None), getattr(block, "norm_2", None)
    if ffn is not None and getattr(block, "norm_attn_norm", None) is not None:
        return ("fuse_norm_attn_norm: norm_2 runs inside norm_attn_norm, which hands the MLP "
                "its output; kept as separate linears"), None
    if ffn is None or norm is None:
        return "no norm_2 + ffn pair (ffn_type te_ln_mlp is already fused)", None
    if hasattr(ffn, "gate_proj"):
        return ("ffn_type mptglu is not fused: TE's geglu/swiglu use their own gate/up layout "
                "and tanh GELU; kept as separate linears"), None
    if not all(isinstance(getattr(ffn, part, None), nn.Linear) for part in MPT_MLP_LINEARS):
        return f"ffn {type(ffn).__name__} is not an MPT MLP ({'/'.join(MPT_MLP_LINEARS)})", None
    if not forward_of(ffn, frozenset({MPT_MLP_CLASS})):
        return (f"ffn {type(ffn).__name__} has its own forward, not MPTMLP's "
                "down_proj(act(up_proj(x))) that te.LayerNormMLP computes"), None
    if te_activation(getattr(ffn, "act", None)) is None:
        return "ffn_act_fn is not GELU or ReLU: TE's LayerNormMLP here maps only those", None
    normalization = te_normalization(norm, ffn.up_proj.in_features)
    if normalization not in LN_MLP_NORMALIZATIONS:
        return normalization, None
    if (ffn.up_proj.bias is None) != (ffn.down_proj.bias is None):
        return "up_proj/down_proj bias mismatch", None
    return None, ffn


def te_normalization(norm: nn.Module, hidden: int) -> str:
    """te.LayerNormMLP's `normalization` that computes MPT's `norm_2` (one of
    `LN_MLP_NORMALIZATIONS`), else why none does. torch's LayerNorm (MPT's `layernorm`,
    `low_precision_layernorm`) and RMSNorm (`rmsnorm`, `low_precision_rmsnorm`) over the last
    dim, with a weight (and for LayerNorm a bias: TE trains one) and a numeric eps (TE takes the
    module's). `triton_rmsnorm` (flash-attn's kernel, not built here) is kept."""
    if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        return (f"norm {type(norm).__name__} is not torch's LayerNorm or RMSNorm (MPT's "
                "layernorm/rmsnorm norm_types, te.LayerNormMLP's normalizations)")
    if (own := norm_forward_reason(norm)) is not None:
        return f"norm {own}"
    if tuple(norm.normalized_shape) != (hidden,):
        return f"norm over {tuple(norm.normalized_shape)}, not the last dim {hidden}"
    if norm.weight is None:
        return "norm has no weight (elementwise_affine false): te.LayerNormMLP trains one"
    if isinstance(norm, nn.LayerNorm):
        if norm.bias is None:
            return "norm has no bias (no_bias): te.LayerNormMLP's LayerNorm trains one"
        return "LayerNorm"
    if norm.eps is None:
        return ("RMSNorm eps is None (torch takes the input dtype's epsilon per call): "
                "te.LayerNormMLP needs a number; set model.norm_eps")
    return "RMSNorm"


def forward_of(module: nn.Module, known: frozenset[tuple[str, str]]) -> bool:
    """Whether the class that defines `module`'s forward is one of `known` (module, class), or
    a remote-code copy of it (`filters.known_class`)."""
    owner = _forward_owner(module)
    return known_class(owner.__module__, owner.__qualname__, known) is not None


def _forward_owner(module: nn.Module) -> type:
    return next(c for c in type(module).__mro__ if "forward" in vars(c))


def norm_forward_reason(norm: nn.LayerNorm | nn.RMSNorm) -> str | None:
    """Why a torch LayerNorm/RMSNorm subclass stays as it is: its own forward computes another
    function than TE's norm would from its weight and bias (transformers' NemotronLayerNorm1P
    scales by `weight + 1`, ChameleonLayerNorm normalises a narrower shape than its weight), so
    te.LayerNorm or a fused te.LayerNormMLP would compute something else, silently. None for
    the forwards of `filters.TE_NORMS` (torch's own, the low-precision ones)."""
    base = nn.RMSNorm if isinstance(norm, nn.RMSNorm) else nn.LayerNorm
    owner = _forward_owner(norm)
    if te_norm(owner.__module__, owner.__qualname__) == base.__name__:
        return None
    return (f"{type(norm).__name__}: an nn.{base.__name__} subclass with its own forward, which "
            f"TE's {base.__name__} would not compute")


def _peft_adapters(model: nn.Module) -> dict[str, str]:
    """{name: why kept} for the modules of PEFT adapters (LoRA's `lora_A`/`lora_B`, ...), which
    stay in high precision: they are the few trainable weights of a fine-tune (a rank-16 LoRA's
    pass TE's shape rule, and its `lora_B`, zero at init, has no amax history to scale by),
    while the frozen `base_layer` they wrap is planned as any layer. PEFT's tuner layers name
    their adapter containers in `adapter_layer_names` (peft 0.16 tuners/tuners_utils.py:692,
    BaseTunerLayer), read here without importing PEFT."""
    kept: dict[str, str] = {}
    for name, layer in model.named_modules():
        for attr in getattr(layer, "adapter_layer_names", ()):
            container = getattr(layer, attr, None)
            if not isinstance(container, nn.Module):
                continue
            prefix = f"{name}.{attr}" if name else attr
            for sub, _ in container.named_modules(prefix=prefix):
                kept[sub] = (f"PEFT adapter ({attr}): trainable, kept in high precision "
                             "(its frozen base_layer is planned as any layer)")
    return kept


def _moe_layers(model: nn.Module) -> dict[str, tuple[str, float]]:
    """{name: (why kept, share of the tokens it sees)} for the `nn.Linear` layers of mixture-of-
    experts blocks: a module holding an `experts` ModuleList (transformers' Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3 blocks) or ModuleDict (SwitchTransformers, NLLB-MoE:
    `experts[f"expert_{idx}"]`, modeling_switch_transformers.py:284-286; their top-k is in no
    attribute, so all experts' FLOPs count).

    An expert's GEMM gets the tokens routed to it, a count that changes with every batch
    (Mixtral's `hidden_states[None, top_x]`, modeling_mixtral.py:146), while TE's FP8 GEMM needs
    it divisible by 8 in the forward and 16 in the backward (`foundry_fp8.shapes`): a te.Linear
    expert stops the first batch that breaks it. Each sees `top_k / len(experts)` of the tokens
    on average, its per-token FLOPs share. The router (the block's linear with one output per
    expert) picks the top-k experts from its logits: Megatron-LM computes it as a plain torch
    GEMM, never TE's FP8 (megatron/core/transformer/moe/router.py, Router.gating). Where the
    experts are one module of weights, not linears (LLM-Foundry's `torch_dmoe`, llmfoundry/
    models/layers/dmoe.py, and megablocks' `mb_moe`/`mb_dmoe`; transformers' Llama 4,
    modeling_llama4.py `Llama4TextMoe`, 4.51), the router is the block's `router` child (its
    `layer`, or itself a linear), whatever its width: before, it converted to FP8 where the
    experts were a multiple of 16. Such an experts module (transformers' DBRX's too) is kept
    whole where it holds no linear (nothing to convert), its GEMMs counted by
    `expert_weights_flops` times the same share, or all of them where its forward runs every
    expert on every token (`DENSE_EXPERTS`): before, they counted nothing, and a tiny torch_dmoe
    MPT (4 experts, top 2) read 79% of its linear FLOPs in FP8 for 14%."""
    found: dict[str, tuple[str, float]] = {}
    router = (MOE_ROUTER_KEPT, 1.0)
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        prefix = f"{name}." if name else ""
        top_k = _moe_top_k(block)  # an MoE block's only: other modules' configs may refuse reads
        if not isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            gate = getattr(block, "router", None)
            for sub, module in (gate.named_modules(prefix=f"{prefix}router")
                                if isinstance(gate, nn.Module) else ()):
                if isinstance(module, nn.Linear):
                    found[sub] = router
            if not any(module_flops(m) for m in experts.modules()):  # else planned layer by layer
                found[f"{prefix}experts"] = _weight_experts(block, experts, top_k)
            continue
        if len(experts) == 0:
            continue
        share = top_k / len(experts) if top_k is not None else 1.0
        for sub, module in experts.named_modules(prefix=f"{prefix}experts"):
            if isinstance(module, nn.Linear):
                found[sub] = (f"MoE expert: the tokens routed to it change every batch, and TE's "
                              f"FP8 GEMM needs them divisible by {FP8_TOKEN_MULTIPLE} (forward) "
                              f"and {FP8_DIM_MULTIPLE} (backward); FLOPs counted for the "
                              f"{top_k if isinstance(top_k, int) else 'all'} of "
                              f"{len(experts)} experts a token uses", share)
        for child, sub_module in block.named_children():
            if sub_module is experts:
                continue
            for sub, module in sub_module.named_modules(prefix=f"{prefix}{child}"):
                if isinstance(module, nn.Linear) and module.out_features == len(experts):
                    found[sub] = router
    return found


#: (module, class) of the experts modules of weight tensors whose forward multiplies every
#: token by every expert's weights, the routing weights zeroing the experts not chosen after:
#: transformers' Llama 4 (modeling_llama4.py:172-177 gathers all the tokens for each expert,
#: :85-88 `torch.bmm` them with all the experts' weights, 4.51). Read by name.
DENSE_EXPERTS = frozenset({("transformers.models.llama4.modeling_llama4", "Llama4TextExperts")})


def _moe_top_k(block: nn.Module) -> int | None:
    """The experts a token uses in an MoE block, where the block says: transformers' `top_k`
    (Mixtral, Llama 4) or `config.num_experts_per_tok`, LLM-Foundry's dMoE router's
    `moe_top_k` (llmfoundry/models/layers/dmoe.py, LearnedRouter), megablocks' `args.moe_top_k`
    (its router and experts keep their Arguments)."""
    router = getattr(block, "router", None)
    for value in (getattr(block, "top_k", None),
                  getattr(getattr(block, "config", None), "num_experts_per_tok", None),
                  getattr(router, "moe_top_k", None),
                  getattr(getattr(router, "args", None), "moe_top_k", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value  # 0: torch.topk routes every token to no expert (the block adds zeros)
    return None


def _weight_experts(block: nn.Module, experts: nn.Module,
                    top_k: int | None) -> tuple[str, float]:
    """(why kept, share of the tokens each expert sees) for an MoE experts module of weight
    tensors: `top_k` of its experts (Llama 4's `num_experts`, LLM-Foundry's dMoE
    `moe_num_experts`, megablocks' `args.moe_num_experts`), or all the tokens where it runs
    every expert on each (`DENSE_EXPERTS`) or the counts are not found."""
    counts = (getattr(experts, "num_experts", None), getattr(experts, "moe_num_experts", None),
              getattr(getattr(experts, "args", None), "moe_num_experts", None),
              getattr(block, "num_experts", None))
    n_experts = next((n for n in counts if isinstance(n, int) and not isinstance(n, bool)
                      and n > 0), None)
    kept = f"{MOE_EXPERTS_KEPT}; FLOPs"
    if forward_of(experts, DENSE_EXPERTS):
        return (f"{kept} counted for all {n_experts} experts: {type(experts).__name__} runs "
                "every token through every expert", 1.0)
    if top_k == 0:
        return f"{kept} counted for none: top-k 0 routes no token to an expert", 0.0
    if top_k is None or n_experts is None or top_k > n_experts:
        return f"{kept} counted for every expert (top-k or expert count not found)", 1.0
    return (f"{kept} counted for the {top_k} of {n_experts} experts a token uses",
            top_k / n_experts)


def _lm_heads(model: nn.Module) -> set[str]:
    """Names of the linear LM heads the model's own `get_output_embeddings()` returns
    (transformers' and LLM-Foundry's): GPT-NeoX's (Pythia's) `embed_out` is one, which the name
    rule `...lm_head` missed."""
    heads = [m.get_output_embeddings() for m in model.modules()
             if callable(getattr(m, "get_output_embeddings", None))]
    return {name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(m is h for h in heads)}


def _on_meta(module: nn.Module, meta_elsewhere: bool) -> str | None:
    """Which meta init leaves `module`'s weights to LLM-Foundry's param_init_fn under FSDP:
    "init_device meta" where they are on the meta device here, "init_device mixed" where they
    are real here but on meta on another rank (`meta_elsewhere`: LLM-Foundry's mixed init builds
    local rank 0's model on the CPU and every other rank's on meta, modeling_mpt.py
    MPTModel.__init__ and hf_base.py, 0.21-0.22; the ranks' modules must be the same); None:
    initialised everywhere."""
    if module.weight.device.type == "meta":
        return "init_device meta"
    return "init_device mixed (other ranks' weights on meta)" if meta_elsewhere else None


def _meta_init_reason(model: nn.Module, up_proj: nn.Linear, meta_elsewhere: bool) -> str | None:
    """Why a block on the meta device is not fused: its te.LayerNormMLP would be initialised
    later by LLM-Foundry's param_init_fn, whose te_layernorm_mlp_init raises NameError in the
    installed version (te.facts). On real weights the fused module copies them instead."""
    init_device = _on_meta(up_proj, meta_elsewhere)
    if init_device is None:
        return None
    try:
        installed = metadata.version("llm-foundry")
    except metadata.PackageNotFoundError:
        return None
    init = next((m.config.init_config for m in model.modules()
                 if isinstance(getattr(getattr(m, "config", None), "init_config", None), dict)),
                {})
    if init.get("name", MPT_DEFAULT_INIT_SCHEME) in INIT_SCHEMES_WITHOUT_MODULE_INITS \
            or not te_ln_mlp_init_fails(installed):
        return None
    return (f"{init_device}: LLM-Foundry {installed}'s init of te.LayerNormMLP raises "
            f"NameError ({TE_LN_MLP_INIT_SOURCE}); init_device: cpu fuses")


def plan_swap(model: nn.Module, config: SwapConfig, *, precision: str = "amp_fp8",
              meta_elsewhere: bool = False) -> SwapPlan:
    """Convert-or-keep, with the reason, for every candidate module of `model`, and its FP8
    modules from before (TE's run in FP8 only under `precision: amp_fp8`). `meta_elsewhere`:
    another rank's copy of the model is on the meta device (`_on_meta`), so what this rank
    keeps there it keeps here too."""
    modules = dict(model.named_modules())
    # every name a module has: one registered twice (`nn.ModuleList([block] * n)`, a layer
    # shared by two blocks) runs at each, so the options must keep it at any of them
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    blocks = {b for names in aliases.values() for n in names if (b := block_index(n)) is not None}
    n_blocks = max(blocks) + 1 if blocks else 0
    decisions: list[Decision] = []
    fused: set[str] = set()

    if config.fuse_ln_mlp:
        max_abs, max_rel = gelu_tanh_error()
        for name, block in modules.items():
            if not (hasattr(block, "ffn")
                    and (hasattr(block, "norm_2") or hasattr(block, "norm_attn_norm"))):
                continue
            why, ffn = _fusable_mlp(block)
            if ffn is not None:
                up = ffn.up_proj
                why = (fuse_reason(f"{name}.ffn", up.in_features, up.out_features, config,
                                   n_blocks, ffn)
                       or _meta_init_reason(model, up, meta_elsewhere))
            if why is not None:  # a note only: its linears are planned one by one below
                note = (Reason(f"not fused: {why}", relax=why.relax, fix=why.fix)
                        if isinstance(why, Reason) else f"not fused: {why}")
                decisions.append(Decision(f"{name}.ffn", "ln_mlp", False, note,
                                          0, 0, 0))  # 0 FLOPs: its linears are counted
                continue
            fused.update(f"{name}.{part}" for part in (
                "norm_2", *(f"ffn.{linear}" for linear in MPT_MLP_LINEARS)))
            decisions.append(Decision(
                f"{name}.ffn", "ln_mlp", True,
                "fused norm_2+MLP; TE relu is exact, as the model's ffn_act_fn"
                if te_activation(ffn.act) == "relu" else
                "fused norm_2+MLP; TE gelu is tanh-approx, as the model's ffn_act_fn"
                if is_te_gelu(ffn.act) else
                f"fused norm_2+MLP; TE gelu is tanh-approx (max abs diff {max_abs:.1e}, "
                f"rel {max_rel:.1e} vs MPT's exact erf GELU)",
                up.in_features, up.out_features, _n_params(block.norm_2, up, ffn.down_proj),
                module_flops(up) + module_flops(ffn.down_proj)))

    adapters = _peft_adapters(model)
    moe = _moe_layers(model)
    heads = _lm_heads(model)
    wrappers = _data_parallel_wrappers(model)
    attention_out = attention_out_projs(model)
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    for name, module in modules.items():
        if name in fused:
            continue
        if isinstance(module, nn.Linear):
            already = is_fp8_module(module)  # an EmulatedFP8Linear: converting resets its state
            if already:
                reason: str | None = f"already in FP8 ({type(module).__name__})"
            elif name in adapters:
                reason = adapters[name]
            elif (lazy := _lazy_reason(module)) is not None:
                reason = lazy
            elif (own_forward := _own_forward_reason(module, id(module) in attention_out)):
                reason = own_forward
            elif others := [o for o in owners.get(id(module.weight), ()) if o != name]:
                reason = f"weight tied to {others[0]}: a converted copy would untie them"
            else:
                reason = moe.get(name, (None, 1.0))[0]
                for alias in aliases[id(module)]:
                    kept = linear_reason(alias, module.in_features, module.out_features, config,
                                         n_blocks, module, lm_head=name in heads or None)
                    if kept is not None:
                        reason = kept if alias == name else Reason(
                            f"{kept}, as {alias} (this module runs there too)",
                            relax=kept.relax, fix=kept.fix)
                        break
                if reason is None:
                    _refuse_wrapped(name, wrappers)
                    reason = _computed_reason(module)
            decisions.append(Decision(name, "linear", reason is None, reason or "converted",
                                      module.in_features, module.out_features,
                                      _n_params(module, *_parametrizations(module)),
                                      _routed_flops(module, moe.get(name)),
                                      already_fp8=already))
        elif name in moe:  # an MoE experts module of weight tensors (`_weight_experts`)
            decisions.append(Decision(name, "moe_experts", False, moe[name][0], 0, 0,
                                      _n_params(*module.modules()),
                                      _routed_flops(module, moe[name])))
        elif isinstance(module, nn.MultiheadAttention):
            decisions.append(Decision(
                f"{name}.in_proj" if name else "in_proj", "linear", False, ATTENTION_IN_PROJ,
                module.embed_dim, 3 * module.embed_dim, _n_params(module), module_flops(module)))
        elif (features := conv1d_features(module)) is not None:
            decisions.append(Decision(
                name, "linear", False, "transformers Conv1D (GPT-2's linear, weight stored "
                "[in, out]): te_swap converts nn.Linear only", *features, _n_params(module),
                module_flops(module)))
        elif (te_class := te_class_name(module)) is not None:
            decisions.append(_te_decision(name, module, te_class, precision))
        elif config.convert_layernorm and isinstance(module, nn.LayerNorm):
            reason = (adapters.get(name) or norm_forward_reason(module)
                      or layernorm_reason(name, module.bias is not None, config, n_blocks,
                                          module))
            if reason is None and (init_device := _on_meta(module, meta_elsewhere)):
                reason = (f"{init_device}: LLM-Foundry's param_init_fn would not initialise "
                          "te.LayerNorm (not in its norms registry)")
            decisions.append(Decision(name, "layernorm", reason is None,
                                      reason or "te.LayerNorm (fused kernel, not FP8)",
                                      module.normalized_shape[-1], module.normalized_shape[-1],
                                      _n_params(module)))

    tied = _tied_lm_head(model)
    if tied is not None:
        vocab, d_model = tied
        decisions.append(Decision("lm_head (tied to wte)", "tied_lm_head", False,
                                  "tied to the embedding (F.linear on wte.weight): no module to "
                                  "convert", d_model, vocab, vocab * d_model,
                                  gemm_flops(d_model, vocab)))
    # the same total as `linear_flops` (a fused LN-MLP's two GEMMs are its up/down_proj's)
    total = linear_flops(model)
    decisions = [Decision(**{**d.__dict__, "flops_share": d.flops / (total or 1)})
                 for d in decisions]
    return SwapPlan(tuple(decisions), config.backend, total)


def _data_parallel_wrappers(model: nn.Module) -> dict[str, str]:
    """{name: kind} of the modules of `model` that FSDP1, FSDP2 (`fully_shard`) or DDP wrap: they
    hold the parameters of every layer inside them (FSDP's flat or sharded parameters, DDP's
    gradient all-reduce)."""
    kinds = ((FullyShardedDataParallel, "FSDP"), (FSDPModule, "FSDP2 fully_shard"),
             (nn.parallel.DistributedDataParallel, "DDP"))
    return {name: next(k for cls, k in kinds if isinstance(module, cls))
            for name, module in model.named_modules()
            if isinstance(module, tuple(cls for cls, _ in kinds))}


def _refuse_wrapped(name: str, wrappers: Mapping[str, str]) -> None:
    """ValueError (one line) for a layer that would convert inside a data-parallel wrapper, which
    holds the layer's parameters. Before: FSDP2's DTensor weight failed the copy deep in torch,
    FSDP1 without use_orig_params (weights gone into its flat parameter) a bare KeyError in the
    plan, DDP Composer's module surgery with a TypeError, and FSDP1 with use_orig_params
    (NO_SHARD, one rank) converted silently: the new parameters trained outside FSDP, never
    all-reduced (sharded, its 1-D views have no layer's shape). torchao's
    `convert_to_float8_training` asks the same: convert first, then wrap."""
    holding = [w for w in wrappers if not w or name.startswith(f"{w}.")]
    if holding:
        wrapper = max(holding, key=len)  # the innermost
        kind = wrappers[wrapper]
        raise ValueError(
            f"te_swap: {canonical_name(name)} would convert to FP8 inside {kind} "
            f"({canonical_name(wrapper) or 'the model itself'}), which already holds its "
            f"parameters; call convert_to_fp8 before wrapping the model in {kind}")


#: nn.MultiheadAttention's projections (torch/nn/modules/activation.py, 2.7): `forward` hands
#: `in_proj_weight` (or q/k/v_proj_weight) and `out_proj.weight` to
#: F.multi_head_attention_forward, which multiplies them itself; `out_proj` is never called.
ATTENTION_IN_PROJ = ("nn.MultiheadAttention's in_proj: a weight that F.multi_head_attention_"
                     "forward multiplies itself, no layer to convert")
ATTENTION_OUT_PROJ = ("nn.MultiheadAttention's out_proj: F.multi_head_attention_forward "
                      "multiplies its weight itself and never calls it, so a converted one would "
                      "not run in FP8")


def attention_out_projs(model: nn.Module) -> set[int]:
    """ids of the `out_proj` layers of `model`'s nn.MultiheadAttention modules, which no forward
    calls (ATTENTION_OUT_PROJ): nothing to convert, and no module hook sees their GEMM."""
    return {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


#: (module, class) of the nn.Linear subclasses whose own forward computes nn.Linear's function:
#: transformers' FalconLinear, `input @ self.weight.T` then `+ self.bias` (transformers/models/
#: falcon/modeling_falcon.py:67-72, 4.51), every linear of a Falcon model. Read by name.
LINEAR_FORWARDS = frozenset({("transformers.models.falcon.modeling_falcon", "FalconLinear")})


def _own_forward_reason(module: nn.Linear, attention_out: bool) -> str | None:
    """Why a linear layer that does not compute `nn.Linear.forward` stays as it is: converted, it
    would compute the FP8 layer's forward instead of its own (a subclass's: a quantized
    bitsandbytes or torchao layer, loralib's LoRA, a user's scaling; `LINEAR_FORWARDS` compute
    nn.Linear's), or, as nn.MultiheadAttention's `out_proj` (`attention_out`), still none."""
    if attention_out:
        return ATTENTION_OUT_PROJ
    if type(module).forward is not nn.Linear.forward and not forward_of(module, LINEAR_FORWARDS):
        return (f"{type(module).__name__}: an nn.Linear subclass with its own forward, which a "
                "converted layer would not compute")
    return None


def _parametrizations(module: nn.Module) -> list[nn.Module]:
    """The ParametrizationLists of a parametrized module, which hold its original parameters
    (`parametrizations.weight.original0`, ...), for its parameter count."""
    return list(module.parametrizations.values()) if parametrize.is_parametrized(module) else []


def _computed_reason(module: nn.Linear) -> str | None:
    """Why a linear layer whose weight (or bias) is computed, not a parameter of its own, stays
    in high precision: a converted copy would hold a plain parameter with the value of the
    moment, so the training would no longer go through the user's function and the state_dict
    keys would change. torch's parametrizations (`parametrizations.weight_norm`, orthogonal,
    ...) keep `parametrizations.<name>.original*`; the hook-based `torch.nn.utils.weight_norm`
    and `prune` keep `weight_g`/`weight_v` or `weight_orig` and set `weight` before each
    forward."""
    if parametrize.is_parametrized(module):
        return (f"parametrized {'/'.join(module.parametrizations)} (torch.nn.utils."
                "parametrize, e.g. weight_norm): a converted copy would drop the "
                "parametrization and its state_dict keys")
    computed = [n for n in ("weight", "bias") if getattr(module, n) is not None
                and getattr(module, n) is not module._parameters.get(n)]
    if computed:
        return (f"{'/'.join(computed)} set by a hook, not a parameter of its own (torch.nn."
                "utils.weight_norm, prune): a converted copy would drop the hook and its "
                "state_dict keys")
    return None


def _te_decision(name: str, module: nn.Module, te_class: str, precision: str) -> Decision:
    """A TE GEMM module the model was built with (`fc_type: te`, `ffn_type: te_ln_mlp`): kept,
    and in FP8 only under TE's autocast, which Composer enters for `amp_fp8` alone."""
    weight = next((w for w in (getattr(module, n, None) for n in ("weight", "fc1_weight"))
                   if isinstance(w, torch.Tensor) and w.dim() == 2), torch.empty(0, 0))
    fp8 = precision == "amp_fp8"
    reason = (f"already in FP8 (te.{te_class})" if fp8 else
              f"te.{te_class} built by the model: FP8 only under amp_fp8, not {precision}")
    return Decision(name, "ln_mlp" if te_class == "LayerNormMLP" else "linear", False, reason,
                    weight.shape[-1], weight.shape[0], _n_params(module), module_flops(module),
                    already_fp8=fp8)


def _tied_lm_head(model: nn.Module) -> tuple[int, int] | None:
    """(vocab, d_model) when the model computes logits from its input embedding with no
    module of its own (MPT's `tie_word_embeddings`, default true), else None: untied, or an
    `nn.Linear` holding the embedding's weight (a module, counted as one). Looks through
    wrappers (Composer's); an `nn.Embedding`'s sizes are read from its attributes, which
    FSDP's sharding leaves alone."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "get_input_embeddings") and hasattr(config, "tie_word_embeddings"):
            if not config.tie_word_embeddings:
                return None
            embedding = module.get_input_embeddings()
            weight = embedding.weight
            if any(isinstance(m, nn.Linear) and m.weight is weight for m in model.modules()):
                return None
            if isinstance(embedding, nn.Embedding):
                return embedding.num_embeddings, embedding.embedding_dim
            return weight.shape[0], weight.shape[1]
    return None


def _converter(backend: str, kind: Kind) -> Callable[[nn.Module], nn.Module]:
    if backend == "emulate":
        return EmulatedFP8Linear.from_linear
    from foundry_fp8.te import backend as te

    te.require_te()
    return te.make_te_linear if kind == "linear" else te.make_te_layernorm


def apply_swap(model: nn.Module, plan: SwapPlan, *,
               optimizers: Optimizer | Sequence[Optimizer] | None = None) -> int:
    """Convert the planned modules in place, with the plan's backend (the one its decisions
    were checked for); the optimizers follow the new parameters.

    Linear and LayerNorm swaps keep every parameter name; an emulated layer keeps the very
    Parameter objects (torchao's `Float8Linear.from_float` does too), so an optimizer built
    before the conversion and not given here still trains it (TE's modules hold their own).
    A fused LN-MLP replaces the block's `ffn` (and sets `norm_2` to None, as LLM-Foundry's `te_ln_mlp` blocks have it), so its
    parameters get TE's names (`ffn.layer_norm_weight`, `ffn.fc1_weight`, ...). Modules whose
    keys differ from the unconverted model's (those and TE's `_extra_state`) carry them under
    `PLAIN_KEYS`, for `plain_state_dict`, and load the unconverted model's state_dict too (a
    plain checkpoint, `load_path`, into a te_swap run; see `_load_plain`).
    """
    from composer.utils.module_surgery import replace_module_classes

    modules = dict(model.named_modules())
    count = 0
    moved: list[tuple[nn.Parameter, nn.Parameter]] = []  # (old, new)
    for decision in plan.converted:
        if decision.kind != "ln_mlp":
            continue
        from foundry_fp8.te import backend as te

        te.require_te()
        block = modules[decision.name.removesuffix(".ffn")]
        new = te.make_te_layernorm_mlp(  # LLM-Foundry's te init knows it
            block, te_normalization(block.norm_2, block.ffn.up_proj.in_features),
            te_activation(block.ffn.act))
        moved += te.ln_mlp_sources(block, new)
        block.ffn, block.norm_2 = new, None
        plain = {f"ffn.{fused}": name for fused, name in LN_MLP_SOURCES.items()}
        if has_extra_state(new):
            plain[f"ffn.{EXTRA_STATE_SUFFIX}"] = None
        _mark_plain(block, plain)
        count += 1

    targets = {id(modules[d.name]): d.kind for d in plan.converted if d.kind != "ln_mlp"}
    init_fns = _param_init_fns(model) if plan.backend == "te" else {}

    def policy(module: nn.Module, index: int) -> nn.Module | None:
        del index
        kind = targets.get(id(module))
        if kind is None:
            return None
        param_init_fn = init_fns.get(id(module))
        if kind == "linear" and param_init_fn is not None and module.weight.is_meta:
            from foundry_fp8.te import backend as te

            new = te.make_te_linear(module, _deferred_weight_init(param_init_fn, module))
        else:
            new = _converter(plan.backend, kind)(module)
        if isinstance(new, EmulatedFP8Linear):  # the same Parameter objects, as torchao's
            for name, param in module.named_parameters(recurse=False):
                setattr(new, name, param)
        for attr in KEPT_ATTRIBUTES:
            if hasattr(module, attr):
                setattr(new, attr, getattr(module, attr))
        if has_extra_state(new):
            _mark_plain(new, {EXTRA_STATE_SUFFIX: None})
        return new

    policies = {nn.Linear: policy, nn.LayerNorm: policy}
    replaced = replace_module_classes(model, policies)
    moved += [(p, getattr(new, name)) for old, new in replaced.items()
              for name, p in old.named_parameters(recurse=False)]
    _take_places(moved, optimizers)
    return count + len(replaced)


def _param_init_fns(model: nn.Module) -> dict[int, Callable[[nn.Module], Any]]:
    """id(module) -> the `param_init_fn` that FSDP's meta init hands it to: the nearest on it
    or an ancestor (composer/distributed/param_init.py `meta_init`, 0.32; LLM-Foundry sets one
    on the HF model, hf_base.py `prepare_inner_model`, and MPT defines one)."""
    found: dict[int, Callable[[nn.Module], Any]] = {}

    def walk(module: nn.Module, inherited: Callable[[nn.Module], Any] | None) -> None:
        own = getattr(module, "param_init_fn", None)
        current = own if callable(own) else inherited
        if current is not None:
            found[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(model, None)
    return found


def _deferred_weight_init(param_init_fn: Callable[[nn.Module], Any],
                          src: nn.Linear) -> Callable[[torch.Tensor], None]:
    """TE's `init_method` for a te.Linear built on meta from `src`: the weight `param_init_fn`
    gives an nn.Linear like `src`. LLM-Foundry's HF param_init_fn calls TE's own
    `reset_parameters` on te.Linear (hf_base.py `_custom_param_init_fn`, 0.21-0.22), which
    would otherwise draw TE's N(0, 0.023) instead of HF's `_init_weights` N(0,
    initializer_range); TE zeroes the bias, as `_init_weights` does. MPT's fc_init initialises
    te.Linear itself; MPT's `torch_default_param_init_fn_` calls `reset_parameters`, so the
    weight gets nn.Linear's own reset (param_init_fns.py, 0.22)."""
    kept = {attr: getattr(src, attr) for attr in KEPT_ATTRIBUTES if hasattr(src, attr)}

    def init(weight: torch.Tensor) -> None:
        with torch.device("meta"):
            shell = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        shell.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)  # same storage
        for attr, value in kept.items():
            setattr(shell, attr, value)
        param_init_fn(shell)

    return init


def _take_places(moved: list[tuple[nn.Parameter, nn.Parameter]],
                 optimizers: Optimizer | Sequence[Optimizer] | None) -> None:
    """Each new parameter takes its old one's place: `requires_grad` (LLM-Foundry's
    `optimizer.disable_grad` freezes by name before te_swap runs) and its slot in whichever
    param group holds it, with any optimizer state. Parameter by parameter: LLM-Foundry's
    `param_groups` may put a layer's weight and bias in different groups (`param_str_match:
    bias`), which Composer's module surgery refuses (`Not all removed parameters are in the
    same parameter group`)."""
    for old, new in moved:
        new.requires_grad_(old.requires_grad)
    new_of = {id(old): new for old, new in moved}
    if optimizers is None:  # a plain loop's optimizer built before the conversion, not passed,
        # found among the live objects where parameters moved (TE's layers; emulated ones keep
        # theirs, and a large process's objects are not scanned for nothing)
        # (`type`, not isinstance: torch.distributed's deprecated `reduce_op` warns on
        # `__class__`, and a test or run with warnings as errors stopped here)
        optimizers = [o for o in gc.get_objects() if
                      issubclass(type(o), Optimizer) and any(
                          id(p) in new_of for g in o.param_groups for p in g["params"])
                      ] if new_of else []
    for optimizer in [optimizers] if isinstance(optimizers, Optimizer) else optimizers:
        for group in optimizer.param_groups:
            group["params"] = [new_of.get(id(p), p) for p in group["params"]]
        for old, new in moved:
            if old in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(old)


def _mark_plain(module: nn.Module, plain: dict[str, str | None]) -> None:
    setattr(module, PLAIN_KEYS, plain)
    module.register_state_dict_post_hook(_save_plain)
    module.register_load_state_dict_pre_hook(_load_plain)


def _save_plain(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                local_metadata: Any) -> None:
    """A state_dict post-hook leaving out the keys the unconverted model lacks and no load
    needs (TE's `_extra_state`: `fp8_state` keeps the FP8 state, and TE >= 2.16 refuses the
    pickled one anyway), so a te_swap checkpoint loads strictly into a run without te_swap, as
    LLM-Foundry's `evaluate` loads. A fused block's names stay TE's: torch's
    `get_model_state_dict` looks every key up as a module path."""
    del local_metadata
    for own, plain in getattr(module, PLAIN_KEYS).items():
        if plain is None:
            state_dict.pop(prefix + own, None)


def _load_plain(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook: `_from_plain`, and for a missing `_extra_state` a pickled
    None, which TE reads as "no FP8 state yet" (a strict load expects the key)."""
    del args
    _from_plain(module, state_dict, prefix)
    for own, plain in getattr(module, PLAIN_KEYS).items():
        if plain is None and extra_state_missing(state_dict, prefix + own):
            state_dict[prefix + own] = inert_extra_state()


def _from_plain(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Take the unconverted model's keys where the converted module's are absent: a fused
    block's parameters from `norm_2`/`ffn.up_proj`/`ffn.down_proj` (else a non-strict load,
    Composer's default, leaves them at their init and only logs the keys)."""
    for own, plain in getattr(module, PLAIN_KEYS).items():
        if plain is not None and prefix + own not in state_dict and prefix + plain in state_dict:
            state_dict[prefix + own] = state_dict.pop(prefix + plain)


def swapped_state_dict(state_dict: dict[str, Any], model: nn.Module,
                       ffn_config: Any = None) -> dict[str, str]:
    """A checkpoint's model state_dict (canonical keys) under `model`'s layout, in place; returns
    the renames made (old key: new key), which the optimizer state's names need too. Per MPT
    block, both ways: a plain block's `norm_2`/`ffn.up_proj`/`ffn.down_proj` keys under a fused
    te.LayerNormMLP's names where `model` fuses that block, and back where it does not (te_swap's
    `fuse_ln_mlp`, `exclude` or `keep_first/last_blocks` changed between save and resume, or a
    bf16 warm start). For loaders that drop the keys a model lacks before any load hook runs:
    torch's `set_model_state_dict` with a full state dict (Composer's FSDP default) keeps only
    the model's own keys (`_distribute_state_dict`).

    LLM-Foundry's own `ffn_type: te_ln_mlp` saves the fused names too, with TE's
    `ffn._extra_state` (te_swap's checkpoints leave it out), dropped where the block becomes
    plain. `ffn_config`: the checkpoint's MPT `ffn_config` where it records one; a te.LayerNormMLP
    the block does not compute raises ValueError (`refuse_foreign_ln_mlps`)."""
    refuse_foreign_ln_mlps(model, {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None
                                   for k, v in state_dict.items()}, ffn_config)
    renames: dict[str, str] = {}
    for name, block in canonical_modules(model):
        layout = ln_mlp_layout(block)
        if layout is None:
            continue
        prefix = f"{name}." if name else ""
        if layout == "plain" and prefix + "ffn.fc1_weight" in state_dict:
            state_dict.pop(f"{prefix}ffn.{EXTRA_STATE_SUFFIX}", None)
        for te_name, plain in LN_MLP_SOURCES.items():
            own, other = (f"ffn.{te_name}", plain) if layout == "fused" else (plain, f"ffn.{te_name}")
            if prefix + own not in state_dict and prefix + other in state_dict:
                renames[prefix + other] = prefix + own
    for old, new in renames.items():
        state_dict[new] = state_dict.pop(old)
    return renames


def refuse_foreign_ln_mlps(model: nn.Module, shapes: Mapping[str, tuple[int, ...] | None],
                           ffn_config: Any) -> None:
    """Raise ValueError (one line) where a checkpoint holds a te.LayerNormMLP for one of
    `model`'s MPT blocks (fused or plain) that the block does not compute: loaded, it would train
    another function or fail on a size mismatch. `shapes`: the checkpoint's model keys
    (`model`'s canonical names) and tensor shapes (None where unknown): a whole file's state dict
    or a sharded checkpoint's metadata (composer/plain.py). `ffn_config`: the checkpoint's MPT
    `ffn_config`, None where it records none; only it tells the activation (gelu and relu have
    the same shapes), so without it a block's activation is taken as the checkpoint's."""
    for name, block in canonical_modules(model):
        prefix = f"{name}." if name else ""
        if ln_mlp_layout(block) is not None and prefix + "ffn.fc1_weight" in shapes:
            rows = (shapes[prefix + "ffn.fc1_weight"] or (None,))[0]
            why = _foreign_ln_mlp(prefix, block, ffn_config,
                                  prefix + "ffn.layer_norm_bias" in shapes, rows)
            if why is not None:
                raise ValueError(why)


def _foreign_ln_mlp(prefix: str, block: nn.Module, ffn_config: Any, norm_bias: bool,
                    rows: int | None) -> str | None:
    """Why `block` does not compute the checkpoint's te.LayerNormMLP at `prefix` (None where it
    does): the block's own norm or activation none of TE's (`te_normalization`,
    `te_activation`); by LLM-Foundry's `ffn_type: te_ln_mlp` config, a keyword of `PLAIN_LN_MLP`
    other than the block's, a keyword it leaves out being TE's default (`build_te_ln_mlp` passes
    none from `norm_type`: a `norm_type: rmsnorm` model's te.LayerNormMLP is a LayerNorm, with
    a bias); by its keys, the norm (`norm_bias`: `ffn.layer_norm_bias` saved, which every TE
    1.12-2.18 registers for LayerNorm only: `if self.normalization != "RMSNorm"`,
    layernorm_mlp.py:1351 at v1.12, 2081 at v2.18); by fc1's `rows`, twice a plain block's
    hidden size (a gated activation such as swiglu: two projections, or another
    expansion_ratio)."""
    fused = ln_mlp_layout(block) == "fused"
    norm = (getattr(block.ffn, "normalization", None) if fused
            else te_normalization(block.norm_2, block.ffn.up_proj.in_features))
    act = (getattr(block.ffn, "activation", None) if fused
           else te_activation(getattr(block.ffn, "act", None)))
    where = f"te_swap: the checkpoint's {prefix}ffn is a te.LayerNormMLP"
    if norm not in LN_MLP_NORMALIZATIONS:
        return f"{where}; this run's norm_2 cannot compute one ({norm})"
    if act is None:
        return f"{where}; this run's ffn_act_fn is not GELU or ReLU, TE's activations here"
    fix = (f"this run's MPT block ({norm} norm_2, {act} MLP) cannot compute it; load it into a "
           "model built with the checkpoint's own ffn_config")
    if isinstance(ffn_config, dict) and ffn_config.get("ffn_type") == "te_ln_mlp":
        expected = {**PLAIN_LN_MLP, "normalization": norm, "activation": act}
        differ = [f"{k}={ffn_config.get(k, v)!r}" + ("" if k in ffn_config else " (TE's default)")
                  for k, v in PLAIN_LN_MLP.items() if ffn_config.get(k, v) != expected[k]]
        if differ:
            return f"{where} (LLM-Foundry's ffn_type te_ln_mlp) with {', '.join(differ)}: {fix}"
    saved = "LayerNorm" if norm_bias else "RMSNorm"
    if saved != norm:
        return (f"{where} with {saved} (by its keys: {'a' if norm_bias else 'no'} "
                f"ffn.layer_norm_bias): {fix}")
    hidden = getattr(getattr(block.ffn, "up_proj", None), "out_features", None)  # plain only
    if rows is not None and hidden is not None and rows == 2 * hidden:
        return (f"{where} whose fc1 has {rows} rows, twice this run's {hidden} (a gated "
                f"activation such as swiglu, or another expansion_ratio): {fix}")
    return None


def ln_mlp_layout(block: nn.Module) -> Literal["fused", "plain"] | None:
    """An MPT block's norm_2 + MLP: fused by te_swap into a te.LayerNormMLP, plain (norm_2 and
    an MLP with `up_proj`), or neither (not a block; LLM-Foundry's own `te_ln_mlp`). By modules
    and te_swap's marker, not parameters: FSDP without `use_orig_params` flattens those."""
    if "ffn.fc1_weight" in getattr(block, PLAIN_KEYS, {}):
        return "fused"
    ffn = getattr(block, "ffn", None)
    if getattr(block, "norm_2", None) is not None and isinstance(getattr(ffn, "up_proj", None),
                                                                 nn.Module):
        return "plain"
    return None


def plain_state_dict(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`model`'s state_dict as the model would have it without te_swap: TE's `_extra_state`
    entries dropped, a fused te.LayerNormMLP's parameters under MPT's `norm_2`/`ffn.up_proj`/
    `ffn.down_proj` names. Keys are `model`'s canonical ones (what torch's
    `get_model_state_dict(model)` gives, FSDP's and checkpointing's wrappers left out); keys
    that are absent (another rank's share) are skipped."""
    renames: dict[str, str | None] = {}
    for name, module in canonical_modules(model):
        prefix = f"{name}." if name else ""
        for key, plain in getattr(module, PLAIN_KEYS, {}).items():
            renames[prefix + key] = None if plain is None else prefix + plain
    return {renames.get(key, key): value for key, value in state_dict.items()
            if renames.get(key, key) is not None}


def coverage_table(plan: SwapPlan) -> str:
    """Converted vs kept modules by reason, with their share of linear FLOPs and params."""
    rows: dict[tuple[bool, str, str], list[float]] = {}
    for d in plan.decisions:
        row = rows.setdefault((d.in_fp8, d.kind, d.reason), [0, 0, 0.0])
        row[0] += 1
        row[1] += d.params
        row[2] += d.flops_share
    lines = [f"te_swap coverage ({plan.backend}): {100 * plan.fp8_flops_share:.1f}% of linear "
             f"FLOPs and {100 * plan.fp8_param_share:.1f}% of linear params in FP8",
             "| FP8 | kind | modules | params | FLOPs share | reason |",
             "|---|---|---|---|---|---|"]
    for (fp8, kind, reason), (count, params, share) in sorted(
            rows.items(), key=lambda kv: (not kv[0][0], kv[0][1], -kv[1][2])):
        lines.append(f"| {'yes' if fp8 else 'no'} | {kind} | {count} | {params} | "
                     f"{100 * share:.1f}% | {reason} |")
    return "\n".join(lines)


def fp8_module_counts(model: nn.Module) -> tuple[int, int]:
    """(TE modules, emulated FP8 modules) in `model`, as `would_run_fp8` takes them."""
    fp8 = [m for m in model.modules() if is_fp8_module(m)]
    emulated = sum(isinstance(m, EmulatedFP8Linear) for m in fp8)
    return len(fp8) - emulated, emulated


def would_run_fp8(precision: str, te_modules: int, emulated_modules: int = 0) -> bool:
    """Whether a run computes anything in FP8.

    `amp_fp8` only makes TE modules (`fc_type: te`, `te_ln_mlp`, or converted by te_swap) run
    in FP8: Composer wraps the forward in TE's autocast, which leaves torch layers untouched.
    Emulated FP8 layers run their FP8 numerics at any precision.
    """
    return emulated_modules > 0 or (precision == "amp_fp8" and te_modules > 0)


def _decided_names(model: nn.Module, plan: SwapPlan) -> list[str]:
    """Every name of the modules `plan` decides on, a module registered twice under each (the
    options search all of a module's names)."""
    decided = {d.name for d in plan.decisions}
    named = list(model.named_modules(remove_duplicate=False))
    ids = {id(module) for name, module in named if name in decided}
    return [name for name, module in named if id(module) in ids]


def _warn_exclude_unmatched(config: SwapConfig, decided: list[str]) -> None:
    """Warn of an `exclude` that matches none of the layers te_swap decides on (FP8055, which
    fp8_lint leaves to this warning in a run): it keeps nothing in high precision, and the
    layers meant out train in FP8. The names are as the regex sees them: Composer's wrapper
    adds `model.`, which a `^` must match."""
    key = f"{config.PATH}.exclude"
    if not decided or any(search(key, config.exclude, name) for name in decided):
        return
    fix = prefixed_fix(key, config.exclude, decided)
    warnings.warn(f"{key}: {config.exclude!r} matches none of the {len(decided)} layers te_swap "
                  f"decides on (nearest: {nearest_name(config.exclude, decided)!r}), so it keeps "
                  "nothing in high precision: those layers train in FP8 (fix: "
                  + (f"write {fix}, searched in the full names)" if fix else
                     "a regex that regex.search finds in the full names)"), stacklevel=3)


def convert_to_fp8(model: nn.Module, config: SwapConfig | None = None, *,
                   module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                   optimizers: Optimizer | Sequence[Optimizer] | None = None,
                   precision: str = "amp_fp8", meta_elsewhere: bool = False) -> SwapPlan:
    """Put `model`'s layers in FP8, in place, and return the plan: what converted, and why each
    other layer did not (`coverage_table(plan)` prints it).

    `config`: which layers, and the backend (default `SwapConfig()`: TE). `module_filter_fn`:
    torchao's `(module, fqn) -> bool`, the config's own field given here (both at once is an
    error). It only narrows: it is asked about the layers the block and include/exclude rules
    leave, and one it refuses stays in high precision with the reason "rejected by
    module_filter_fn". `optimizers` follow the new parameters. `precision`: what the model
    trains under, in Composer's names; `amp_fp8` (the default) is TE's FP8 autocast around the
    forward, as a plain loop enters it with `te.autocast`; emulated layers run in FP8 at any
    precision, under `foundry_fp8.fp8_autocast`. `meta_elsewhere`: another rank's model is on
    the meta device (`plan_swap`; te_swap asks the ranks).

    The layers' FP8 scaling state is not in `model.state_dict()`: a plain loop checkpoints it
    with `fp8_state_dict` and resumes it with `load_fp8_state_dict` (`foundry_fp8.plain_state`).

    Raises ValueError, converting nothing, when no module would compute in FP8.
    """
    config = SwapConfig() if config is None else config
    if module_filter_fn is not None:
        if config.module_filter_fn not in (None, module_filter_fn):
            raise OptionError(config.PATH, Problem(
                "module_filter_fn", "value", "given both in the config and to convert_to_fp8",
                "give it in one place"))
        config = dataclasses.replace(config, module_filter_fn=module_filter_fn)
    plan = plan_swap(model, config, precision=precision, meta_elsewhere=meta_elsewhere)
    if config.exclude:
        _warn_exclude_unmatched(config, _decided_names(model, plan))
    te_modules, emulated = fp8_module_counts(model)
    planned = sum(d.kind != "layernorm" for d in plan.converted)  # te.LayerNorm is not FP8
    if plan.backend == "emulate":
        emulated += planned
    else:
        te_modules += planned
    if not would_run_fp8(precision, te_modules, emulated):
        raise ValueError(_refusal(precision, plan))
    checkpointed = _torch_checkpointed(model)
    if plan.backend == "emulate" and (selective := [
            name for name, _, function in checkpointed if "context_fn" in function.keywords]):
        raise ValueError(
            f"te_swap: {selective[0] or type(model).__name__} checkpoints with a context_fn "
            "(gradient_checkpointing_kwargs, torch's selective checkpointing): the FP8 recompute "
            "needs its own; drop context_fn or checkpoint these layers yourself in fp8_checkpoint")
    recompute = [(module, _fp8_recompute(plan.backend, function.keywords))
                 for _, module, function in checkpointed]
    apply_swap(model, plan, optimizers=optimizers)
    for module, function in recompute:
        setattr(module, HF_CHECKPOINT_FUNC, function)
    return dataclasses.replace(plan, recompute=tuple(name for name, _, _ in checkpointed))


def _fp8_recompute(backend: str, kwargs: dict[str, Any]) -> functools.partial:
    """The checkpoint that recomputes under the forward's FP8 scales, with the user's torch
    checkpoint keywords: ours (always non-reentrant) for emulated layers, TE's (reentrant or
    not, as asked; it takes torch's context_fn) for TE's."""
    if backend == "emulate":
        return functools.partial(
            fp8_checkpoint, **{k: v for k, v in kwargs.items() if k != "use_reentrant"})
    from foundry_fp8.te import backend as te

    return te.te_checkpoint(kwargs)


def _torch_checkpointed(model: nn.Module) -> list[tuple[str, nn.Module, functools.partial]]:
    """(name, module, its checkpoint function) for every module whose transformers gradient
    checkpointing is on with torch's own checkpoint. That recomputes in the backward, outside
    the FP8 autocast and after the forward scales moved: reentrant (transformers' default)
    back-propagates through a high-precision recompute and never updates the backward scales,
    non-reentrant fails with torch's "A different number of tensors was saved". A function of
    the user's own (TE's checkpoint, ours) is left alone."""
    found = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        function = getattr(module, HF_CHECKPOINT_FUNC, None)
        if function is torch.utils.checkpoint.checkpoint:
            function = functools.partial(function)
        if (isinstance(function, functools.partial) and not function.args
                and function.func is torch.utils.checkpoint.checkpoint):
            found.append((name, module, function))
    return found


def _refusal(precision: str, plan: SwapPlan) -> str:
    """The advice comes from the reasons' own `relax`/`fix` (filters.Reason); this module's
    reasons (Conv1D, tied head, MoE, adapters, ...) are plain words: nothing converts those."""
    if precision == "amp_fp8" or plan.backend == "emulate":
        reasons = sorted({d.reason for d in plan.decisions})
        advised = [d.reason for d in plan.decisions if isinstance(d.reason, Reason)]
        relaxed = [o for o in RELAXABLE if any(r.relax == o for r in advised)]
        fixes = ([f"relax {', '.join(relaxed)}"] if relaxed else []) + sorted(
            {r.fix for r in advised if r.fix is not None})
        fix = ", or ".join(fixes) or "no te_swap option converts these layers"
        return (f"te_swap: precision {precision} but no module would run in FP8 (every layer "
                f"kept: {'; '.join(reasons) or 'no linear layers'}); {fix}, or do not ask "
                "for FP8")
    return (f"te_swap: backend te converts layers to TransformerEngine, but precision is "
            f"{precision}, so none of them would run in FP8; set precision: amp_fp8")
