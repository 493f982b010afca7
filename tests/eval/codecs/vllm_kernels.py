"""vLLM 0.33.0's own cache-writing Triton kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

The files are verbatim copies under tests/data/vllm/0.33.0/ (the first line names the source). They import a few
vLLM modules that pull in the GPU build; the driver stands those in with what the kernels use of them on a CUDA
SM89+ machine: the platform's fp8 dtype (float8_e4m3fn) and its min / max, `tl` / `triton`, KVQuantMode (the
values of vllm/v1/kv_cache_interface.py), largest_power_of_2_divisor (vllm/utils/math_utils.py: `n & (-n)`), and
the read kernels' helpers as None (only the read kernels, never run here, call them).

Triton must see TRITON_INTERPRET=1 when it is first imported (its own @jit library functions are built then), and
reads a jitted function's source from its file: so `store` runs the kernels in a fresh Python (this file as a
script) on tensors saved with torch.save, with each copy written out as a .py file first.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm" / "0.33.0"


def store(cases: list[dict], tmp: Path) -> list[dict]:
    """Each case {"mode": "int8" | "fp8" | "int4" | "fp8_tensor", "key", "value" ([tokens, kv_heads, head_dim]),
    "k_scale", "v_scale" (fp8_tensor)} through vLLM's store kernel; its caches as [tokens, kv_heads, ...]."""
    import torch

    src, dst = tmp / "cases.pt", tmp / "caches.pt"
    torch.save(cases, src)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__, str(src), str(dst), str(tmp)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(dst)


def _stubs(torch, triton, tl) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}

    def mod(name: str, **attrs) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m

    finfo = torch.finfo(torch.float8_e4m3fn)
    # is_xpu: True keeps the launchers off torch.cuda (they pick num_warps / num_stages by it, which the interpreter
    # ignores); is_cuda: False keeps int4's Hadamard on vLLM's PyTorch butterfly (hadacore is a CUDA kernel)
    platform = types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn, is_fp8_fnuz=lambda: False,
                                     is_rocm=lambda: False, is_xpu=lambda: True, is_cuda=lambda: False,
                                     has_device_capability=lambda *a: True)
    mod("vllm.platforms", current_platform=platform)
    mod("vllm.triton_utils", tl=tl, triton=triton)
    mod("vllm.model_executor.layers.quantization.utils.quant_utils", FP8_DTYPE=torch.float8_e4m3fn,
        get_fp8_min_max=lambda: (finfo.min, finfo.max))

    class KVQuantMode(enum.IntEnum):  # vllm/v1/kv_cache_interface.py, the values the store kernels dispatch on
        NONE = 0
        FP8_PER_TENSOR = 1
        INT8_PER_TOKEN_HEAD = 2
        FP8_PER_TOKEN_HEAD = 3
        INT4_PER_TOKEN_HEAD = 4

    mod("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode,
        is_quantized_kv_cache=lambda s: s not in ("auto", "float16", "bfloat16", "float32", "half", "float"))
    mod("vllm.utils.math_utils", largest_power_of_2_divisor=lambda n: n & (-n))
    helpers = ("apply_alibi_to_score", "apply_softcap", "cdiv_fn", "compute_kv_seq_mask", "compute_tile_loop_bounds",
               "init_softmax_M", "load_qq_bias_tile", "resolve_seq_and_query_len", "softmax_step",
               "store_segm_reduce_scalars")
    mod("vllm.v1.attention.ops.triton_attention_helpers", **{h: None for h in helpers})
    mod("vllm.v1.attention.ops.triton_unified_attention", reduce_segments=None)
    return mods


def _load(name: str, tmp: Path) -> types.ModuleType:
    text = (DATA / f"vllm__v1__attention__ops__{name}.py.txt").read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM 0.33.0, vllm/v1/attention/ops/{name}.py")
    path = tmp / f"vllm_{name}.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"vllm.v1.attention.ops.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _main(src: str, dst: str, tmp: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import triton
    from triton import language as tl

    sys.modules.update(_stubs(torch, triton, tl))
    flash = _load("triton_reshape_and_cache_flash", Path(tmp))
    _load("int4_per_token_head", Path(tmp))  # the dispatcher imports it by name for INT4
    modes = {"int8": (torch.int8, 1, flash.KVQuantMode.INT8_PER_TOKEN_HEAD),
             "fp8": (torch.float8_e4m3fn, 1, flash.KVQuantMode.FP8_PER_TOKEN_HEAD),
             "int4": (torch.uint8, 2, flash.KVQuantMode.INT4_PER_TOKEN_HEAD)}
    out = []
    for case in torch.load(src):
        key, value = case["key"], case["value"]
        tokens, heads, dim = key.shape
        block = 16
        blocks = -(-tokens // block)
        slots = torch.arange(tokens)
        if case["mode"] == "fp8_tensor":  # [blocks, block_size, heads, dim] uint8, viewed as the platform's fp8
            kc = torch.zeros(blocks, block, heads, dim, dtype=torch.uint8)
            vc = torch.zeros_like(kc)
            flash.triton_reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", case["k_scale"], case["v_scale"])
            out.append({"key_cache": kc.reshape(-1, heads, dim)[:tokens], "value_cache": vc.reshape(-1, heads, dim)[:tokens]})
            continue
        dtype, pack, mode = modes[case["mode"]]
        kc = torch.zeros(blocks, block, heads, dim // pack, dtype=dtype)
        vc = torch.zeros_like(kc)
        ks = torch.zeros(blocks, block, heads, dtype=torch.float32)
        vs = torch.zeros_like(ks)
        flash.triton_reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slots, kv_quant_mode=mode)
        out.append({"key_cache": kc.reshape(-1, heads, dim // pack)[:tokens],
                    "value_cache": vc.reshape(-1, heads, dim // pack)[:tokens],
                    "k_scale_cache": ks.reshape(-1, heads)[:tokens], "v_scale_cache": vs.reshape(-1, heads)[:tokens]})
    torch.save(out, dst)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
