"""The fp8_ds_mla codec (kvtool/eval/codecs/ds_mla.py): DeepSeek V3.2's 656-byte sparse-MLA token.

The oracle is vLLM 0.33's own writer for the models served with this format: the Triton kernel
`_fused_norm_rope_kernel` (vllm/models/deepseek_v32/common/kernels.py, copied whole and verbatim to
tests/data/vllm/0.33.0/), launched through vLLM's `fused_norm_rope` under TRITON_INTERPRET=1 on the CPU in a
subprocess (triton 3.9.0, the `test` extra), with vLLM's module imports stubbed (platform: e4m3fn, no PDL). Tile
scales and the rope tail match bit for bit; the e4m3 codes match except where the interpreter's float32 -> float8
cast does not round to nearest even (the GPU's cvt.rn does, as torch's cast): the row's assumption.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.eval import codecs
from kvtool.eval.codecs import ds_mla
from kvtool.model import kv_dtypes, kv_emulations
from tests.oracle.test_vllm_facts import _segments


def _rt_name(x, name, role):
    r = kv_emulations.get(name)
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get(name), scale=None)


def _rt(x, role):
    r = kv_emulations.get("fp8_ds_mla")
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get("fp8_ds_mla"), scale=None)


def _latent(seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, 9, 512, generator=g) * torch.tensor([0.01, 1.0, 30.0, 500.0]).repeat_interleave(128)
    x[1, 0, 3, :128] = 0.0  # an all-zero tile
    return x.to(dtype)


KERNELS = Path(__file__).resolve().parents[2] / "data/vllm/0.33.0/vllm__models__deepseek_v32__common__kernels.py.txt"
# vLLM's fused_norm_rope writing one fp8_ds_mla cache under the Triton interpreter (argv: kernels file, output file)
WRITER = """
import importlib.util, os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton
import triton.language as tl

def stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m

for n in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
    stub(n)
stub("vllm.platforms", current_platform=types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn,
                                                               is_arch_support_pdl=lambda: False))
stub("vllm.triton_utils", tl=tl, triton=triton)
stub("vllm.utils.deep_gemm", mqa_logits_use_mx_scales=lambda: False)
stub("vllm.v1.attention.ops.common", pack_ue8m0_x4=None)
stub("vllm.v1.kv_cache_interface", is_quantized_kv_cache=lambda d: d not in ("auto", "bfloat16", "float16"))
path = os.path.join(os.path.dirname(sys.argv[2]), "vllm_dsv32_kernels.py")
with open(sys.argv[1]) as f, open(path, "w") as out:
    out.write(f.read())
spec = importlib.util.spec_from_file_location("vllm_dsv32_kernels", path)
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)

def write(kv_c, k_pe, entry_bytes, cache_dtype):
    # vLLM's fused_norm_rope storing the tokens (RMS-norm weight 1, rope cos 1 / sin 0) into slots of 3 blocks of 4
    T = kv_c.shape[0]
    q_c = torch.zeros(T, 64, dtype=torch.bfloat16)
    cos_sin = torch.cat([torch.ones(256, 32), torch.zeros(256, 32)], dim=-1)  # cos 1, sin 0: k_pe unrotated
    cache = torch.zeros(3, 4, entry_bytes, dtype=torch.uint8)
    slots = torch.tensor([0, 1, 2, 5, 6, 7, 9, 11])
    k.fused_norm_rope(torch.arange(T), q_c, torch.ones(64, dtype=torch.bfloat16), 1e-6, kv_c,
                      torch.ones(512, dtype=torch.bfloat16), 1e-6, k_pe, cos_sin, None, None, None, 1e-6, None,
                      torch.zeros(T, 8, dtype=torch.int32), slot_mapping=slots, mla_kv_cache=cache,
                      mla_kv_cache_dtype=cache_dtype, has_indexer=False)
    return cache, slots


g = torch.Generator().manual_seed(0)
T = 8  # 8 * 512 values: a power of two for the cast kernel
kv_c = (torch.randn(T, 512, generator=g) * torch.tensor([0.01, 1.0, 30.0, 500.0]).repeat_interleave(128))
kv_c = kv_c.to(torch.bfloat16)
k_pe = torch.randn(T, 64, generator=g).to(torch.bfloat16)
cache, slots = write(kv_c, k_pe, 656, "fp8_ds_mla")
entries = cache.view(-1, 656)[slots]
scales = entries[:, 512:528].contiguous().view(torch.float32)
x = kv_c.float()
scaled = ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).view(T, 4, 128) / scales[..., None]).reshape(-1)


@triton.jit
def cast(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, tl.load(src + i).to(tl.float8e4nv))


