"""The TurboQuant codec (kvtool/eval/codecs/turboquant.py) against vLLM 0.33.0's own code, run here: its
Lloyd-Max solver (centroids.py), its presets and boundary rule (config.py), its Hadamard (turboquant_attn.py
`_build_hadamard_cached`), and its Triton store and dequant kernels (triton_turboquant_store.py,
triton_turboquant_decode.py `_tq_full_dequant_kv`) on the CPU under TRITON_INTERPRET=1.

Each test's docstring says whether the match is exact (bit for bit against vLLM's code run here) or assumed
(a CUDA-only rounding, named).
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

import vllm_reference
from kvtool.eval import kv_emulation
from kvtool.eval.codecs import turboquant as tq
from kvtool.eval.codecs.rotation import hadamard_f32
from kvtool.model import kv_dtypes, kvcache
from kvtool.model.spec import build_spec

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def _config():
    return vllm_reference.load("model_executor/layers/quantization/turboquant/config.py")


def _params(name: str) -> dict:
    from kvtool.model import kv_emulations

    return dict(kv_emulations.get(name).params)


# --- the tables, exact ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_are_vllms(d, bits):
    """Exact: the Lloyd-Max centroids equal vLLM's get_centroids(d, bits), float32 bit for bit."""
    ref = vllm_reference.load("model_executor/layers/quantization/turboquant/centroids.py")
    assert torch.equal(tq.centroids(d, bits)[0], ref.get_centroids(d, bits))
    assert (tq.centroids(d, bits)[1].diff() > 0).all()


@pytest.mark.parametrize("d", [8, 64, 128, 256])
def test_hadamard_is_vllms(d):
    """Exact: the rotation equals turboquant_attn.py's _build_hadamard_cached (float32, no random signs), and is
    symmetric and orthonormal, so un-rotating is multiplying by it again."""
    import functools

    ns = {"functools": functools, "math": math, "torch": torch}
    exec(compile(vllm_reference.excerpt("v1/attention/backends/turboquant_attn.py", "_build_hadamard_cached"),  # noqa: S102
                 "vllm/v1/attention/backends/turboquant_attn.py", "exec"), ns)
    h = hadamard_f32(d)
    assert torch.equal(h, ns["_build_hadamard_cached"](d, "cpu"))
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(d), atol=1e-6)


def test_presets_are_vllms():
    """Exact: key / value bits (kv_dtypes.json) and norm correction (kv_emulations.json params) are TQ_PRESETS'."""
    presets = _config().TQ_PRESETS
    assert set(presets) == set(PRESETS)
    for name, p in presets.items():
        row = kv_dtypes.get(name)
        assert (row.key_bits, row.value_bits) == (p["key_quant_bits"], p["value_quant_bits"]), name
        assert _params(name) == {"norm_correction": p["norm_correction"]}, name


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 5, 6, 32])
@pytest.mark.parametrize("name", [*PRESETS, "ultraquant_4bit"])
def test_boundary_layers_are_vllms(tiny_llama_config, layers, name):
    """Exact: the layers kvtool keeps at the model dtype (kvcache.cache_format's skip, and eval's hook,
    kv_emulation.kept_layers, both from kv_dtypes.json boundary_layers) are TurboQuantConfig.get_boundary_skip_layers' for a dense model of that depth (at most
    half the layers: a 2-layer model keeps both, so TurboQuant changes nothing there)."""
    cfg = {**tiny_llama_config, "num_hidden_layers": layers, "hidden_size": 256}  # head_dim 64
    model_config = types.SimpleNamespace(is_hybrid=False,
                                         hf_text_config=types.SimpleNamespace(num_hidden_layers=layers))
    want = {int(i) for i in _config().TurboQuantConfig.get_boundary_skip_layers(model_config)}
    fmt, _ = kvcache.cache_format(build_spec(cfg), name)
    assert fmt.skip == want
    assert kv_emulation.kept_layers(name, layers) == want  # what eval's hook keeps


