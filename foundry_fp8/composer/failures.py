"""Errors of the device, which no `strict: false` of ours may swallow: out of memory and CUDA
errors are sticky or leave the run's numbers unsafe, so fp8_state and te_swap's autocast raise
them as they came."""

from __future__ import annotations

import re

import torch

# The first line of a CUDA or cuBLAS failure, as each raiser words it: torch's
# "CUDA error: ..." (c10/cuda/CUDAException.cpp; cuBLAS: "CUDA error: CUBLAS_STATUS_... when
# calling ...", ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK) and "CUDA driver error: ..."
# (c10/cuda/driver_api.h); TransformerEngine's "<file>:<line> in function <f>: CUDA Error: ..."
# and "...: cuBLAS Error: ..." (common/util/logging.h NVTE_CHECK_CUDA, NVTE_CHECK_CUBLAS); a
# cuBLAS status name (CUBLAS_STATUS_*) however it is prefixed.
_DEVICE_ERROR_TEXT = re.compile(r"cuda (driver )?error|cublas error|cublas_status_",
                                re.IGNORECASE)


def device_failure(error: Exception) -> bool:
    """An error of the device, not of the checkpoint or of ours: out of memory, or a CUDA error
    (sticky: `strict: false` cannot continue past it), raised as it came. torch 2.8+ raises
    some as `torch.AcceleratorError`; older ones and TE as a RuntimeError known by its text."""
    device_types = (torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", ()))
    return isinstance(error, device_types) or (
        isinstance(error, RuntimeError)
        and _DEVICE_ERROR_TEXT.search((str(error).splitlines() or [""])[0]) is not None)
