"""Every fact about the language's element types, in one table: each layer that needs a
mapping from a dtype name (its NumPy storage, its torch dtype, its C++ type, the interpreter's
tolerance, a scalar's bits) derives it from TABLE.

A leaf: it imports nothing, not even NumPy (ir/storage.py makes the NumPy dtypes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # the language's name
    bits: int
    is_float: bool
    numpy: str  # the NumPy dtype that stores it ("bfloat16": ml_dtypes')
    torch: str  # torch's name for it (torch.<name>)
    ctype: str  # the C++ type that stores it (runtime_cpp/coconet/dtypes.h)
    compute: str  # the dtype a stage computes it in (f16 and bf16: f32, as PyTorch's "opmath")
    pack: str = ""  # a scalar argument's bits (struct format), where a scalar of it is passed as bits
    tolerance: tuple[float, float] | None = None  # (rtol, atol): the compiled code against the interpreter

    @property
    def itemsize(self) -> int:
        return self.bits // 8


TABLE: dict[str, DType] = {d.name: d for d in (
    DType("f16", 16, True, "float16", "float16", "coconet::half", "f32", "<e", (2e-2, 2e-2)),
    DType("bf16", 16, True, "bfloat16", "bfloat16", "coconet::bfloat16", "f32", "", (6e-2, 6e-2)),
    DType("f32", 32, True, "float32", "float32", "float", "f32", "<f", (2e-4, 1e-5)),
    DType("f64", 64, True, "float64", "float64", "double", "f64", "<d", (1e-9, 1e-12)),
    DType("i32", 32, False, "int32", "int32", "int32_t", "i32", "<i", (0, 0)),
    DType("i64", 64, False, "int64", "int64", "int64_t", "i64", "<q", (0, 0)),
    DType("bool", 8, False, "bool", "bool", "bool", "bool"),  # (masks: no parameter is declared bool)
)}

DTYPES = tuple(n for n in TABLE if n != "bool")  # what a parameter may be declared as
FLOATS = tuple(n for n, d in TABLE.items() if d.is_float)
BITS = {n: d.bits for n, d in TABLE.items()}
