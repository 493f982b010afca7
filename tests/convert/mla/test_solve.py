"""kvtool.convert.mla.solve against transformers itself: a tiny random llama's attention, converted, run as
transformers' DeepseekV3Attention (q_lora_rank null, rope_interleave, qk_head_dim**-0.5)."""

from __future__ import annotations

import pytest
import torch

from kvtool.convert.defaults import MLA_SOLVES
from kvtool.convert.mla.rope import SourceRope, mla_rope_parameters, rope_pairs, static_pairs
from kvtool.convert.mla.shape import MlaShape
from kvtool.convert.mla.solve import SolveOptions, constant_direction, latent_of, mla_contexts, rms_variation, solve_layer
from kvtool.convert.mla.stats import MlaStats

HIDDEN, HEADS, HD, THETA = 32, 4, 8, 10000.0


def _llama(kv_heads: int, seed: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HD,
                      rope_theta=THETA, intermediate_size=64, num_hidden_layers=1, vocab_size=16)
    cfg._attn_implementation = "eager"
    attn = LlamaAttention(cfg, layer_idx=0).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, attn, LlamaRotaryEmbedding(cfg)


def _inputs(seed: int = 1, batch: int = 4, seq: int = 24) -> torch.Tensor:
    """RMS-normalised rows with a mean direction, as an attention input after input_layernorm."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, HIDDEN, generator=g) + 3.0 * torch.randn(HIDDEN, generator=g)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))


def _source(attn, rotary, x):
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = rotary(x, pos)
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(x, (cos, sin), mask)[0]


def _weights(attn) -> dict:
    return {f"{n}.weight": getattr(attn, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}


def _deepseek(shape: MlaShape, rope: SourceRope, tensors: dict, x: torch.Tensor, identity_norm: bool = False):
    """transformers' DeepseekV3Attention with the tensors, on x (causal)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rp = mla_rope_parameters(rope, shape.qk_rope_head_dim)
    cfg = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                           kv_lora_rank=shape.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=shape.qk_rope_head_dim,
                           qk_nope_head_dim=shape.qk_nope_head_dim, v_head_dim=shape.v_head_dim, attention_bias=False,
                           num_hidden_layers=1, vocab_size=16, **rp)
    cfg._attn_implementation = "eager"
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
    attn.load_state_dict(tensors, strict=True)
    if identity_norm:
        attn.kv_a_layernorm = torch.nn.Identity()
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(x, pos)
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(x, (cos, sin), mask)[0]


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _solve(kv_heads, shape, options, seed=0):
    cfg, attn, rotary = _llama(kv_heads, seed)
    rope = SourceRope(theta=THETA, head_dim=HD, rotary_dim=HD)
    x = _inputs()
    y = _source(attn, rotary, x)
    stats = MlaStats.of(x, y, attn.scaling)
    return rope, x, y, solve_layer(_weights(attn), stats, shape, rope, options)


def test_full_rank_mqa_reproduces_the_source_attention_in_transformers():
    # one KV head, every pair in the shared rope key, a latent as wide as the values: nothing is lost, so
    # DeepseekV3Attention (without its latent norm) must give the llama attention's output
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD, qk_rope_head_dim=HD, qk_nope_head_dim=0,
                     v_head_dim=HD)
    rope, x, y, t = _solve(1, shape, SolveOptions(norm="identity", o_ridge=None))
    assert {n: tuple(v.shape) for n, v in t.items()} == shape.weight_shapes()
    assert _rel(_deepseek(shape, rope, t, x, identity_norm=True), y) < 1e-4


def test_reference_contexts_match_transformers_deepseek():
    # mla_contexts (the refit's forward) is transformers' DeepseekV3Attention, latent norm included
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=4,
                     v_head_dim=HD)
    rope, x, y, t = _solve(2, shape, SolveOptions(o_ridge=None))
    ctx = mla_contexts(x.double(), {n: v.double() for n, v in t.items()}, shape, rope)
    ours = (ctx @ t["o_proj.weight"].double().T).float()
    assert _rel(ours, _deepseek(shape, rope, t, x)) < 1e-4


def test_rope_part_takes_the_fastest_pairs_and_static_pairs_are_the_slowest():
    rope = SourceRope(theta=THETA, head_dim=HD, rotary_dim=HD)
    assert rope_pairs(rope, 4).tolist() == [0, 1]
    assert static_pairs(rope, 8192, 1.0).tolist() == [False, False, False, False]
    assert static_pairs(rope, 16, 1.0).tolist() == [False, False, True, True]  # 100^-1, 100^-1.5 rad per position
    with pytest.raises(ValueError):
        rope_pairs(rope, 3)
    with pytest.raises(ValueError):
        mla_rope_parameters(SourceRope(THETA, HD, HD, scaling={"rope_type": "llama3", "factor": 8.0}), 4)


