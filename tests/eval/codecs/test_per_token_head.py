"""The per-token-head codecs (kvtool/eval/codecs/per_token_head.py) against vLLM 0.33.0's own store kernels, run by
Triton's interpreter on the CPU (tests/eval/codecs/vllm_reference.py): the bytes the cache holds and its scales."""

from __future__ import annotations

import pytest
import torch

from kvtool.eval import codecs
from kvtool.eval.codecs import per_token_head as pth
from kvtool.model import kv_dtypes, kv_emulations

import vllm_reference


def _kv(tokens=37, heads=3, dim=96, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, dim, generator=g) * 3
    value = torch.randn(tokens, heads, dim, generator=g)
    key[0, 0] = 0.0  # an all-zero head: the 1e-6 scale floor
    key[1, 1, :4] = torch.tensor([50.0, -50.0, 1e-3, -1e-3])  # outliers
    value[2, 2] = 7.25  # a constant head: int4's zero range
    return key.to(dtype), value.to(dtype)


@pytest.fixture(scope="module")
def vllm_caches(tmp_path_factory):
    """vLLM's kernels on the same tensors, once for every test of this module (one interpreter start)."""
    cases, keys = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (96, 128):
            key, value = _kv(dim=dim, dtype=dtype)
            for mode in ("int8", "fp8", "int4"):
                cases.append({"mode": mode, "key": key, "value": value})
                keys.append((mode, dtype, dim))
            if dtype == torch.float32 and dim == 128:
                for k_scale, v_scale in ((1.0, 1.0), (0.0123, 0.5)):
                    cases.append({"mode": "fp8_tensor", "key": key, "value": value,
                                  "k_scale": torch.tensor([k_scale]), "v_scale": torch.tensor([v_scale])})
                    keys.append(("fp8_tensor", k_scale, v_scale))
    jobs = {i: {"kernel": "flash_store", **c} for i, c in enumerate(cases)}
    out = vllm_reference.interpreted(jobs, tmp_path_factory.mktemp("vllm"))
    return {(k, c["mode"], c.get("key").dtype): (c, out[i]) for i, (k, c) in enumerate(zip(keys, cases))}


def _case(vllm_caches, mode, dtype, dim):
    return vllm_caches[((mode, dtype, dim), mode, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 128])
def test_int8_codes_and_scales_are_vllms_bit_for_bit(vllm_caches, dtype, dim):
    """Assumed match: int8 codes and float32 scales equal vLLM's kernel run by the interpreter bit for bit; on CUDA
    Triton's float32 division is div.full.f32 (the row's assumption)."""
    case, out = _case(vllm_caches, "int8", dtype, dim)
    for role, x in (("key", case["key"]), ("value", case["value"])):
        q, s = pth.quantize(x, "int8")
        assert torch.equal(out[f"{role}_cache"], q)
        assert torch.equal(out[f"{role[0]}_scale_cache"], s[..., 0])
    assert float(out["k_scale_cache"][0, 0]) == pytest.approx(1e-6)  # the all-zero head


E4M3_SUBNORMAL_STEP, E4M3_MIN_NORMAL = 2.0 ** -9, 2.0 ** -6


def _only_where_the_interpreter_rounds_wrong(theirs: torch.Tensor, ours: torch.Tensor, scaled: torch.Tensor) -> int:
    """Where vLLM's codes (Triton's interpreter casting float32 to e4m3) differ from the codec's (torch's round to
    nearest even), the interpreter is the one off, in one of two ways it always is: (a) the nearest e4m3 value is
    the next power of two up and it kept the binade below (it drops the carry of a mantissa that rounds up: 124.3
    -> 64, not 128); (b) a subnormal (|x| < 2^-6), which it truncates toward zero instead of rounding; (c) an exact
    tie, which it rounds away from zero, not to the even code (84 -> 88, not 80). Everywhere else they are equal.
    Returns how many codes differ."""
    differ = theirs != ours
    a = ours.abs()
    pow2 = (a > 0) & (torch.log2(a.clamp(min=1e-30)) == torch.round(torch.log2(a.clamp(min=1e-30))))
    carry = pow2 & (a == 2 * theirs.abs()) & (scaled.abs() < a) & (torch.sign(theirs) == torch.sign(ours))
    truncated = torch.sign(scaled) * torch.floor(scaled.abs() / E4M3_SUBNORMAL_STEP) * E4M3_SUBNORMAL_STEP
    subnormal = (scaled.abs() < E4M3_MIN_NORMAL) & (theirs == truncated)
    tie = ((scaled - ours).abs() == (theirs - scaled).abs()) & (theirs.abs() > ours.abs())
    assert not (differ & ~carry & ~subnormal & ~tie).any()
    return int(differ.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 128])
