"""vLLM 0.33's own KV-cache code, run here as it is: the whole files under tests/data/vllm/0.33.0/reference/
(tests/data/vllm/extract.py --reference) and the cache-writing kernels beside them in tests/data/vllm/0.33.0/
(triton_reshape_and_cache_flash.py, int4_per_token_head.py: the excerpts kv_emulations.json cites), imported as
modules. The one helper that runs vLLM's Triton kernels under TRITON_INTERPRET=1 (`interpreted`, KERNELS).

vLLM's GPU wheel does not install on the CPU test machines, so its package is stood in for by the few names
these files import from it, with what they use of them on a CUDA SM89+ machine (`_stubs`): `vllm.triton_utils`
(triton itself), `vllm.platforms` (a platform that is neither CUDA nor ROCm, whose fp8 dtype is float8_e4m3fn;
is_xpu true keeps the store launchers off torch.cuda, is_cuda false keeps int4's Hadamard on vLLM's PyTorch
butterfly), FP8_DTYPE and its min / max, KVQuantMode (the values of vllm/v1/kv_cache_interface.py),
largest_power_of_2_divisor (vllm/utils/math_utils.py: `n & (-n)`), and the read kernels' helpers as None (only
the read kernels, never run here, call them). Those stand-ins live in sys.modules only while a file loads.
Triton kernels run on the CPU through Triton's interpreter, in a child process (`interpreted`): TRITON_INTERPRET=1
must be set before triton is first imported (triton.language's own jit helpers are decorated then), and
transformers imports triton in the test process. Each file is copied to a temporary .py so Triton can read its
source.
"""

from __future__ import annotations

import atexit
import enum
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

RELEASE = "0.33.0"
DIR = Path(__file__).resolve().parents[2] / "data" / "vllm" / RELEASE / "reference"
_TMP = Path(tempfile.mkdtemp(prefix="kvtool-vllm-ref-"))
atexit.register(shutil.rmtree, _TMP, True)
_LOADED: dict[str, types.ModuleType] = {}


def excerpt(source: str, name: str) -> str:
    """One excerpt (`# --- name (lines ...)`) of tests/data/vllm/0.33.0/vllm__<source>.txt, the code only."""
    text = (DIR.parent / ("vllm__" + source.replace("/", "__") + ".txt")).read_text(encoding="utf-8")
    return next(b.partition("\n")[2] for b in text.split("\n# --- ")[1:] if b.startswith(name + " (lines"))


def _stubs() -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops",
                 "vllm.v1.attention.ops.ultraquant", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.turboquant"):
        m = types.ModuleType(name)
        m.__path__ = []  # a package
        mods[name] = m
    try:
        import triton
        import triton.language as tl
    except ImportError:  # the reference files without Triton still load
        triton = tl = None
    import torch

    def mod(name: str, **attrs) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m

    finfo = torch.finfo(torch.float8_e4m3fn)
    mod("vllm.triton_utils", triton=triton, tl=tl)
    mod("vllm.platforms", current_platform=types.SimpleNamespace(
        is_cuda_alike=lambda: False, is_rocm=lambda: False, is_xpu=lambda: True, is_cuda=lambda: False,
        fp8_dtype=lambda: torch.float8_e4m3fn, is_fp8_fnuz=lambda: False, has_device_capability=lambda *a: True))
    mod("vllm.model_executor.layers.quantization.utils.quant_utils", FP8_DTYPE=torch.float8_e4m3fn,
        get_fp8_min_max=lambda: (finfo.min, finfo.max))
    mod("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode,
        is_quantized_kv_cache=lambda s: s not in ("auto", "float16", "bfloat16", "float32", "half", "float"))
    mod("vllm.utils.math_utils", largest_power_of_2_divisor=lambda n: n & (-n))
    helpers = ("apply_alibi_to_score", "apply_softcap", "cdiv_fn", "compute_kv_seq_mask", "compute_tile_loop_bounds",
               "init_softmax_M", "load_qq_bias_tile", "resolve_seq_and_query_len", "softmax_step",
               "store_segm_reduce_scalars")
    mod("vllm.v1.attention.ops.triton_attention_helpers", **{h: None for h in helpers})
    mod("vllm.v1.attention.ops.triton_unified_attention", reduce_segments=None)
    return mods


class KVQuantMode(enum.IntEnum):  # vllm/v1/kv_cache_interface.py, the values the store kernels dispatch on
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


