"""TE's FP8 GEMM shape rule, in one place for `te_swap`'s plan and the linter (no torch).

A GEMM input's last dim must be divisible by 16 and the product of its leading dims by 8
(transformer_engine/pytorch/utils.py, assert_dim_for_fp8_exec).
"""

from __future__ import annotations

FP8_DIM_MULTIPLE = 16
FP8_TOKEN_MULTIPLE = 8


def dim_fits_fp8(n: int) -> bool:
    """Whether a GEMM's inner (last) dimension suits TE's FP8 kernels."""
    return n % FP8_DIM_MULTIPLE == 0


def tokens_fit_fp8(tokens: int) -> bool:
    """Whether the leading dims' product (tokens per micro-batch) suits TE's FP8 kernels."""
    return tokens % FP8_TOKEN_MULTIPLE == 0
