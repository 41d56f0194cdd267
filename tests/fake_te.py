"""A stand-in `transformer_engine` that keeps TE's contracts (signatures, parameter names,
`_extra_state`, recipe classes) for CPU tests; the `fake_te` fixture installs it."""

from __future__ import annotations

import functools
import importlib.machinery
import io
import os
import pickle
import pickletools
import sys
import types
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from foundry_fp8.te.facts import parse_version, refuses_pickled_extra_state


@dataclass(frozen=True)
class _QParams:  # transformer_engine/common/recipe/__init__.py, QParams
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class _Format(Enum):  # names as TE's Format
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"


@dataclass
class _DelayedScaling:
    margin: int = 0
    fp8_format: _Format = _Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:  # TE's is a pydantic dataclass: it refuses a string format
        if not isinstance(self.fp8_format, _Format):
            raise ValueError(f"fp8_format: input should be a Format member, got "
                             f"{self.fp8_format!r}")


@dataclass
class _CurrentScaling220:
    """TE 2.8-2.20: a `use_power_2_scales` field, but the QParams te.Linear reads are class
    attributes built from the field's default (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES)."""

    use_power_2_scales: bool = False
    fp8_format: _Format = _Format.HYBRID
    fp8_quant_fwd_inp = _QParams(power_2_scale=use_power_2_scales)
    fp8_quant_fwd_weight = _QParams(power_2_scale=use_power_2_scales)
    fp8_quant_bwd_grad = _QParams(power_2_scale=use_power_2_scales)


@dataclass
class _CurrentScaling22:
    """TE 2.2-2.7: no `use_power_2_scales` field at all."""

    fp8_format: _Format = _Format.HYBRID
    fp8_quant_fwd_inp = _QParams()
    fp8_quant_fwd_weight = _QParams()
    fp8_quant_bwd_grad = _QParams()


def _no_bias(device: Any, dtype: torch.dtype | None) -> torch.Tensor:
    """What TE keeps as a bias-free GEMM's bias: an empty plain tensor, not None and not a
    parameter (`torch.Tensor().to(dtype=params_dtype, device=device)`: module/linear.py:877,
    layernorm_mlp.py:1382 at v1.12; linear.py:1721, layernorm_mlp.py:2120, 2138 at v2.18)."""
    return torch.Tensor().to(dtype=dtype or torch.get_default_dtype(), device=device)


def _param(shape: tuple[int, ...], device: Any, dtype: torch.dtype | None) -> torch.nn.Parameter:
    """TE's parameter contract (module/base.py, reset_parameters): allocated on `device`, and
    initialised unless `device == "meta"`, materialising a meta tensor (on CUDA in TE)."""
    tensor = torch.empty(shape, device=device, dtype=dtype or torch.get_default_dtype())
    if not device == "meta" and tensor.is_meta:
        tensor = torch.empty_like(tensor, device="cpu")
    return torch.nn.Parameter(tensor.normal_() if not tensor.is_meta else tensor)


#: The keys of TE's pickled delayed-scaling state (TE 2.20.2 pytorch/_extra_state.py:25-30).
_DELAYED_STATE_KEYS = {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"}
#: TE's recipe classes by checkpoint policy (TE 2.20.2 pytorch/_extra_state.py:54-61).
_RECIPE_MODULE = "transformer_engine.common.recipe"
_KNOWN_RECIPES = {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
                  "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"}
_STRING_OPCODES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                   "BINUNICODE8", "SHORT_BINUNICODE"}
_UNSAFE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def _unsafe_pickle(data: bytes) -> bool:
    """TE 2.20.2's verdict on a pickled extra state (pytorch/_extra_state.py:113-187, read
    without unpickling): ignored when it resolves no global and holds no delayed-scaling key,
    or names a recipe whose class TE knows and keeps no state (current scaling); unsafe
    otherwise (delayed scaling, TE 1.x's recipe-less state, an unknown payload). No bytes at
    all are ignored (l. 115-116), not an unreadable payload."""
    if not data:
        return False
    try:
        strings: list[str] = []
        recipes: set[str] = set()
        found_global = False
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in _STRING_OPCODES:
                strings.append(arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg)
            elif opcode.name in ("GLOBAL", "STACK_GLOBAL"):
                found_global = True
                ref = tuple(arg.split()) if opcode.name == "GLOBAL" else tuple(strings[-2:])
                if len(ref) == 2 and ref[0] == _RECIPE_MODULE and ref[1] in _KNOWN_RECIPES:
                    recipes.add(ref[1])
    except Exception:  # TE: a payload it cannot read is unsafe
        return True
    delayed = bool(_DELAYED_STATE_KEYS & set(strings))
    if not found_global and not delayed:
        return False
    return (delayed or "recipe" not in strings or not recipes or "DelayedScaling" in recipes)


