"""Option values that can be checked without importing torch.

The command line validates its flags with these before the slow imports (torch alone takes a
second or more), so a usage error prints at once; ``LLM`` uses the same functions.
"""

from __future__ import annotations

import re

# dtype spellings -> torch attribute names (hybridrt.loader maps them to torch dtypes)
DTYPE_NAMES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def check_dtype_name(dtype: str) -> str:
    """'auto' or a known dtype spelling -> it, lower-cased; else ValueError."""
    name = str(dtype).lower()
    if name != "auto" and name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, bfloat16, float16, "
                         f"float32")
    return name


QUANTIZATIONS = ("int8", "int4")


def check_quantization(name: str | None) -> str | None:
    """None / 'none' -> None; 'int8', 'int4' -> it; anything else: ValueError naming the
    choices."""
    if name is None or str(name).lower() == "none":
        return None
    if str(name).lower() not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose int8 or int4 (or none)")
    return str(name).lower()


KV_CACHE_DTYPES = ("auto", "bf16", "int8")  # auto: the model's dtype (kernels/kvquant.py)


def check_kv_cache_dtype(name) -> str:
    """``name`` if it is one of ``KV_CACHE_DTYPES``; ValueError naming the choices otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return name


def check_device_name(device: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' -> it; else ValueError (availability is checked at load)."""
    if device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device):
        return device
    raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def parse_memory(value: int | float | str | None) -> tuple[int | None, float | None]:
    """Cache budget: int bytes, a float fraction in (0, 1] of free memory, or '2GiB'/'512MB'."""
    if value is None:
        return None, None
    if isinstance(value, bool):
        raise ValueError(f"cache_memory must be bytes, a fraction or a size string, got {value!r}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"cache_memory as a fraction must be in (0, 1], got {value}")
        return None, value
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"cache_memory must be positive, got {value}")
        return value, None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse cache_memory {value!r}; use e.g. 4GiB, 512MB or 0.5")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    if unit == "B" and number <= 1.0 and "." in m.group(1):
        return parse_memory(number)
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
             "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}[unit]
    return parse_memory(int(number * scale))
