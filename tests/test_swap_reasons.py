"""te_swap's refusal advises from what each keep reason says converts its layers (filters.Reason),
not from the reasons' wording: before, swap.py matched substrings of filters.py's words ("by
include", "(keep_lm_head)"), so a reworded reason fell through to "no te_swap option converts
these layers"; it never suggested backend te where fusing needs it, and advised "relax
tokens_per_microbatch", which describes the micro-batch, not a filter."""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import pickle

import pytest
from torch import nn

from foundry_fp8 import filters
from foundry_fp8.filters import RELAXABLE, Reason
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8, plan_swap


def _returned(node: ast.expr) -> list[ast.expr]:
    """The expressions a `return` can give: through `a or b` and `x if c else y`."""
    if isinstance(node, ast.BoolOp):
        return [leaf for value in node.values for leaf in _returned(value)]
    if isinstance(node, ast.IfExp):
        return _returned(node.body) + _returned(node.orelse)
    return [node]


def _called(node: ast.expr) -> str | None:
    return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None


def test_every_reason_filters_gives_says_what_converts_it():
    """Each `*_reason` of filters.py returns None, a Reason (relax and fix given, relax one of
    RELAXABLE or None), another `*_reason`'s answer, or a name bound to one: no bare words,
    which would reach the refusal with no advice."""
    tree = ast.parse(inspect.getsource(filters))
    functions = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.endswith("_reason")]
    assert {f.name for f in functions} >= {"filter_reason", "shape_reason", "gemm_reason",
                                           "backend_reason", "linear_reason",
                                           "layernorm_reason", "fuse_reason"}
    for function in functions:
        bound = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)
                 if all(_called(v) is not None and _called(v).endswith("_reason")
                        for v in _returned(node.value))}
        for node in ast.walk(function):
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            for value in _returned(node.value):
                ok = ((isinstance(value, ast.Constant) and value.value is None)
                      or _called(value) == "Reason"
                      or (_called(value) or "").endswith("_reason")
                      or (isinstance(value, ast.Name) and value.id in bound))
                assert ok, f"{function.name} line {value.lineno}: {ast.unparse(value)}"
    for call in (n for n in ast.walk(tree) if _called(n) == "Reason"):
        keywords = {k.arg: k.value for k in call.keywords}
        assert set(keywords) == {"relax", "fix"}, ast.unparse(call)
        relax = keywords["relax"]
        assert isinstance(relax, ast.Constant), ast.unparse(call)
        assert relax.value is None or relax.value in RELAXABLE, ast.unparse(call)
    with pytest.raises(TypeError):
        Reason("kept")  # type: ignore[call-arg]  # no default: each reason says it


def test_each_relaxable_option_is_a_te_swap_option():
    fields = {f.name for f in dataclasses.fields(SwapConfig)}
    for option in RELAXABLE:
        names = (["keep_first_blocks", "keep_last_blocks"]
                 if option == "keep_first/last_blocks" else [option])
        assert set(names) <= fields, option


_N_BLOCKS = 4
_CASES = [  # (config, reason call, relax, fix, the config with the advice taken)
    ({"keep_first_blocks": 1}, ("linear", "blocks.0.ffn.up_proj"), "keep_first/last_blocks",
     None, {"keep_first_blocks": 0}),
    ({"keep_last_blocks": 1}, ("linear", "blocks.3.ffn.up_proj"), "keep_first/last_blocks",
     None, {"keep_last_blocks": 0}),
    ({"include": "attn"}, ("linear", "blocks.1.ffn.up_proj"), "include", None,
     {"include": None}),
    ({"exclude": "ffn"}, ("linear", "blocks.1.ffn.up_proj"), "exclude", None,
     {"exclude": None}),
    ({"module_filter_fn": lambda module, name: False}, ("linear", "blocks.1.ffn.up_proj"),
     "module_filter_fn", None, {"module_filter_fn": None}),
    ({"min_gemm_size": 128}, ("linear", "blocks.1.ffn.up_proj"), "min_gemm_size", None,
     {"min_gemm_size": 0}),
    ({}, ("linear", "lm_head"), "keep_lm_head", None, {"keep_lm_head": False}),
    ({"tokens_per_microbatch": 12}, ("linear", "blocks.1.ffn.up_proj"), None,
     "make the tokens per micro-batch a multiple of 8", {"tokens_per_microbatch": 16}),
    ({}, ("linear", "wte_proj"), None, None, None),
    ({}, ("odd", "blocks.1.ffn.up_proj"), None, None, None),
    ({"backend": "emulate"}, ("layernorm", "blocks.1.norm_1"), None, None, None),
    ({"backend": "te"}, ("layernorm_no_bias", "blocks.1.norm_1"), None, None, None),
    ({"backend": "emulate"}, ("fuse", "blocks.1.ffn"), None,
     "set backend te and precision amp_fp8", {"backend": "te"}),
    ({"backend": "emulate", "include": "attn"}, ("fuse", "blocks.1.ffn"), None, None, None),
]