interp = torch.empty(scaled.numel(), dtype=torch.float8_e4m3fn)
cast[(1,)](scaled, interp, N=scaled.numel())
torch.save({"kv_c": kv_c, "k_pe": k_pe, "cache": cache, "slots": slots, "interp_cast": interp}, sys.argv[2])
"""


def test_latent_tiles_of_128_match_vllms_triton_writer(tmp_path):
    """Assumed for the GPU's e4m3 rounding (the row's assumption); against vLLM's Triton writer run in the
    interpreter: the four float32 tile scales (powers of two at or above amax / 448) and the bfloat16 rope tail are
    bit for bit, and the e4m3 codes are exactly the interpreter's cast of x / scale (a one-line Triton cast of the
    same values). That cast is not round-to-nearest-even everywhere; the GPU's cvt.rn is, as torch's cast and the
    codec are."""
    # triton 3.9.0 is in the `test` extra (.ci/constraints.txt): no skip
    out = tmp_path / "cache.pt"
    run = subprocess.run([sys.executable, "-c", WRITER, str(KERNELS), str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = torch.load(out)
    entries = d["cache"].view(-1, 656)[d["slots"]]
    codes = entries[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scales = entries[:, 512:528].contiguous().view(torch.float32)
    rope = entries[:, 528:].contiguous().view(torch.bfloat16)
    x = d["kv_c"].float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # the kernel's RMS norm (weight 1), float32
    assert torch.equal(ds_mla.tile_scales(normed), scales)
    assert bool((scales == torch.exp2(torch.log2(scales).round())).all())  # powers of two
    assert torch.equal(_rt(d["k_pe"][:, None, None, :], "rope").reshape(rope.shape), rope)
    # the writer's codes are the interpreter's cast of x / scale, nothing else
    assert torch.equal(codes.reshape(-1), d["interp_cast"].float())
    # the codec: the same x / scale cast to nearest even (torch), times the scale
    got = _rt(normed[:, None, None, :], "latent").reshape(codes.shape)
    rne = (normed.view(codes.shape) / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).float()
    assert torch.equal(got, rne * scales.unsqueeze(-1))
    assert (rne == codes).float().mean() > 0.95  # the interpreter's cast differs from nearest-even on a few


# the same kernel writing a nvfp4_ds_mla cache; its one line of inline PTX (cvt.rn.satfinite.e2m1x2.f32, which the
# interpreter cannot run) replaced by that instruction's definition: round to nearest even, saturate at 6
NVFP4_WRITER = WRITER.split("g = torch.Generator()")[0] + """
import numpy as np
import triton.runtime.interpreter as interp

MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def nibble(v):
    a = np.minimum(np.abs(v), 6.0)
    d = np.abs(a[..., None] - MAGS)
    best = d.min(-1, keepdims=True)
    idx = np.where(d == best, np.arange(8), 99)
    even = np.where((idx % 2 == 0) & (idx < 99), idx, 99).min(-1)  # a tie goes to the even code
    idx = np.where((d == best).sum(-1) > 1, even, idx.min(-1))
    return (idx | np.where(v < 0, 8, 0)).astype(np.int32)


def create_inline_asm(self, asm, constraints, values, type, is_pure, pack):
    assert "cvt.rn.satfinite.e2m1x2.f32 t, $2, $1" in asm
    byte = nibble(values[0].data) | (nibble(values[1].data) << 4)  # low nibble: $1 (even), high: $2 (odd)
    out = interp.TensorHandle(byte.astype(np.int32), tl.int32)
    return types.SimpleNamespace(get_result=lambda i: out)


interp.InterpreterBuilder.create_inline_asm = create_inline_asm
g = torch.Generator().manual_seed(1)
T = 8
kv_c = (torch.randn(T, 512, generator=g) * torch.logspace(-3, 3, 32).repeat_interleave(16)).to(torch.bfloat16)
k_pe = (torch.randn(T, 64, generator=g) * 3).to(torch.bfloat16)
cache, slots = write(kv_c, k_pe, 352, "nvfp4_ds_mla")


@triton.jit
def cast(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, tl.load(src + i).to(tl.float8e4nv))


x = kv_c.float()
normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
pre_sf = torch.clamp(normed.view(T, 32, 16).abs().amax(-1) * (1.0 / 6.0), min=2.0 ** -9).reshape(-1)
sf_cast = torch.empty(pre_sf.numel(), dtype=torch.float8_e4m3fn)
cast[(1,)](pre_sf, sf_cast, N=pre_sf.numel())
rope = k_pe.float().reshape(-1)
rope_cast = torch.empty(rope.numel(), dtype=torch.float8_e4m3fn)
cast[(1,)](rope, rope_cast, N=rope.numel())
torch.save({"kv_c": kv_c, "k_pe": k_pe, "cache": cache, "slots": slots, "sf_cast": sf_cast,
            "rope_cast": rope_cast}, sys.argv[2])
