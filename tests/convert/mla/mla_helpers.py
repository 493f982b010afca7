"""A stand-in for kvtool.convert.mla.solve in the plumbing tests (tests only: the real solve is its own module).

`solve_layer` builds a deterministic MLA block from the source projections: the latent is the first kv_lora_rank
rows of the stacked K and V projections, the rope key is KV head 0's rows of the pairs the rope part turns with
(MlaRope.source_pairs), each query head keeps its own rows; no calibration maths. `collect_stats` records what
the calibration replay gave it, so a test can see it ran on every layer."""

from __future__ import annotations

import shutil
import sys
import types

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def rope_rows(pairs, head_dim: int) -> list[int]:
    """The source rows (rotate_half order) of `pairs`, in the rope part's rotate_half order."""
    return list(pairs) + [j + head_dim // 2 for j in pairs]


def solve_layer(weights, stats, shape, rope):
    q, k, v, o = (weights[f"{n}_proj.weight"] for n in "qkvo")
    H, hd, r, R = shape.num_heads, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank
    KV = k.shape[0] // hd
    rows = rope_rows(rope.source_pairs, hd)
    qh = q.reshape(H, hd, -1)
    q_new = torch.cat([qh, qh[:, rows]], dim=1).reshape(H * (hd + r), -1)
    latent = torch.cat([k, v])[:R]
    kv_a = torch.cat([latent, k[:hd][rows]])
    kv_b = torch.zeros(H, hd + shape.v_head_dim, R)
    for h in range(H):  # query head h reads KV head h // (H / KV), where the latent holds its rows
        g = h // (H // KV)
        for j in range(hd):
            for part, base in ((0, g * hd), (hd, KV * hd + g * hd)):
                if base + j < R:
                    kv_b[h, part + j, base + j] = 1.0
    return {"q_proj.weight": q_new, "kv_a_proj_with_mqa.weight": kv_a,
            "kv_a_layernorm.weight": torch.linspace(0.5, 1.5, R), "kv_b_proj.weight": kv_b.reshape(-1, R),
            "o_proj.weight": o}


def fake_solve_module(calls: list) -> types.ModuleType:
    mod = types.ModuleType("kvtool.convert.mla.solve")

    def collect_stats(inputs, weights, shape, rope):
        calls.append((tuple(inputs.x.shape), sorted(weights), shape))
        return {"tokens": inputs.x.shape[0] * inputs.x.shape[1]}

    mod.collect_stats = collect_stats
    mod.solve_layer = solve_layer
    mod.provenance = lambda: {"solve": "tests/convert/mla/mla_helpers.py"}
    return mod


def install_fake_solve(monkeypatch) -> list:
    """kvtool.convert.mla.solve replaced by the stand-in; returns the list collect_stats appends to."""
    import kvtool.convert.mla as pkg

    calls: list = []
    mod = fake_solve_module(calls)
    monkeypatch.setitem(sys.modules, "kvtool.convert.mla.solve", mod)
    monkeypatch.setattr(pkg, "solve", mod, raising=False)
    return calls


def tiny_llama(folder, tokenizer_dir, *, kv_heads=2, heads=4, head_dim=16, layers=2, tied=True, seed=0):
    """A tiny random llama sharing SmolLM2's tokenizer (the calibration reads text)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                               vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=tied,
                               rope_theta=10000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def reference_attention(t: dict, shape, rope, x: torch.Tensor, eps: float) -> torch.Tensor:
    """MLA attention of one layer computed here from the solve's tensors (rotate_half rope order, the RoPE
    frequencies MlaRope gives), causal, x [T, hidden] -> [T, hidden]: what the written checkpoint must compute."""
    H, nope, r, R, dv = (shape.num_heads, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank,
                         shape.v_head_dim)
    T = x.shape[0]
    q = (x @ t["q_proj.weight"].T).reshape(T, H, nope + r)
    kv_a = x @ t["kv_a_proj_with_mqa.weight"].T
    c, k_rot = kv_a[:, :R], kv_a[:, R:]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * t["kv_a_layernorm.weight"]
    kv = (c @ t["kv_b_proj.weight"].T).reshape(T, H, nope + dv)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    inv = torch.tensor(rope.rope_inv_freq, dtype=torch.float64)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    q_rot = q[..., nope:] * cos[:, None] + rotate_half(q[..., nope:]) * sin[:, None]
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    scores = (torch.einsum("thd,shd->hts", q[..., :nope], k_nope)
              + torch.einsum("thd,sd->hts", q_rot, k_rot)) * (nope + r) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * dv)
    return out @ t["o_proj.weight"].T
