"""The UltraQuant codec (kvtool/eval/codecs/ultraquant.py) against vLLM 0.33.0's PyTorch reference
(vllm/v1/attention/ops/ultraquant/reference.py and format.py, run here as they are). Each test's docstring says
whether the match is exact or assumed."""

from __future__ import annotations

import pytest
import torch

import vllm_reference
from kvtool.errors import InputError
from kvtool.eval.codecs import ultraquant as uq
from kvtool.eval.codecs.rotation import hadamard_f64
from kvtool.model import kv_dtypes, kv_emulations

ROW = kv_dtypes.get("ultraquant_4bit")


def _ref():
    return vllm_reference.load("v1/attention/ops/ultraquant/reference.py")


def _params() -> dict:
    return dict(kv_emulations.get("ultraquant_4bit").params)


def _x(shape, dtype, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * spread
    x[..., 0, :5] = 0.0  # a group with zeros
    if shape[-2] > 1:
        x[..., 1, :] = 0.0  # a token that is all zero: the byte-0 sentinel
    return x.to(dtype)


def test_constants_are_vllms():
    """Exact: the FP4 levels, their midpoints, the group size (kv_dtypes.json) and c (kv_emulations.json) are
    format.py's."""
    fmt = vllm_reference.load("v1/attention/ops/ultraquant/format.py")
    assert uq.LEVELS == fmt.FP4_LEVELS_SORTED and uq.MIDPOINTS == fmt.MIDPOINTS_SORTED
    assert uq.UE8M0_BIAS == fmt.UE8M0_BIAS
    assert ROW.group_size == fmt.GROUP_SIZE
    assert _params()["constant_c"] == fmt.get_constant_c()
    for d in (64, 128, 256):
        assert torch.equal(hadamard_f64(d), _ref().hadamard_matrix(d, torch.device("cpu")))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spread", [1e-3, 1.0, 40.0])
def test_roundtrip_is_vllms_reference(d, dtype, spread):
    """Exact: V equals reference.py's ultraquant_encode_decode(rotate=False); K equals its
    ultraquant_encode_decode(rotate=True) (the rotated basis the cache holds) times H, bit for bit, and so
    do the stored codes and scale bytes (ultraquant_encode)."""
    ref = _ref()
    x = _x((2, 3, 9, d), dtype, d + int(spread))
    p = _params()
    v = uq.roundtrip(x, role="v", params=p, row=ROW)
    assert torch.equal(v, ref.ultraquant_encode_decode(x, rotate=False).to(dtype))
    k_rot = ref.ultraquant_encode_decode(x, rotate=True)
    k = uq.roundtrip(x, role="k", params=p, row=ROW)
    assert torch.equal(k, (k_rot @ hadamard_f64(d)).to(dtype))
    idx, s = uq.encode(x, rotate=True, group=ROW.group_size, c=p["constant_c"])
    enc = ref.ultraquant_encode(x, rotate=True)
    assert torch.equal(uq.snap_scale(s.squeeze(-1))[1], enc.scale_bytes)
    assert torch.equal(uq.decode(idx, s), ref.ultraquant_dequant(enc, d))


KERNEL_CASES = [(d, dtype) for d in (64, 128, 256) for dtype in (torch.bfloat16, torch.float16)]


def _kv(d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(d)
    k = torch.randn(12, 2, d, generator=g) * 3 + torch.randn(1, 2, d, generator=g) * 8  # outlier dims
    v = torch.randn(12, 2, d, generator=g) * 0.02
    k[0, 0] = 0.0  # the zero sentinel
    return k.to(dtype), v.to(dtype)


@pytest.fixture(scope="module")
def kernel_slots(tmp_path_factory) -> dict:
    """(d, dtype) -> the cache bytes vLLM's Triton store kernel (ultraquant/triton_store.py `ultraquant_store`)
    writes, run by Triton's interpreter in a child process."""
    jobs = {(d, dtype): {"kernel": "uq_store", "k": _kv(d, dtype)[0], "v": _kv(d, dtype)[1]}
            for d, dtype in KERNEL_CASES}
    return vllm_reference.interpreted(jobs, tmp_path_factory.mktemp("uq"))


@pytest.mark.parametrize("d,dtype", KERNEL_CASES)
def test_store_kernel_writes_the_codecs_codes(kernel_slots, d, dtype):
    """Exact (here): every byte the Triton store kernel writes (K codes of the Hadamard-rotated key, its UE8M0
    scale bytes, V codes and scale bytes, format.py's slot layout) equals the codec's codes packed so, run by
    Triton's interpreter. Assumed on a GPU: its tl.log2 / tl.exp2 snap the same power of two (the row says so)."""
    fmt = vllm_reference.load("v1/attention/ops/ultraquant/format.py")
    to_bits = torch.tensor(fmt.SORTED_TO_BITS)
    c = _params()["constant_c"]

    def packed(x, rotate):
        idx, s = uq.encode(x, rotate=rotate, group=ROW.group_size, c=c)
        bits = to_bits[idx].reshape(x.shape)
        return [(bits[..., 0::2] | (bits[..., 1::2] << 4)).to(torch.uint8), uq.snap_scale(s.squeeze(-1))[1]]

    k, v = _kv(d, dtype)
    want = torch.cat([*packed(k, True), *packed(v, False)], -1)
    assert want.shape[-1] == fmt.slot_size(d) == ROW.slot_bytes(d)
    assert torch.equal(kernel_slots[(d, dtype)]["cache"], want)


def test_unrotated_keys_give_the_rotated_scores():
    """Exact in arithmetic, float32 rounding apart: vLLM scores (q @ H.T) . k_rot (reference_ultraquant_attention
    without its float8 query cast, which the codec cannot see: the row's assumption says so); q . roundtrip(k) is
    that number, H being orthonormal."""
    ref = _ref()
    g = torch.Generator().manual_seed(1)
    k, q = torch.randn(1, 2, 16, 128, generator=g), torch.randn(1, 2, 3, 128, generator=g)
    h = hadamard_f64(128)
    rotated = (q @ h.T) @ ref.ultraquant_encode_decode(k, rotate=True).transpose(-1, -2)
    ours = q @ uq.roundtrip(k, role="k", params=_params(), row=ROW).transpose(-1, -2)
    assert torch.allclose(ours, rotated, rtol=1e-5, atol=1e-4)
    assert "query to float8 e4m3" in kv_emulations.get("ultraquant_4bit").assumption


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_alone_and_shapes_refused_in_one_line(dtype):
    """Exact: a batch row's result does not depend on the others; a head_dim that is no multiple of 32, or
    (for K's Hadamard) no power of two, is one line naming the dtype, as vLLM's store refuses it."""
    x = _x((3, 2, 5, 64), dtype, 3)
    for role in ("k", "v"):
        out = uq.roundtrip(x, role=role, params=_params(), row=ROW)
        assert out.shape == x.shape and out.dtype == dtype
        for i in range(3):
            assert torch.equal(out[i:i + 1], uq.roundtrip(x[i:i + 1], role=role, params=_params(), row=ROW))
    with pytest.raises(InputError, match="multiple of 32"):
        uq.roundtrip(torch.randn(1, 1, 2, 48), role="v", params=_params(), row=ROW)
    with pytest.raises(InputError, match="power-of-two"):
        uq.roundtrip(torch.randn(1, 1, 2, 96), role="k", params=_params(), row=ROW)
    with pytest.raises(ValueError):
        _ref().hadamard_matrix(96, torch.device("cpu"))


def test_first_prefill_chunk_attends_over_raw_kv():
    """Exact (read from vLLM's source): the row's first_prefill "raw": UltraQuantAttentionImpl._prefill_attention runs a first chunk (no cached
    prefix: max_query_len == max_seq_len, or q_len == seq_len per request) on the batch's own K/V; only later
    chunks read the cache. The row's scales "ignored": ultraquant_store takes no scale."""
    code = vllm_reference.excerpt("v1/attention/backends/ultraquant_attn.py", "UltraQuantAttentionImpl._prefill_attention")
    assert "attn_metadata.max_query_len == attn_metadata.max_seq_len" in code and "k=key," in code
    assert "First-chunk prefill" in code
    e = kv_emulations.get("ultraquant_4bit")
    assert (e.first_prefill, e.scales) == ("raw", "ignored")
    store = (vllm_reference.DIR / "vllm__v1__attention__ops__ultraquant__triton_store.py.txt").read_text()
    assert "scale" not in store.split("def ultraquant_store(", 1)[1].split(")", 1)[0].replace("constant_c", "")