class _TEModule(torch.nn.Module):
    """TE's `_extra_state` contract for a module that never ran in FP8 (the stand-in never does:
    it holds no FP8 state), by the installed version (`te_version`). Saved (pytorch/module/
    base.py `get_extra_state`): an empty uint8 tensor from TE 2.4 (base.py:1388-1389 in 2.20.2;
    v2.4:768-769), a pickled None in a uint8 tensor in 2.0-2.3, a `torch.save`d None in a
    BytesIO in 1.x. Loaded (`set_extra_state`): None, and from 2.4 an empty tensor, are no
    state; older TE unpickles any tensor (an empty one fails); the TE_PICKLE_GUARD releases
    (`facts.refuses_pickled_extra_state`) refuse a delayed-scaling or unknown pickle, and any
    BytesIO, unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is "1" (base.py:1419-1443 in 2.20.2)."""

    te_version: tuple[int, ...] = (2, 20, 2)
    #: the first TE whose `set_extra_state` skips an empty tensor, and whose save of no state is one
    empty_from: tuple[int, ...] = (2, 4)

    def get_extra_state(self) -> Any:
        if self.te_version >= self.empty_from:
            return torch.empty(0, dtype=torch.uint8)
        if self.te_version >= (2,):
            return torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)
        saved = io.BytesIO()
        torch.save(None, saved)
        return saved

    def set_extra_state(self, state: Any) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0
                             and self.te_version >= self.empty_from):
            return
        guarded = refuses_pickled_extra_state(self.te_version)
        allowed = os.environ.get(_UNSAFE_ENV, "0") == "1"
        refusal = (f"Refusing to load pickled Transformer Engine extra state for "
                   f"{type(self).__name__}. To load it anyway, set {_UNSAFE_ENV}=1.")
        if isinstance(state, torch.Tensor):
            data = state.detach().cpu().numpy().tobytes()
            if guarded and not _unsafe_pickle(data):
                return
            if guarded and not allowed:
                raise RuntimeError(refusal)
            pickle.loads(data)  # the stand-in has no FP8 state to restore
        elif isinstance(state, io.BytesIO):
            if guarded and not allowed:
                raise RuntimeError(refusal)
            state.seek(0)
            torch.load(state, weights_only=False)
        else:
            raise RuntimeError("Unsupported checkpoint format.")


#: TE's default weight init, `utils.get_default_init_method` (N(0, 0.023)), TE 1.12-2.20.
TE_DEFAULT_INIT_STD = 0.023


class _GemmModule(_TEModule):
    """TE's GEMM modules' FP8 bookkeeping as outside TE's autocast, where the stand-in always
    runs (TransformerEngineBaseModule, module/base.py in 2.20.2: `fp8_meta` and `fp8` set in
    `__init__`, l. 899-904; `init_fp8_metadata`, l. 1528-1552, building no scaling state while
    FP8 is off). Code that finds TE's FP8 modules by them (`probe.is_te_fp8_module`) sees these.
    TE >= 2.4 also keeps a `name` (the debug API's layer name; module/linear.py:999, 1013 at
    v2.4, `name: Optional[str] = None` on Linear and LayerNormMLP to 2.20.2)."""

    def __init__(self, name: str | None) -> None:
        super().__init__()
        if self.te_version >= (2, 4):
            self.name = name
        self.fp8, self.fp8_initialized = False, False
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        del num_gemms
        self.fp8, self.fp8_initialized = False, False
        self.fp8_meta["fp8_checkpoint"] = False