# --- the store kernel, run by Triton's interpreter -------------------------------------------------------------
def _slot_layout(name: str, d: int) -> tuple[int, int, int]:
    cfg = _config().TurboQuantConfig.from_cache_dtype(name, d)
    return cfg.key_packed_size, cfg.slot_size_aligned, cfg.key_mse_bits


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] codes -> bytes as the store kernel lays them: 4 bits two per byte (low nibble first); 3 bits
    eight per three bytes (little endian)."""
    c = codes.to(torch.int64)
    if bits == 4:
        return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)
    word = (c.reshape(*c.shape[:-1], -1, 8) << (3 * torch.arange(8))).sum(-1)
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], -1).reshape(*c.shape[:-1], -1).to(torch.uint8)


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _random_kv(n: int, h: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, h, d, generator=g) * 2 + torch.randn(1, h, d, generator=g)).to(dtype)  # outlier dims
    v = (torch.randn(n, h, d, generator=g) * 0.5).to(dtype)
    return k, v


def _job(name: str, k: torch.Tensor, v: torch.Tensor, block_size: int = 8) -> dict:
    """What vLLM's store and dequant kernels are called with for K, V ([N, H, D]) (`_store_kv`,
    `_continuation_prefill`), the tables from vLLM's own centroids.py."""
    d = k.shape[-1]
    kps, slot, mse_bits = _slot_layout(name, d)
    row = kv_dtypes.get(name)
    ref_c = vllm_reference.load("model_executor/layers/quantization/turboquant/centroids.py")
    cents = ref_c.get_centroids(d, mse_bits or row.value_bits)
    c_sorted, _ = cents.sort()
    return {"kernel": "tq_store", "k": k, "v": v, "block_size": block_size, "slot": slot, "kps": kps,
            "mse_bits": mse_bits, "value_bits": row.value_bits, "key_fp8": row.key_bits == 8, "PiT": hadamard_f32(d),
            "midpoints": (c_sorted[:-1] + c_sorted[1:]) / 2, "centroids": cents,
            "norm_correction": _params(name)["norm_correction"]}


CASES = [(d, dtype, seed) for d in (64, 128) for dtype in (torch.bfloat16, torch.float32) for seed in (0, 1)]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict:
    """(name, d, dtype, seed) -> the store kernel's cache bytes and the dequant kernel's K / V, all run by
    Triton's interpreter in one child process."""
    jobs = {(name, d, dtype, seed): _job(name, *_random_kv(16, 2, d, dtype, seed))
            for name in PRESETS for d, dtype, seed in CASES}
    return vllm_reference.interpreted(jobs, tmp_path_factory.mktemp("tq"))