def _reason(kind: str, name: str, config: SwapConfig) -> str | None:
    if kind == "linear":
        return filters.linear_reason(name, 64, 256, config, _N_BLOCKS)
    if kind == "odd":
        return filters.linear_reason(name, 64, 250, config, _N_BLOCKS)
    if kind in ("layernorm", "layernorm_no_bias"):
        return filters.layernorm_reason(name, kind == "layernorm", config, _N_BLOCKS)
    return filters.fuse_reason(name, 64, 256, config, _N_BLOCKS)


@pytest.mark.parametrize(("options", "call", "relax", "fix", "taken"), _CASES)
def test_each_reason_names_the_change_that_converts_its_module(options, call, relax, fix, taken):
    """Every branch of filters.py's reasons, with the relax/fix a user would read, and the
    check that taking that advice does convert the module (no reason left)."""
    config = SwapConfig(**options)
    reason = _reason(*call, config)
    assert isinstance(reason, Reason)
    assert (reason.relax, reason.fix) == (relax, fix)
    if taken is not None:
        assert _reason(*call, dataclasses.replace(config, **taken)) is None


def _mpt_like() -> nn.Module:
    """Two MPT blocks (norm_2 + LLM-Foundry's MPTMLP with GELU up/down_proj), as te_swap's
    fusion reads them: it fuses an ffn whose forward is MPTMLP's only."""
    from llmfoundry.models.layers.ffn import MPTMLP

    model = nn.Module()
    model.blocks = nn.ModuleList()
    for _ in range(2):
        block = nn.Module()
        block.norm_2 = nn.LayerNorm(64)
        block.ffn = MPTMLP(d_model=64, expansion_ratio=4, fc_type={"name": "torch"},
                           act_fn=functools.partial(nn.functional.gelu, approximate="none"))
        model.blocks.append(block)
    return model


def test_a_refusal_where_only_backend_te_fuses_says_so():
    """`include: ffn$` matches the blocks' ffn, not their linears: on the emulated backend
    nothing converts, while backend te fuses every norm_2+MLP into an FP8 te.LayerNormMLP."""
    config = SwapConfig(backend="emulate", include="ffn$", fuse_ln_mlp=True)
    with pytest.raises(ValueError) as refusal:
        convert_to_fp8(_mpt_like(), config)
    assert str(refusal.value).endswith(
        "; relax include, or set backend te and precision amp_fp8, or do not ask for FP8")
    te_plan = plan_swap(_mpt_like(), dataclasses.replace(config, backend="te"))
    assert sorted(d.name for d in te_plan.converted) == ["blocks.0.ffn", "blocks.1.ffn"]
    assert {d.kind for d in te_plan.converted} == {"ln_mlp"}


def test_a_refusal_does_not_offer_backend_te_for_layernorms_alone():
    """te.LayerNorm is no FP8 module: with backend te the same model is refused too."""
    config = SwapConfig(backend="emulate", include="norm", convert_layernorm=True)
    with pytest.raises(ValueError) as refusal:
        convert_to_fp8(_mpt_like(), config)
    assert str(refusal.value).endswith("; relax include, or do not ask for FP8")
    with pytest.raises(ValueError, match="no module would run in FP8"):
        convert_to_fp8(_mpt_like(), dataclasses.replace(config, backend="te"))


def test_a_refusal_for_the_tokens_per_microbatch_says_to_change_the_micro_batch():
    with pytest.raises(ValueError) as refusal:
        convert_to_fp8(_mpt_like(), SwapConfig(backend="emulate", tokens_per_microbatch=12))
    message = str(refusal.value)
    assert message.endswith(
        "; make the tokens per micro-batch a multiple of 8, or do not ask for FP8")
    assert "relax" not in message
    plan = convert_to_fp8(_mpt_like(), SwapConfig(backend="emulate", tokens_per_microbatch=16))
    assert len(plan.converted) == 4


def test_a_plan_copies_and_pickles_with_its_advice():
    plan = plan_swap(_mpt_like(), SwapConfig(backend="emulate", include="attn"))
    for copied in (copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        reasons = [d.reason for d in copied.decisions]
        assert reasons == [d.reason for d in plan.decisions]
        assert all(isinstance(r, Reason) and r.relax == "include" for r in reasons)