class _Linear(_GemmModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device: Any = "cuda",
                 init_method: Any = None, name: str | None = None) -> None:
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features  # linear.py:1593-1594
        self.use_bias = bias
        self.weight = _param((out_features, in_features), device, params_dtype)
        self.bias = (_param((out_features,), device, params_dtype) if bias
                     else _no_bias(device, params_dtype))
        # module/linear.py (register_parameter's init_fn): the weight's is `init_method` or
        # TE's default, the bias's zeros
        self.init_fns = {"weight": init_method or functools.partial(
            torch.nn.init.normal_, mean=0.0, std=TE_DEFAULT_INIT_STD),
            "bias": torch.nn.init.zeros_}

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """module/base.py `reset_parameters`: a meta parameter is materialised (on CUDA in TE,
        here on the CPU), its init_fn run on it and the result wrapped as a parameter again."""
        if defer_init:
            return
        for name, param in list(self.named_parameters(recurse=False)):
            if param.is_meta:
                param = torch.empty_like(param, device="cpu")
            self.init_fns[name](param)
            setattr(self, name, torch.nn.Parameter(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.use_bias else None)


#: TE's non-gated activations the stand-in computes (pytorch/module/layernorm_mlp.py `_act_func`,
#: v1.12 l. 63-75: `tex.gelu` is the tanh form, common/util/math.h); TE raises this
#: NotImplementedError in the forward for a name it lacks.
_ACTIVATIONS = {"gelu": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


class _LayerNormMLP(_GemmModule):
    """TE's keywords and checks (`LayerNormMLP.__init__`, layernorm_mlp.py:1948-1984 at v2.18,
    1268-1299 at v1.12: the same for these), parameters and forward formulas
    (`te.facts.LN_MLP_NORMALIZATIONS`)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, normalization: str = "LayerNorm", activation: str = "gelu",
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device: Any = "cuda", name: str | None = None) -> None:
        super().__init__(name)
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        self.normalization, self.activation = normalization, activation
        self.zero_centered_gamma = zero_centered_gamma
        self.layer_norm_weight = _param((hidden_size,), device, params_dtype)
        self.layer_norm_bias = (_param((hidden_size,), device, params_dtype)
                                if normalization != "RMSNorm" else None)
        # TE's registration order (layernorm_mlp.py:2089-2149 in 2.20.2), hence parameters()
        # and the optimizer's: each GEMM's weight, then its bias
        self.use_bias = bias
        self.fc1_weight = _param((ffn_hidden_size, hidden_size), device, params_dtype)
        self.fc1_bias = (_param((ffn_hidden_size,), device, params_dtype) if bias
                         else _no_bias(device, params_dtype))
        self.fc2_weight = _param((hidden_size, ffn_hidden_size), device, params_dtype)
        self.fc2_bias = (_param((hidden_size,), device, params_dtype) if bias
                         else _no_bias(device, params_dtype))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """TE's formulas, in fp32 as TE's kernels and its reference (tests/pytorch/
        test_numerics.py TorchRMSNorm, l. 383-406 at v2.18) compute them."""
        gamma = self.layer_norm_weight.float() + (1 if self.zero_centered_gamma else 0)
        x32 = x.float()
        if self.normalization == "RMSNorm":
            y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * gamma
        else:
            mean = x32.mean(-1, keepdim=True)
            var = (x32 - mean).square().mean(-1, keepdim=True)
            y = (x32 - mean) * torch.rsqrt(var + self.eps) * gamma + self.layer_norm_bias.float()
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation not in _ACTIVATIONS:
            raise NotImplementedError("Activation type " + self.activation + " is not supported!")
        fc1_bias, fc2_bias = (self.fc1_bias, self.fc2_bias) if self.use_bias else (None, None)
        x = _ACTIVATIONS[self.activation](F.linear(self._norm(x), self.fc1_weight, fc1_bias))
        return F.linear(x, self.fc2_weight, fc2_bias)


class _LayerNormOp(_TEModule):
    """TE >= 1.13 (te.ops.LayerNorm): keyword-only eps/device/dtype. Its op saves no state as
    an empty tensor and skips one on load in every release (pytorch/ops/op.py, v1.13:589-590;
    2.20.2:702-703, 713-714)."""

    empty_from = (1, 13)

    def __init__(self, normalized_shape: Any, *, eps: float = 1e-5, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.weight, self.bias = _param(shape, device, dtype), _param(shape, device, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _LayerNorm112(_TEModule):
    """TE 1.12: `hidden_size` (an int) and `params_dtype`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device: Any = "cuda") -> None:
        super().__init__()
        assert isinstance(hidden_size, int)
        self.weight = _param((hidden_size,), device, params_dtype)
        self.bias = _param((hidden_size,), device, params_dtype)


#: The keywords TE's checkpoint takes for itself (pytorch/distributed.py:609-637 at v1.12,
#: 700-728 at v2.18); it passes every other keyword to the checkpointed function.
_TE_CHECKPOINT_KWARGS = ("use_reentrant", "distribute_saved_activations", "tp_group",
                         "get_rng_state_tracker", "context_fn", "determinism_check", "debug")


@dataclass
class CheckpointCall:
    """One call of the stand-in's `te.checkpoint`: TE's own keywords and the function's."""

    function: Any
    args: tuple
    te_kwargs: dict[str, Any]
    function_kwargs: dict[str, Any]


def _checkpoint_function(calls: list[CheckpointCall]) -> Any:
    """`te.checkpoint(function, *args, **kwargs)` (TE >= 1.12's signature) that records each
    call in `calls` and recomputes with torch's non-reentrant checkpoint (the stand-in's modules
    have no FP8 state to recompute under); the function's keywords reach the function, as in
    TE."""

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        te_kwargs = {k: kwargs.pop(k) for k in _TE_CHECKPOINT_KWARGS if k in kwargs}
        calls.append(CheckpointCall(function, args, te_kwargs, dict(kwargs)))
        extra = {"context_fn": te_kwargs["context_fn"]} if "context_fn" in te_kwargs else {}
        return torch.utils.checkpoint.checkpoint(functools.partial(function, **kwargs), *args,
                                                 use_reentrant=False, **extra)

    checkpoint.calls = calls
    return checkpoint


def install_fake_te(monkeypatch: pytest.MonkeyPatch, version: str = "2.20.2") -> None:
    """Install a stand-in TE of `version`. The version the product code sees is the
    stand-in's, even where a real TE is installed (whose distribution metadata `te_version`
    would otherwise read)."""
    from foundry_fp8.te import probe

    monkeypatch.setattr(probe, "te_version", lambda: parse_version(version))
    monkeypatch.setattr(probe, "te_builds_without_cuda", lambda: True)  # the stand-in computes
    # on the CPU; real TE refuses to build a module without CUDA
    monkeypatch.setattr(_TEModule, "te_version", parse_version(version))
    root = types.ModuleType("transformer_engine")
    root.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    root.__version__ = version
    pytorch, common, recipe = (types.ModuleType(f"transformer_engine.{n}")
                               for n in ("pytorch", "common", "common.recipe"))
    new = parse_version(version) >= (1, 13)
    for cls in (_Linear, _LayerNormMLP, _LayerNormOp, _LayerNorm112):
        cls.__module__ = "transformer_engine.pytorch.module"
    _Linear.__name__, _LayerNormMLP.__name__ = "Linear", "LayerNormMLP"  # as TE's GEMM modules
    pytorch.Linear, pytorch.LayerNormMLP = _Linear, _LayerNormMLP
    pytorch.LayerNorm = _LayerNormOp if new else _LayerNorm112
    pytorch.checkpoint = _checkpoint_function([])  # `.calls`: what it was called with
    recipe.Format, recipe.DelayedScaling, recipe.QParams = _Format, _DelayedScaling, _QParams
    if parse_version(version) >= (2, 2):
        recipe.Float8CurrentScaling = (_CurrentScaling220 if parse_version(version) >= (2, 8)
                                       else _CurrentScaling22)
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    for module in (root, pytorch, common, recipe):
        monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.fixture
def fake_te(monkeypatch):
    """`install_fake_te(version)` for this test (undone after it)."""
    return functools.partial(install_fake_te, monkeypatch)
