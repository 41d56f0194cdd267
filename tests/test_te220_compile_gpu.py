"""Does `torch.compile(fullgraph=True)` trace TE 2.20.2's layers under FP8? The check behind
FP8050 (foundry_fp8/lint/rules/ours.py `fullgraph_with_fp8_layers`), which says no for every TE
layer: TE's `no_torch_dynamo` on their forwards.

TE 2.20.2 changed te.Linear: its forward has no `no_torch_dynamo` and, while compiling, runs a
registered custom op (module/linear.py:1798, 2397-2404, 2434), falling back to eager with a graph
break where `_compile_eager_fallback_reason` finds a reason (:2640-2684) or the op could not be
registered (dynamo/custom_op.py:1233-1249, utils.py:74-86). te.LayerNormLinear and
te.LayerNormMLP keep `@no_torch_dynamo()` (layernorm_linear.py:1674, layernorm_mlp.py:2272).
On the kit's torch 2.11.0 that custom op is never registered: TE imports
`torch._library.opaque_object.is_opaque_constant_type`, which torch 2.11.0 lacks
(dynamo/custom_op.py:296-306, quantizer_opaque.py:117-137), so `_linear_op` is None and te.Linear's forward calls the
`@no_torch_dynamo()` `_linear_eager` (module/linear.py:1894), a graph break: both layers are
expected refused here (pinned on the CPU in tests/test_s30_gputests_te220.py). With a torch that
has the API, te.Linear under current scaling (a value-opaque quantizer,
tensor/float8_tensor.py:437) could compile; delayed scaling's Float8Quantizer still
graph-breaks (module/linear.py:220-229, 2547-2555).
Composer compiles the model and runs its forward inside TE's autocast (amp_fp8), as here.

Skipped without CUDA; not yet run on a GPU. A failure says which of FP8050's claims the GPU
refuted and what to revise.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.test_te_gpu import _autocast

pytestmark = pytest.mark.gpu

_RULE = "FP8050 (foundry_fp8/lint/rules/ours.py fullgraph_with_fp8_layers, its `why`)"


def _fullgraph_step(kind: str) -> tuple[bool | None, str]:
    """(compiled, what happened): one FP8 forward and backward of a tiny TE layer compiled with
    fullgraph=True. compiled is True where it ran, False where Dynamo refused it (FP8050's
    claim), None for any other error; what happened is the error's first line, or TE's compile
    warnings where it ran."""
    te = pytest.importorskip("transformer_engine.pytorch")
    torch._dynamo.reset()
    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.bfloat16, "device": "cuda"}
    layer = (te.Linear(64, 64, **kwargs) if kind == "Linear"
             else te.LayerNormMLP(64, 256, **kwargs))
    # aot_eager: Dynamo's tracing (where a graph break is refused) and AOTAutograd's backward,
    # without Inductor's code generation, which costs lease time and decides nothing here
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with _autocast(te):
                out = compiled(x)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
        except Exception as error:  # Dynamo's Unsupported, or whatever TE raises
            first = (str(error).strip().splitlines() or [""])[0][:300]
            refused = isinstance(error, torch._dynamo.exc.Unsupported)
            return (False if refused else None), f"{type(error).__name__}: {first}"
    assert x.grad is not None and torch.isfinite(x.grad).all()
    said = sorted({str(w.message)[:200] for w in seen if "compile" in str(w.message).lower()})
    return True, "; ".join(said) or "no compile warnings"


@pytest.mark.parametrize(("kind", "revise"), [
    ("Linear", "Revise FP8050 for te.Linear on this TE (its compiled custom-op path, "
     "module/linear.py:2397-2404), keeping LayerNormLinear and LayerNormMLP (no_torch_dynamo), "
     "and te_swap's _refuse_fullgraph for its te.Linear layers."),
    ("LayerNormMLP", "Its forward is excluded from Dynamo in TE 2.20.2 (no_torch_dynamo, "
     "layernorm_mlp.py:2272): revise FP8050 for te.LayerNormMLP on this TE."),
])
def test_te_layers_under_fullgraph_are_refused_as_fp8050_says(kind, revise):
    compiled, what = _fullgraph_step(kind)
    print(f"te.{kind} under fullgraph: {what}")
    assert compiled is not None, f"neither compiled nor refused by Dynamo: {what}"
    assert not compiled, (f"TE's te.{kind} compiled with fullgraph=True under FP8 ({what}): "
                          f"{_RULE} says TE layers' forwards cannot be traced. {revise}")