def _file(source: str) -> Path:
    """The verbatim copy of vllm/<source>: under reference/, else beside it (the excerpts tables cite)."""
    name = "vllm__" + source.replace("/", "__") + ".txt"
    return DIR / name if (DIR / name).is_file() else DIR.parent / name


def load(source: str) -> types.ModuleType:
    """The module of vllm/<source> (e.g. "v1/attention/ops/rocm_octave.py"), loaded once per process."""
    name = "vllm." + source.removesuffix(".py").replace("/", ".")
    if name in _LOADED:
        return _LOADED[name]
    text = _file(source).read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM {RELEASE}, vllm/{source} "), source
    path = _TMP / (name.replace(".", "_") + ".py")
    path.write_text(text, encoding="utf-8")
    stubs = _stubs()
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "vllm" or k.startswith("vllm.")}
    try:
        sys.modules.update(stubs)
        sys.modules.update(_LOADED)
        deps = {"v1/attention/ops/ultraquant/reference.py": ["v1/attention/ops/ultraquant/format.py"],
                "v1/attention/ops/ultraquant/triton_store.py": ["v1/attention/ops/ultraquant/format.py"],
                "v1/attention/ops/triton_turboquant_store.py": ["v1/attention/ops/triton_turboquant_decode.py"],
                "v1/attention/ops/triton_turboquant_decode.py": ["v1/attention/ops/triton_decode_attention.py"]}
        for dep in deps.get(source, []):
            sys.modules["vllm." + dep.removesuffix(".py").replace("/", ".")] = load(dep)
            sys.modules.update(stubs)  # the nested load restored sys.modules
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    _LOADED[name] = module
    return module


# --- Triton kernels, interpreted in a child process -------------------------------------------------------------
def _tq_store(job: dict) -> dict:
    """vLLM's TurboQuant store kernel on job's K / V ([N, H, D]), then its `_tq_full_dequant_kv` on that cache."""
    import math

    import torch

    store = load("v1/attention/ops/triton_turboquant_store.py")
    dec = load("v1/attention/ops/triton_turboquant_decode.py")
    k, v, bs, slot = job["k"], job["v"], job["block_size"], job["slot"]
    n, h, d = k.shape
    blocks = -(-n // bs)
    cache = torch.zeros(blocks, bs, h, slot, dtype=torch.uint8)
    mse_bits, vqb, key_fp8 = job["mse_bits"], job["value_bits"], job["key_fp8"]
    store.triton_turboquant_store(k, v, cache, torch.arange(n, dtype=torch.int32), job["PiT"], job["midpoints"],
                                  mse_bits=mse_bits, key_packed_size=job["kps"], value_quant_bits=vqb,
                                  key_fp8=key_fp8)
    k_out = torch.zeros(1, h, blocks * bs, d, dtype=torch.float16)
    v_out = torch.zeros(1, h, blocks * bs, d, dtype=torch.float16)
    bt = torch.arange(blocks, dtype=torch.int32)[None]
    dec._tq_full_dequant_kv[(n, h)](
        cache, bt, job["centroids"], k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3], *cache.stride()[:3],
        bt.stride(0), HEAD_DIM=d, BLOCK_SIZE=bs, NUM_KV_HEADS=h, MSE_BYTES=math.ceil(d * mse_bits / 8),
        KPS=job["kps"], VQB=vqb, VAL_DATA_BYTES=math.ceil(d * vqb / 8), MSE_BITS=mse_bits, KEY_FP8=int(key_fp8),
        BLOCK_D=d, NORM_CORRECTION=int(job["norm_correction"]))
    return {"cache": cache.reshape(blocks * bs, h, slot)[:n], "k_out": k_out[..., :n, :], "v_out": v_out[..., :n, :]}


def _uq_store(job: dict) -> dict:
    """vLLM's UltraQuant store kernel (`ultraquant_store`) on job's K / V ([N, H, D])."""
    import torch

    from_fmt = load("v1/attention/ops/ultraquant/format.py")
    store = load("v1/attention/ops/ultraquant/triton_store.py")
    k, v = job["k"], job["v"]
    n, h, d = k.shape
    cache = torch.zeros(n, 1, h, from_fmt.slot_size(d), dtype=torch.uint8)
    store.ultraquant_store(k, v, cache, torch.arange(n, dtype=torch.int64))
    return {"cache": cache[:, 0]}


