"""Stand-ins for the maths modules in the plumbing tests (tests only): kvtool.convert.mla.solve, .stats and .rope
are the solve's own, with their interfaces (solve_layer(weights, stats, shape, rope) with rope rows in DeepSeek's
interleaved order, mla_output(x, tensors, shape, rope); collect_stats(model, ids, convert=None) -> layer -> stats,
calling convert(layer, stats) as the forward reaches each layer; SourceRope.of_config(config)).

`solve_layer` builds a deterministic MLA block from the source projections: the latent is the first kv_lora_rank
rows of the stacked K and V projections, the rope key is KV head 0's rows of the source's fastest
qk_rope_head_dim / 2 pairs, each query head keeps its own rows; no calibration maths. `collect_stats` records
what the calibration gave it, so a test can see it ran."""

from __future__ import annotations

import shutil
import sys
import types

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def rope_rows(rope_dim: int, head_dim: int) -> list[int]:
    """The source rows (rotate_half order) of its first rope_dim / 2 pairs, in DeepSeek's interleaved order."""
    return [row for j in range(rope_dim // 2) for row in (j, j + head_dim // 2)]


def solve_layer(weights, stats, shape, rope):
    q, k, v, o = (weights[f"{n}_proj.weight"] for n in "qkvo")
    H, nope, r, R, hd = (shape.num_heads, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank,
                         shape.v_head_dim)
    KV = k.shape[0] // hd
    rows = rope_rows(r, hd)
    qh = q.reshape(H, hd, -1)
    q_new = torch.cat([qh[:, :nope], qh[:, rows]], dim=1).reshape(H * (nope + r), -1)
    latent = torch.cat([k, v])[:R]
    kv_a = torch.cat([latent, k[:hd][rows]])
    kv_b = torch.zeros(H, nope + hd, R)
    for h in range(H):  # query head h reads KV head h // (H / KV), where the latent holds its rows
        g = h // (H // KV)
        for part, base, n in ((0, g * hd, nope), (nope, KV * hd + g * hd, hd)):
            for j in range(n):
                if base + j < R:
                    kv_b[h, part + j, base + j] = 1.0
    return {"q_proj.weight": q_new, "kv_a_proj_with_mqa.weight": kv_a,
            "kv_a_layernorm.weight": torch.linspace(0.5, 1.5, R), "kv_b_proj.weight": kv_b.reshape(-1, R),
            "o_proj.weight": o}


class SourceRope:
    def __init__(self, theta: float, head_dim: int):
        self.theta, self.head_dim = theta, head_dim

    @classmethod
    def of_config(cls, config: dict) -> "SourceRope":
        return cls(float(config.get("rope_theta", 10000.0)),
                   int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]))


def fake_modules(calls: list) -> dict[str, types.ModuleType]:
    solve = types.ModuleType("kvtool.convert.mla.solve")
    solve.SolveOptions = lambda horizon, **kw: types.SimpleNamespace(horizon=horizon, **kw)
    solve.solve_layer = lambda weights, stats, shape, rope, options: (
        calls.append(("solve", sorted(weights), stats, options.horizon)) or solve_layer(weights, stats, shape, rope))
    solve.mla_output = lambda x, tensors, shape, rope: calls.append(("output", tuple(x.shape))) or x
    solve.provenance = lambda: {"solve": "tests/convert/mla/mla_helpers.py"}
    stats = types.ModuleType("kvtool.convert.mla.stats")

    def collect_stats(model, ids, convert=None):
        calls.append(("stats", type(model).__name__, tuple(ids.shape)))
        out = {i: {"layer": i} for i in range(model.config.num_hidden_layers)}
        for i, st in out.items():
            if convert is not None:
                convert(i, st)(torch.zeros(*ids.shape, model.config.hidden_size))
        return out

    stats.collect_stats = collect_stats
    rope = types.ModuleType("kvtool.convert.mla.rope")
    rope.SourceRope = SourceRope
    return {"solve": solve, "stats": stats, "rope": rope}


def install_fake_solve(monkeypatch) -> list:
    """kvtool.convert.mla.solve / stats / rope replaced by the stand-ins; returns the list of their calls."""
    import kvtool.convert.mla as pkg

    calls: list = []
    for name, mod in fake_modules(calls).items():
        monkeypatch.setitem(sys.modules, f"kvtool.convert.mla.{name}", mod)
        monkeypatch.setattr(pkg, name, mod, raising=False)
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


def reference_attention(t: dict, shape, source_theta: float, head_dim: int, x: torch.Tensor, eps: float) -> torch.Tensor:
    """MLA attention of one layer computed here from the solve's tensors (rope rows in interleaved pairs (2i, 2i+1)
    turning as the source's pair i, theta^(-2i / head_dim)), causal, x [T, hidden] -> [T, hidden]: what the
    written checkpoint must compute (softmax scale (nope + rope)^-0.5)."""
    H, nope, r, R, dv = (shape.num_heads, shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank,
                         shape.v_head_dim)
    T = x.shape[0]
    q = (x @ t["q_proj.weight"].T).reshape(T, H, nope + r)
    kv_a = x @ t["kv_a_proj_with_mqa.weight"].T
    c, k_rot = kv_a[:, :R], kv_a[:, R:]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * t["kv_a_layernorm.weight"]
    kv = (c @ t["kv_b_proj.weight"].T).reshape(T, H, nope + dv)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    inv = source_theta ** (-torch.arange(r // 2, dtype=torch.float64) * 2 / head_dim)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()

    def turn(z):  # pairs (2i, 2i + 1)
        a, b = z[..., 0::2], z[..., 1::2]
        c, s = (cos[:, None], sin[:, None]) if z.dim() == 3 else (cos, sin)
        return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)

    q_rot, k_rot = turn(q[..., nope:]), turn(k_rot)
    scores = (torch.einsum("thd,shd->hts", q[..., :nope], k_nope)
              + torch.einsum("thd,sd->hts", q_rot, k_rot)) * (nope + r) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * dv)
    return out @ t["o_proj.weight"].T
