"""TE's FP8 GEMM shape rules, in one place for `te_swap`'s plan, the linter, bench and the
emulation (no torch).

Forward: each GEMM operand (input, and weight [out, in]) needs its last dim divisible by 16
and the product of its leading dims by 8 (transformer_engine/pytorch/utils.py,
assert_dim_for_fp8_exec). Backward on Hopper: the inner dims of the FP8 weight-gradient GEMM
(the tokens) and input-gradient GEMM (out_features) by 16 (common/gemm/cublaslt_gemm.cu).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

FP8_DIM_MULTIPLE = 16
FP8_TOKEN_MULTIPLE = 8


def dim_fits_fp8(n: int) -> bool:
    """Whether a GEMM's inner dimension suits TE's FP8 kernels: an operand's last dim, and in
    the backward the tokens (weight-gradient GEMM) and out_features (input-gradient GEMM)."""
    return n % FP8_DIM_MULTIPLE == 0


def tokens_fit_fp8(tokens: int) -> bool:
    """Whether the leading dims' product (tokens per micro-batch) suits TE's FP8 kernels."""
    return tokens % FP8_TOKEN_MULTIPLE == 0


def operand_fits_fp8(shape: Sequence[int]) -> bool:
    """Whether TE's FP8 forward accepts a GEMM operand of this shape (assert_dim_for_fp8_exec)."""
    return tokens_fit_fp8(math.prod(shape[:-1])) and dim_fits_fp8(shape[-1])