def _expected_slots(name: str, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    """The codec's codes, norms, scales and zeros, packed as the kernel's layout says."""
    row = kv_dtypes.get(name)
    if row.key_bits == 8:
        key = tq.fp8_key(k).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        idx, norm16, _ = tq.encode_key(k, row.key_bits)
        key = torch.cat([_pack(idx, row.key_bits), _f16_bytes(norm16)], -1)
    q, s16, z16 = tq.encode_value(v, row.value_bits)
    out = torch.cat([key, _pack(q, row.value_bits), _f16_bytes(s16), _f16_bytes(z16)], -1)
    return torch.nn.functional.pad(out, (0, slot - out.shape[-1]))


@pytest.mark.parametrize("name", PRESETS[1:])
@pytest.mark.parametrize("d,dtype,seed", CASES)
def test_mse_store_kernel_writes_the_codecs_codes(kernels, name, d, dtype, seed):
    """Exact (here): every byte vLLM's Triton store kernel writes for the MSE presets (key indices, float16 key
    norm, value codes, float16 value scale and zero) equals the codec's, run by Triton's interpreter on random
    K / V with outlier dimensions. Assumed on a GPU: there the rotation is a cuBLAS GEMM and the kernel divides
    with div.full.f32 (triton-lang/triton#10661), a few ulp off, taken to move no code (the row says so)."""
    k, v = _random_kv(16, 2, d, dtype, seed)
    got = kernels[(name, d, dtype, seed)]["cache"]
    assert torch.equal(got, _expected_slots(name, k, v, got.shape[-1]))


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to an even code, saturating at +-448, by search over every finite float8 e4m3 value
    (float64): what cvt.rn.satfinite computes, independently of torch's cast."""
    codes = torch.arange(256, dtype=torch.int32)
    vals = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    ok = ~vals.isnan()
    codes, vals = codes[ok], vals[ok]
    xd = x.double().clamp(-448, 448).reshape(-1, 1)
    dist = (xd - vals).abs()
    best = dist == dist.min(-1, keepdim=True).values
    even = best & (codes % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, best).float().argmax(-1)
    return vals[pick].reshape(x.shape).float()


@pytest.mark.parametrize("d,dtype,seed", CASES)
def test_fp8_store_kernel_writes_the_codecs_values_and_rounds_keys_to_nearest(kernels, d, dtype, seed):
    """turboquant_k8v4. Exact: the value bytes (4-bit codes, float16 scale and zero) the Triton store kernel
    writes, run by Triton's interpreter. Assumed: the keys. The kernel casts with `k.to(tl.float8e4nv)`, which a
    GPU of sm_89 or later runs as cvt.rn.satfinite; the codec's keys are that rounding (nearest, ties to even,
    saturating), checked against a search over every float8 value. Triton's CPU interpreter rounds otherwise:
    measured here, it agrees on most keys, and where it differs it is farther from the key than the codec
    (values that round up into the next binade it sends down to the binade's start: 0.4863 -> 0.25)."""
    name = "turboquant_k8v4"
    k, v = _random_kv(16, 2, d, dtype, seed)
    got = kernels[(name, d, dtype, seed)]["cache"]
    want = _expected_slots(name, k, v, got.shape[-1])
    assert torch.equal(got[..., d:], want[..., d:])
    ours = tq.fp8_key(k)
    assert torch.equal(ours, _nearest_e4m3(k))
    interp = got[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    assert (interp == ours).float().mean() > 0.9
    assert ((k.float() - ours).abs() <= (k.float() - interp).abs()).all()


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("d,dtype,seed", CASES)
def test_dequant_kernel_reads_back_what_the_codec_returns(kernels, name, d, dtype, seed):
    """Exact (here, float16): vLLM's `_tq_full_dequant_kv` kernel (the continuation prefill's dequant: K in the
    rotated space as norm16 * centroids, re-normalised for the nc presets, V as code * scale16 + zero16),
    run by Triton's interpreter on the bytes the store kernel wrote, equals the codec's rotated K and its V
    rounded to float16. The decode kernel reads the same numbers in float32 (`_tq_decode_stage1`)."""
    row = kv_dtypes.get(name)
    k, v = _random_kv(16, 2, d, dtype, seed)
    out = kernels[(name, d, dtype, seed)]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, N, D], as transformers hands them
    if row.key_bits == 8:  # the stored bytes (the interpreter's rounding, test above) read back exactly
        want_k = out["cache"][..., :d].view(torch.float8_e4m3fn).float().transpose(0, 1)[None]
    else:
        idx, norm16, _ = tq.encode_key(kt, row.key_bits)
        want_k = tq.decode_key_rotated(idx, norm16, row.key_bits, _params(name)["norm_correction"])
    assert torch.equal(out["k_out"], want_k.to(torch.float16))
    assert torch.equal(out["v_out"], tq.decode_value(*tq.encode_value(vt, row.value_bits)).to(torch.float16))


# --- what attention computes ------------------------------------------------------------------------------------
DECODE_SEQ = (16, 11)  # two queries: over all 16 cached tokens, and over the first 11


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict:
    """(name, d) -> vLLM's TurboQuant decode attention (`triton_turboquant_decode_attention`, stage 1 over the
    packed cache and stage 2's reduction, 4 KV splits) for two float16 queries of 4 heads over 2 KV heads, and the
    cache it read, run by Triton's interpreter."""
    jobs = {}
    for name in PRESETS:
        for d in (64, 128):
            k, v = _random_kv(16, 2, d, torch.float16, 4)
            q = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(d)).to(torch.float16)
            jobs[(name, d)] = {**_job(name, k, v), "kernel": "tq_decode", "q": q, "scale": 1 / math.sqrt(d),
                               "seq_lens": torch.tensor(DECODE_SEQ, dtype=torch.int32)}
    return vllm_reference.interpreted(jobs, tmp_path_factory.mktemp("tq_decode"))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("d", [64, 128])
def test_vllms_decode_attention_is_attention_over_the_codecs_kv(decoded, name, d):
    """Exact up to float16 output rounding (here): vLLM's decode attention (the rotated query against the packed
    keys' centroids and norms, the values dequantized, an online softmax over 4 splits), run by Triton's
    interpreter, equals plain attention of the raw query over the codec's K (rotated back) and V: max difference
    under 1e-3, where the cache's own effect on the output is two orders larger. k8v4: over the float8 keys the
    interpreter stored (its float8 rounding is not the GPU's; assumed: the GPU stores the codec's, test above)."""
    row = kv_dtypes.get(name)
    k, v = _random_kv(16, 2, d, torch.float16, 4)
    q = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(d)).to(torch.float16)
    got = decoded[(name, d)]
    kt, vt = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [H, N, D]
    if row.key_bits == 8:
        kk = got["cache"][..., :d].contiguous().view(torch.float8_e4m3fn).float().transpose(0, 1)
    else:
        kk = tq.roundtrip(kt[None], role="k", params=_params(name), row=row)[0]
    vv = tq.roundtrip(vt[None], role="v", params=_params(name), row=row)[0]
    def attend(qb, keys, values, n):
        return ((qb @ keys[:, :n].transpose(-1, -2)) / math.sqrt(d)).softmax(-1) @ values[:, :n]

    for b, n in enumerate(DECODE_SEQ):
        qb = q[b].float().reshape(2, 2, d)  # [KV head, query heads of it, D]
        ours = attend(qb, kk, vv, n).reshape(4, d)
        assert (got["out"][b].float() - ours).abs().max() < 1e-3, (name, d, b)
        assert (attend(qb, kt, vt, n).reshape(4, d) - ours).abs().max() > 2e-2  # the cache changed the output


