"""Pick the device and dtype, and fail clearly when a dtype cannot run where asked."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmul then runs several times faster than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 where the hardware runs it natively, else fp32."""
    name = DTYPE_ALIASES.get(name, name)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    if device.type == "cpu" and name == "float16":
        raise ValueError("float16 is not supported on CPU; use bfloat16 or float32")
    if device.type == "cpu" and name == "bfloat16" and not cpu_has_native_bf16():
        raise ValueError("this CPU has no native bfloat16 (AMX/AVX512-BF16); use float32")
    if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bfloat16; use float16 or float32")
    return DTYPES[name]