def _tq_decode(job: dict) -> dict:
    """vLLM's TurboQuant decode attention (`triton_turboquant_decode_attention`: stage 1 over the packed cache,
    stage 2 the split reduction) for job's queries [B, Hq, D], each attending over the first seq_lens[b] tokens
    the store kernel wrote from job's K / V."""
    import torch

    dec = load("v1/attention/ops/triton_turboquant_decode.py")
    stored = _tq_store(job)["cache"]
    n, h, slot = stored.shape
    bs = job["block_size"]
    cache = stored.reshape(n // bs, bs, h, slot).contiguous()
    q = job["q"]
    out = dec.triton_turboquant_decode_attention(
        q, cache, torch.arange(n // bs, dtype=torch.int32)[None].expand(q.shape[0], -1).contiguous(),
        job["seq_lens"], job["PiT"], job["centroids"], job["scale"], job["mse_bits"], job["kps"], job["value_bits"],
        key_fp8=job["key_fp8"], norm_correction=job["norm_correction"], PiT=job["PiT"], max_num_kv_splits=4)
    return {"out": out, "cache": stored}


def _flash_store(job: dict) -> dict:
    """vLLM's cache writer (triton_reshape_and_cache_flash.py) on job's "key" / "value" ([tokens, kv_heads,
    head_dim]): "mode" "int8" | "fp8" | "int4" per token-head (its caches and scale caches), or "fp8_tensor" with
    "k_scale" / "v_scale" (uint8 caches holding the platform's fp8); each as [tokens, kv_heads, ...]."""
    import torch

    flash = load("v1/attention/ops/triton_reshape_and_cache_flash.py")
    key, value = job["key"], job["value"]
    tokens, heads, dim = key.shape
    block = 16
    blocks = -(-tokens // block)
    slots = torch.arange(tokens)
    if job["mode"] == "fp8_tensor":  # [blocks, block_size, heads, dim] uint8, viewed as the platform's fp8
        kc = torch.zeros(blocks, block, heads, dim, dtype=torch.uint8)
        vc = torch.zeros_like(kc)
        flash.triton_reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", job["k_scale"], job["v_scale"])
        return {"key_cache": kc.reshape(-1, heads, dim)[:tokens], "value_cache": vc.reshape(-1, heads, dim)[:tokens]}
    dtype, pack, mode = {"int8": (torch.int8, 1, KVQuantMode.INT8_PER_TOKEN_HEAD),
                         "fp8": (torch.float8_e4m3fn, 1, KVQuantMode.FP8_PER_TOKEN_HEAD),
                         "int4": (torch.uint8, 2, KVQuantMode.INT4_PER_TOKEN_HEAD)}[job["mode"]]
    kc = torch.zeros(blocks, block, heads, dim // pack, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(blocks, block, heads, dtype=torch.float32)
    vs = torch.zeros_like(ks)
    int4 = "vllm.v1.attention.ops.int4_per_token_head"  # the dispatcher imports it by name, when it runs
    saved = sys.modules.get(int4)
    sys.modules[int4] = load("v1/attention/ops/int4_per_token_head.py")
    try:
        flash.triton_reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slots,
                                                                  kv_quant_mode=mode)
    finally:
        if saved is None:
            del sys.modules[int4]
        else:
            sys.modules[int4] = saved
    return {"key_cache": kc.reshape(-1, heads, dim // pack)[:tokens],
            "value_cache": vc.reshape(-1, heads, dim // pack)[:tokens],
            "k_scale_cache": ks.reshape(-1, heads)[:tokens], "v_scale_cache": vs.reshape(-1, heads)[:tokens]}


KERNELS = {"tq_store": _tq_store, "uq_store": _uq_store, "tq_decode": _tq_decode, "flash_store": _flash_store}


def interpreted(jobs: dict, folder: Path) -> dict:
    """{key: result} of each job ({"kernel": a KERNELS key, ...tensors}) run by Triton's interpreter in a child
    Python (one process for all of them)."""
    import torch

    src, out = folder / "jobs.pt", folder / "results.pt"
    torch.save(jobs, src)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, str(src), str(out)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


if __name__ == "__main__":
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    todo = torch.load(sys.argv[1])
    torch.save({key: KERNELS[job["kernel"]](job) for key, job in todo.items()}, sys.argv[2])