@pytest.mark.parametrize("name", PRESETS[1:])
def test_unrotated_keys_give_the_scores_of_the_rotated_query(name):
    """Exact in arithmetic, float32 rounding apart: vLLM scores a key as norm16 * (q @ H) . c (the decode
    kernel's rotated query); q . roundtrip(k), the un-rotated key transformers' attention uses, is the same
    number, because H is orthonormal and symmetric."""
    row = kv_dtypes.get(name)
    g = torch.Generator().manual_seed(5)
    k, q = torch.randn(1, 2, 32, 128, generator=g), torch.randn(1, 2, 4, 128, generator=g)
    idx, norm16, h = tq.encode_key(k, row.key_bits)
    c = tq.decode_key_rotated(idx, torch.ones_like(norm16), row.key_bits, True)  # the kernel's c_vals
    vllm_scores = norm16.float().transpose(-1, -2) * ((q @ h) @ c.transpose(-1, -2))
    ours = q @ tq.roundtrip(k, role="k", params=_params(name), row=row).transpose(-1, -2)
    assert torch.allclose(ours, vllm_scores, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, q @ k.transpose(-1, -2), rtol=1e-2, atol=1e-2)  # it did quantize


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_keeps_shape_dtype_and_each_row_alone(name, dtype):
    """Exact: the codec returns x's shape and dtype, and a batch row's result does not depend on the other rows
    (the sweep runs one dtype per row)."""
    row = kv_dtypes.get(name)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2, 10, 64, generator=g) * torch.tensor([0.1, 1.0, 30.0])[:, None, None, None]).to(dtype)
    for role in ("k", "v"):
        out = tq.roundtrip(x, role=role, params=_params(name), row=row)
        assert out.shape == x.shape and out.dtype == dtype
        for i in range(3):
            assert torch.equal(out[i:i + 1], tq.roundtrip(x[i:i + 1], role=role, params=_params(name), row=row))


def test_a_head_dim_the_rotation_cannot_cover_is_one_line():
    """Exact (vLLM's own refusal, not a numeric match): vLLM's _build_hadamard grows to the next power of two and its store GEMM fails on any other head_dim;
    the codec says so in one line (the FP8-key preset needs no rotation)."""
    from kvtool.errors import InputError

    x = torch.randn(1, 1, 4, 96)
    with pytest.raises(InputError, match="power-of-two head_dim"):
        tq.roundtrip(x, role="k", params={"norm_correction": True}, row=kv_dtypes.get("turboquant_4bit_nc"))
    assert tq.roundtrip(x, role="k", params={"norm_correction": False},
                        row=kv_dtypes.get("turboquant_k8v4")).shape == x.shape


def test_emulation_rows_cite_and_name_their_oracles():
    """Exact (read from vLLM's source): the four rows: codec turboquant, checkpoint scales ignored, first prefill chunk over raw K/V
    (`_prefill_attention`, the excerpt), each oracle a test of this file."""
    from kvtool.model import kv_emulations

    prefill = vllm_reference.excerpt("v1/attention/backends/turboquant_attn.py", "TurboQuantAttentionImpl._prefill_attention")
    assert "max_query_len == attn_metadata.max_seq_len" in prefill and "k=key," in prefill
    names = {n for n in globals() if n.startswith("test_")}
    for name in PRESETS:
        e = kv_emulations.get(name)
        assert (e.codec, e.scales, e.first_prefill, e.match) == ("turboquant", "ignored", "raw", "assumed")
        path, _, test = e.oracle.partition("::")
        assert Path(path).name == Path(__file__).name and test in names
        assert e.citation.file.startswith("vllm/") and e.citation.function