def test_fp8_scales_are_vllms_and_codes_differ_only_by_the_interpreters_cast(vllm_caches, dtype, dim):
    """Assumed match: scales equal vLLM's kernel (interpreter) bit for bit; the fp8 codes are torch's round to
    nearest even, CUDA's cvt.rn.satfinite; the interpreter's cast differs only where it rounds wrong
    (_only_where_the_interpreter_rounds_wrong: a dropped carry, a truncated subnormal, a tie away from zero)."""
    case, out = _case(vllm_caches, "fp8", dtype, dim)
    dropped = 0
    for role, x in (("key", case["key"]), ("value", case["value"])):
        q, s = pth.quantize(x, "float8_e4m3fn")
        assert torch.equal(out[f"{role[0]}_scale_cache"], s[..., 0])
        dropped += _only_where_the_interpreter_rounds_wrong(out[f"{role}_cache"].float(), q.float(), x.float() * (1.0 / s))
    assert dropped > 0  # the data reaches the case the interpreter gets wrong, and nothing else differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 128])
def test_int4_packed_bytes_and_scales_are_vllms_bit_for_bit(vllm_caches, dtype, dim):
    """Assumed match: the packed nibbles and the float32 scales with the zero point in their low bits equal vLLM's
    kernel (interpreter) bit for bit, after vLLM's own PyTorch Hadamard; on CUDA the rotation is hadacore (bf16)
    and the division div.full.f32 (the row's assumption)."""
    case, out = _case(vllm_caches, "int4", dtype, dim)
    for role, x in (("key", case["key"]), ("value", case["value"])):
        rotated = pth.rht(x.float()).to(x.dtype)
        q, packed, zp = pth.quantize_int4(rotated)
        assert torch.equal(out[f"{role}_cache"], pth.pack_nibbles(q))
        assert torch.equal(out[f"{role[0]}_scale_cache"].view(torch.int32), packed[..., 0].view(torch.int32))
        assert torch.equal((packed[..., 0].view(torch.int32) & 0xF).float(), zp[..., 0])


def test_fp8_per_tensor_writer_divides_by_the_scale_as_the_codec_does(vllm_caches):
    """Assumed match: vLLM's Triton per-tensor writer stores x / k_scale cast to e4m3 (no clamp in its code: the
    cast saturates, cvt.rn.satfinite on CUDA); within range the codec's codes equal the interpreter's except where
    its cast rounds wrong (_only_where_the_interpreter_rounds_wrong)."""
    from kvtool.eval.codecs import fp8

    seen = 0
    for (_key, mode, _), (case, out) in vllm_caches.items():
        if mode != "fp8_tensor":
            continue
        seen += 1
        for role, x, s in (("key", case["key"], case["k_scale"]), ("value", case["value"], case["v_scale"])):
            theirs = out[f"{role}_cache"].view(torch.float8_e4m3fn).float()
            scaled = x.float() / s
            inside = scaled.abs() <= 448
            codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # the codec's, before * scale
            assert torch.equal(fp8.fp8_roundtrip(x, s), codes * s)
            _only_where_the_interpreter_rounds_wrong(theirs[inside], codes[inside], scaled[inside])
    assert seen == 2


def test_read_back_is_codes_times_scales():
    """What the attention reads (kernel_unified_attention KV_QUANT_MODE 2 / 3: q.to(Q.dtype), the dot times the
    token's scale; _attn_packed for int4): q * scale; int4 rotated back."""
    x = torch.randn(2, 3, 5, 64, dtype=torch.float32)
    for name in ("int8_per_token_head", "fp8_per_token_head"):
        r = kv_emulations.get(name)
        got = codecs.get(r.codec)(x, role="k", params=dict(r.params), row=kv_dtypes.get(name), scale=None)
        q, s = pth.quantize(x, r.params["format"])
        assert torch.equal(got, q.float() * s)
    r = kv_emulations.get("int4_per_token_head")
    got = codecs.get(r.codec)(x, role="v", params=dict(r.params), row=kv_dtypes.get("int4_per_token_head"), scale=None)
    rotated = pth.rht(x)
    q, packed, zp = pth.quantize_int4(rotated)
    deq = (q.float() - zp) * (packed.view(torch.int32) & -16).view(torch.float32)
    assert torch.allclose(pth.rht(got), deq, atol=1e-5)  # rotating the read-back gives the dequantized cache
    err = {n: float((codecs.get(kv_emulations.get(n).codec)(x, role="k", params=dict(kv_emulations.get(n).params),
                                                          row=None, scale=None) - x).abs().mean())
           for n in ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")}
    assert err["int8_per_token_head"] < err["fp8_per_token_head"] < err["int4_per_token_head"]


def test_checkpoint_scales_are_ignored_and_batch_rows_are_independent():
    x = torch.randn(3, 2, 4, 32) * 5
    for name in ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"):
        r = kv_emulations.get(name)
        assert r.scales == "ignored"
        f = codecs.get(r.codec)
        whole = f(x, role="k", params=dict(r.params), row=None, scale=None)
        assert torch.equal(whole, f(x, role="k", params=dict(r.params), row=None, scale=torch.tensor(0.01)))
        for b in range(3):
            assert torch.equal(whole[b:b + 1], f(x[b:b + 1], role="k", params=dict(r.params), row=None, scale=None))


def test_rht_matches_vllms_signs_and_is_orthogonal_up_to_its_block():
    """The signs are vLLM's seed (_get_rht_signs); rotating twice gives b times x (b the largest power-of-two
    divisor of head_dim)."""
    for d in (64, 96, 80):
        x = torch.randn(2, d)
        b = d & (-d)
        assert torch.allclose(pth.rht(pth.rht(x), inverse=True) / b, x, atol=1e-5)
