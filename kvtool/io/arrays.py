"""numpy views of safetensors dtypes, so streaming commands can work without importing torch.

Storage arrays hold the bytes as stored: BF16 as uint16, F8 as uint8. `to_float` widens a storage
array to float32 (float64 for F64) exactly; `from_float` rounds back to a storage dtype with
round-to-nearest-even, as torch's casts do. Importing torch costs ~2 CPU-seconds and ~200 MiB,
more than mean-pooling a 1 GB checkpoint, so `kvtool convert --method mean` never does.

`mean_groups_bf16` / `repeat_groups_bf16` pool BF16 storage arrays directly, bit-identical to
widening, pooling in float64 and rounding back, but block by block: the whole-array round trip
cost more than copying the rest of a checkpoint (issue 18).
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
        return np.left_shift(a, 16, dtype=np.uint32).view(np.float32)  # one pass, no uint32 temporary
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


# Elements per block: the float64 accumulator and uint32 temporaries (~20 bytes an element) stay
# in the CPU's cache, where a pass costs a fraction of one over main memory.
_BLOCK = 1 << 15


def mean_groups_bf16(groups: np.ndarray) -> np.ndarray:
    """BF16 storage [G, r, n] (uint16) -> [G, n]: the mean of each group's r rows, as BF16 storage.

    Bit-identical to `from_float((sum of to_float(row_i) in float64, i = 0..r-1) / r -> float32, "BF16")`:
    each block is widened exactly, summed in float64 in row order, divided by r, rounded to float32,
    then to BF16 (nearest even; a NaN stays a quiet NaN).
    """
    G, r, n = groups.shape
    out = np.empty((G, n), np.uint16)
    B = max(1, min(n, _BLOCK))
    wide_buf, acc_buf, tmp_buf = np.empty(B, np.uint32), np.empty(B, np.float64), np.empty(B, np.uint32)
    for j in range(G):
        for a in range(0, n, B):
            b = min(n, a + B)
            wide, acc, tmp = wide_buf[:b - a], acc_buf[:b - a], tmp_buf[:b - a]
            f = wide.view(np.float32)
            np.left_shift(groups[j, 0, a:b], 16, out=wide, dtype=np.uint32)
            np.copyto(acc, f)
            for i in range(1, r):
                np.left_shift(groups[j, i, a:b], 16, out=wide, dtype=np.uint32)
                np.add(acc, f, out=acc)
            np.divide(acc, r, out=acc)
            np.copyto(f, acc, casting="same_kind")  # float64 -> float32, nearest even (as astype)
            # float32 -> BF16, nearest even: (u + 0x7FFF + ((u >> 16) & 1)) >> 16, in uint32 as from_float
            np.right_shift(wide, 16, out=tmp)
            np.bitwise_and(tmp, 1, out=tmp)
            np.add(tmp, 0x7FFF, out=tmp)
            np.add(tmp, wide, out=tmp)
            np.right_shift(tmp, 16, out=tmp)
            np.copyto(out[j, a:b], tmp, casting="unsafe")
            nan = np.isnan(f)
            if nan.any():  # keep NaN a NaN (rounding could carry it into infinity)
                out[j, a:b][nan] = ((wide[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out


def repeat_groups_bf16(heads: np.ndarray, times: int) -> np.ndarray:
    """BF16 storage [KV, ...] -> [KV * times, ...], each head repeated; NaNs made quiet, as from_float does."""
    out = np.repeat(heads, times, axis=0)
    nan = (out & np.uint16(0x7FFF)) > np.uint16(0x7F80)
    if nan.any():
        out[nan] |= np.uint16(0x0040)
    return out
