"""numpy views of safetensors dtypes, so streaming commands can work without importing torch.

Storage arrays hold the bytes as stored: BF16 as uint16, F8 as uint8. `to_float` widens a storage
array to float32 (float64 for F64) exactly; `from_float` rounds back to a storage dtype with
round-to-nearest-even, as torch's casts do. Importing torch costs ~2 CPU-seconds and ~200 MiB,
more than mean-pooling a 1 GB checkpoint, so `kvtool convert --method mean` never does.
"""

from __future__ import annotations

import numpy as np

STORAGE = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}
FLOAT_CASTABLE = ("F64", "F32", "F16", "BF16")


def storage_dtype(st: str) -> np.dtype:
    try:
        return np.dtype(STORAGE[st]).newbyteorder("<")
    except KeyError:
        raise ValueError(f"no numpy storage for safetensors dtype {st}") from None


def to_float(a: np.ndarray, st: str) -> np.ndarray:
    """Storage array -> float32 (float64 for F64), exactly."""
    if st == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if st == "F64":
        return a.astype(np.float64, copy=False)
    if st in ("F32", "F16"):
        return a.astype(np.float32, copy=False)
    raise ValueError(f"{st} tensors are not floating point here")


def from_float(a: np.ndarray, st: str) -> np.ndarray:
    """float array -> storage array of `st`, rounding to nearest even."""
    if st == "BF16":
        f = np.ascontiguousarray(a, dtype=np.float32)
        u = f.view(np.uint32)
        rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
        nan = np.isnan(f)
        if nan.any():  # keep NaN a NaN (rounding could carry it into infinity)
            rounded[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
        return rounded
    if st == "F64":
        return a.astype(np.float64, copy=False)
    if st == "F32":
        return a.astype(np.float32, copy=False)
    if st == "F16":
        return a.astype(np.float16, copy=False)
    raise ValueError(f"cannot write floats as {st}")


def cast(a: np.ndarray, st_from: str, st_to: str) -> np.ndarray:
    """Storage array of one float dtype -> storage array of another (identity when equal)."""
    if st_from == st_to:
        return a
    return from_float(to_float(a, st_from), st_to)