@pytest.mark.parametrize("rotating", ["drop", "nope"])
def test_pairs_outside_the_rope_part(rotating):
    # with 1 KV head and latent room for everything, the only loss is the pairs outside the rope part: keeping
    # them unrotated beats dropping them over a short context where they barely turn (theta large)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HD,
                      rope_theta=1e6, intermediate_size=64, num_hidden_layers=1, vocab_size=16)
    cfg._attn_implementation = "eager"
    attn = LlamaAttention(cfg, layer_idx=0).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    rope = SourceRope(theta=1e6, head_dim=HD, rotary_dim=HD)
    x = _inputs()
    y = _source(attn, LlamaRotaryEmbedding(cfg), x)
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=4 + HD, qk_rope_head_dim=4, qk_nope_head_dim=4,
                     v_head_dim=HD)
    t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, rope,
                    SolveOptions(norm="identity", o_ridge=None, rotating_pairs=rotating, static_angle=0.0))
    err = _rel(_deepseek(shape, rope, t, x, identity_norm=True), y)
    # pair 2 turns 1e6^-0.5 = 1e-3 rad per position, pair 3 1e-4.5: over 24 positions nearly static
    if rotating == "nope":
        assert err < 0.02
    else:
        assert err > 0.05


def test_constant_latent_dimension_steadies_the_rms_and_helps():
    # the latent norm divides each token's latent by its RMS; a near-constant latent dimension makes that
    # divisor steady, so the converted block (kv_a_layernorm included) is closer to the source than without it
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD + 1, qk_rope_head_dim=HD,
                     qk_nope_head_dim=0, v_head_dim=HD)
    errs, cvs = {}, {}
    for norm in ("constant", "none"):
        rope, x, y, t = _solve(1, shape, SolveOptions(norm=norm, o_ridge=None))
        errs[norm] = _rel(_deepseek(shape, rope, t, x), y)
        cvs[norm] = rms_variation(x.reshape(-1, HIDDEN).double() @ t["kv_a_proj_with_mqa.weight"][:shape.kv_lora_rank].double().T)
    assert cvs["constant"] < 0.5 * cvs["none"]
    assert errs["constant"] < 0.5 * errs["none"]
    assert errs["constant"] < 0.05


def test_constant_direction_is_the_steadiest():
    x = _inputs(seed=3, batch=8, seq=32).reshape(-1, HIDDEN).double()
    from kvtool.convert.aware.linalg import augmented_covariance

    w = constant_direction(augmented_covariance(x))
    p = x @ w
    steady = float(p.std() / p.mean().abs())
    for _ in range(20):  # no random direction is steadier
        r = x @ torch.randn(HIDDEN, dtype=torch.float64)
        assert float(r.std() / r.mean().abs()) > steady


def test_latent_of_is_rmsnorm():
    c = torch.randn(5, 7, dtype=torch.float64)
    norm = torch.nn.RMSNorm(7, eps=1e-6, dtype=torch.float64)
    assert torch.allclose(latent_of(c, torch.eye(7, dtype=torch.float64), "constant"), norm(c).detach())


def test_rope_parameters_reproduce_the_source_frequencies():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rope = SourceRope(theta=100000.0, head_dim=64, rotary_dim=64)
    for dr in (16, 32, 64):
        cfg = DeepseekV3Config(qk_rope_head_dim=dr, **mla_rope_parameters(rope, dr))
        got = DeepseekV3RotaryEmbedding(cfg).inv_freq.double()
        assert torch.allclose(got, rope.pair_angles()[rope_pairs(rope, dr)], rtol=1e-5)


@pytest.mark.parametrize("strategy", ["mqa-seed", "joint"])
def test_a_latent_wider_than_the_calibration_and_the_hidden_size_solves_finite(strategy):
    # the vLLM lane's --kv-rank 512 on a 256-wide model calibrated on 256 tokens (docs/vllm-lane.md) in small: a
    # latent of 48 over a 32-wide input seen on 16 tokens; the covariance is singular and most latent rows carry
    # nothing on the calibration: they stay zero (kvtool.convert.mla.solve._latent, _solve's pinv), never 1e300
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=48, qk_rope_head_dim=4, qk_nope_head_dim=4,
                     v_head_dim=HD)
    cfg, attn, rotary = _llama(HEADS)
    rope = SourceRope(theta=THETA, head_dim=HD, rotary_dim=HD)
    x = _inputs(batch=1, seq=16)
    y = _source(attn, rotary, x)
    options = SolveOptions(**MLA_SOLVES[strategy])  # as the write builds them (kvtool/convert/mla/write.py)
    t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, rope, options)
    assert all(bool(torch.isfinite(v).all()) for v in t.values()), [n for n, v in t.items() if not torch.isfinite(v).all()]
    out = _deepseek(shape, rope, t, x)
    assert torch.isfinite(out).all() and _rel(out, y) < 0.5