"""


def test_nvfp4_ds_mla_matches_vllms_triton_writer(tmp_path):
    """Assumed for the CUDA-only conversions (the row's assumption); against vLLM's Triton writer in the interpreter,
    its inline cvt.rn.satfinite.e2m1x2.f32 replaced by that instruction's definition: the 32 block scales are the
    interpreter's e4m3 cast of max(amax / 6, 2^-9) (torch's round-to-nearest cast, the codec's, stands for the
    GPU's), stored at byte 8 * (s % 4) + s // 4; the e2m1 codes, two per byte with the even value in the low
    nibble, are the codec's e2m1(x * (1 / scale)) bit for bit; the rope is the e4m3 cast of its values."""
    from kvtool.eval.codecs import nvfp4

    out = tmp_path / "cache.pt"
    run = subprocess.run([sys.executable, "-c", NVFP4_WRITER, str(KERNELS), str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = torch.load(out)
    entries = d["cache"].view(-1, 352)[d["slots"]]
    assert 256 + 64 + 32 == 352 == kv_dtypes.get("nvfp4_ds_mla").token_bytes
    perm = torch.tensor([8 * (s % 4) + s // 4 for s in range(32)])
    sf = entries[:, 320:352].contiguous().view(torch.float8_e4m3fn).float()[:, perm]  # [tokens, 32]
    assert torch.equal(sf.reshape(-1), d["sf_cast"].float())
    x = d["kv_c"].float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    mine = _rt_name(normed[:, None, None, :], "nvfp4_ds_mla", "latent").reshape(-1, 32, 16)
    pre = torch.clamp(normed.view(-1, 32, 16).abs().amax(-1) * (1.0 / 6.0), min=2.0 ** -9)
    torch_sf = pre.to(torch.float8_e4m3fn).float()
    assert (torch_sf == sf).float().mean() > 0.9
    lo, hi = (entries[:, :256] & 15).long(), (entries[:, :256] >> 4).long()
    nib = torch.stack([lo, hi], -1).reshape(-1, 32, 16)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.where(nib >= 8, -mags[nib % 8], mags[nib % 8])
    t = normed.view(-1, 32, 16)
    assert torch.equal(codes, nvfp4.e2m1((t * (1.0 / sf.unsqueeze(-1))).clamp(-6, 6)))
    same = (torch_sf == sf).unsqueeze(-1).expand_as(t)
    assert torch.equal(mine[same], (codes * sf.unsqueeze(-1))[same])  # the codec where the scale casts agree
    rope = entries[:, 256:320].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.equal(rope.reshape(-1), d["rope_cast"].float())
    r = _rt_name(d["k_pe"][:, None, None, :], "nvfp4_ds_mla", "rope").float().reshape(rope.shape)
    assert (r == rope).float().mean() > 0.9


def test_latent_round_trip_properties():
    """Assumed (the writer's rounding on the GPU): each tile of 128 comes back as e4m3(x / s) * s, s the power of
    two at or above amax / 448 (1e-4 at least), so nothing saturates; a zero tile comes back as zeros."""
    x = _latent(0)
    got = _rt(x, "latent")
    assert got.dtype == x.dtype and got.shape == x.shape
    t = x.float().reshape(2, 1, 9, 4, 128)
    s = torch.exp2(torch.ceil(torch.log2((t.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-4))))
    assert torch.equal(got, ((t / s).to(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype))
    assert bool(((t / s).abs() <= 448.0).all())
    assert not got[1, 0, 3, :128].any()


def test_rope_key_is_stored_unquantized_and_the_batch_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    rope = torch.randn(3, 1, 5, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(_rt(rope, "rope"), rope)
    x = _latent(2)
    assert torch.equal(_rt(x, "latent")[1:], _rt(x[1:], "latent"))
    with pytest.raises(ValueError, match="not 'k'"):
        _rt(x, "k")


def test_the_layout_is_vllms_656_byte_token():
    """vLLM 0.33's own numbers: 656 bytes per token (MLAAttention.get_kv_cache_spec), which is 512 e4m3 values, one
    float32 scale per tile of 128 and 64 rope values of 2 bytes; the scales are vLLM's own (checkpoint's ignored)."""
    spec = _segments("vllm/model_executor/layers/attention/mla_attention.py")["MLAAttention.get_kv_cache_spec"]
    assert 'state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(' in spec
    latent, rope = 512, 64
    assert latent + latent // ds_mla.TILE * 4 + rope * 2 == 656 == kv_dtypes.get("fp8_ds_mla").token_bytes
    assert kv_emulations.get("fp8_ds_mla").scales == "dynamic"
