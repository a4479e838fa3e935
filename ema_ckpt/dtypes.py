"""torch dtypes by name, without importing torch.

Reading and copying bytes needs only each dtype's name and item size, so byte-level paths run
without importing torch; :func:`torch_dtype` resolves a name when arithmetic is needed.

Example:
    >>> canonical("half"), itemsize("bfloat16"), SAFETENSORS_CODES["float32"]
    ('float16', 2, 'F32')
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._gc import import_module

if TYPE_CHECKING:
    import torch

# Canonical torch dtype names (``str(dtype)`` without ``torch.``) and their item sizes.
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "qint32": 4, "qint8": 1, "quint8": 1, "quint4x2": 1, "quint2x4": 1,
    "bits16": 2, "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}
ALIASES: dict[str, str] = {
    "double": "float64", "float": "float32", "half": "float16", "cdouble": "complex128",
    "cfloat": "complex64", "chalf": "complex32", "long": "int64", "int": "int32",
    "short": "int16", "bit": "uint1",
}
# Every name ``torch.<name>`` may use for a dtype.
TORCH_NAMES: frozenset[str] = frozenset(ITEMSIZES) | frozenset(ALIASES)

# safetensors' dtype codes (its format specification) for the dtypes it stores.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
}


class DtypeName(str):
    """A canonical dtype name that came from a ``torch.<dtype>`` global, not from free text."""

    __slots__ = ()


OUTPUT_DTYPES = ("bfloat16", "float16", "float32", "float64")
"""What floating tensors of an exported checkpoint may be cast to."""
ACCUMULATE_DTYPES = ("float32", "float64")
"""What averages accumulate (and are stored) in."""


def canonical(name: str) -> str:
    """``name`` without aliases: ``"half"`` → ``"float16"``."""
    return ALIASES.get(name, name)


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``."""
    return ITEMSIZES[canonical(name)]


def is_float(name: str) -> bool:
    """Floating point or complex: the dtypes a ``dtype`` cast applies to."""
    return canonical(name).startswith(("float", "bfloat", "complex"))


def name_of(dtype: Any) -> str:
    """The canonical name of a torch dtype (or of a name): ``torch.float`` → ``"float32"``."""
    return canonical(str(dtype).removeprefix("torch."))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; imports torch."""
    import_module("torch")  # the first import of a command's process: see ema_ckpt._gc
    import torch

    value = getattr(torch, canonical(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value
