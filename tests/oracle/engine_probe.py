"""What one transformers release does with each config: run in a subprocess whose sys.path starts with that
release's folder (tests/oracle/engine_releases.py installs them), never imported by kvtool or the test process.

    python engine_probe.py CASES.jsonl OUT.jsonl

Each case ({"id", "config"}) is written to a folder and loaded the way users load it: AutoConfig.from_pretrained
(the config class of its model_type; trust_remote_code never set). Then a model is built with from_config -- the
config itself when it is tiny, else a shrunk copy (`_tiny`: two layers, at most two KV heads and two query heads
per KV head with hidden_size / heads and head_dim kept, small MLPs, four experts, a 512-token vocabulary; RoPE,
positions, windows and every per-layer list kept for those layers) loaded the same way -- its RoPE inverse
frequencies and attention scaling (the cos at position 0 of the rotary embedding's own forward) are read from the
rotary embedding of the model (or of the first layer's attention in releases before 4.43), and one forward of four
tokens runs: a release that reads the config but fails at the first forward refuses it. One JSON line per case:
loads, error (first line), the values the release read (rope_theta, torch_dtype, head_dim of the attention
module), forward, inv_freq, attention_scaling, shrunk.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import signal
import sys
import tempfile
import warnings
from pathlib import Path

CHEAP = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024, "intermediate_size": 1024}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _cheap(cfg: dict) -> bool:
    if isinstance(cfg.get("text_config"), dict):
        return False
    return "hidden_size" in cfg and "num_hidden_layers" in cfg and all(
        isinstance(cfg.get(k), int) and 0 < cfg[k] <= lim for k, lim in CHEAP.items() if k in cfg)


# per-layer lists are cut to the kept layers; sizes that do not touch attention or RoPE are made small
_LAYER_KEYS = ("num_hidden_layers",)
_MLP = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size")
_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk")
_OTHER_KV_KEYS = ("num_kv_heads", "n_head_kv", "multi_query_group_num", "multi_query")


def _tiny(cfg: dict) -> dict | None:
    """A small copy of a large config whose attention and RoPE geometry is the config's (None: not shrinkable)."""
    if isinstance(cfg.get("text_config"), dict):
        return None
    n, heads, hidden = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, heads, hidden)):
        return None
    if any(k in cfg for k in _OTHER_KV_KEYS):  # KV heads under another name (falcon...): not shrunk
        return None
    kv = cfg.get("num_key_value_heads")
    kv = kv if isinstance(kv, int) and not isinstance(kv, bool) and 0 < kv <= heads and heads % kv == 0 else heads
    out = dict(cfg)
    keep = min(n, 2)
    for k, v in cfg.items():  # per-layer lists (layer_types, indexer_types, mlp_layer_types...)
        if isinstance(v, list) and len(v) == n and k != "architectures":
            out[k] = v[:keep]
    out["num_hidden_layers"] = keep
    kv2 = min(kv, 2)
    heads2 = kv2 * min(heads // kv, 2)
    out["num_attention_heads"] = heads2
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"] is not None:
        out["num_key_value_heads"] = kv2
    if hidden % heads == 0:  # keep hidden_size / heads (what releases that ignore head_dim derive it from)
        out["hidden_size"] = heads2 * (hidden // heads)
    elif not isinstance(cfg.get("head_dim"), int):
        return None
    for k in _MLP:
        if isinstance(cfg.get(k), int) and cfg[k] > 128:
            out[k] = 128
    for k in _EXPERTS:
        if isinstance(cfg.get(k), int) and cfg[k] > 4:
            out[k] = 4
    for k in _TOP_K:
        if isinstance(cfg.get(k), int) and cfg[k] > 2:
            out[k] = 2
    for k in ("n_group", "topk_group"):
        if isinstance(cfg.get(k), int):
            out[k] = 1
    if isinstance(cfg.get("vocab_size"), int) and cfg["vocab_size"] > 512:
        out["vocab_size"] = 512
        for k, v in cfg.items():
            if k.endswith("_token_id") and isinstance(v, int) and v >= 512:
                out[k] = None
            elif k.endswith("_token_id") and isinstance(v, list):
                out[k] = [t for t in v if not isinstance(t, int) or t < 512] or None
    return out


def _attention_scaling(rot, dtype):
    """The factor the release multiplies cos / sin by (the cos at position 0), from the embedding's own forward."""
    import torch

    x = torch.zeros(1, 1, 2, 8, dtype=dtype)
    pos = torch.tensor([[0, 1]])
    for call in (lambda: rot(x, pos), lambda: rot(x, seq_len=2), lambda: rot(x, pos, seq_len=2)):
        try:
            cos = call()[0]
        except Exception:  # noqa: BLE001, S112 - the signature differs by release
            continue
        return float(cos.flatten()[0])
    return None


def _rotary(model):
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None:  # before 4.43 each attention module held its own
        layers = getattr(inner, "layers", None)
        attn = getattr(layers[0], "self_attn", None) if layers else None
        rot = getattr(attn, "rotary_emb", None)
    return rot if rot is not None and hasattr(rot, "inv_freq") else None


def _head_dim(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    hd = getattr(attn, "head_dim", None)
    return hd if isinstance(hd, int) else None


def _theta(conf, major: int):
    t = getattr(conf, "rope_theta", None)
    rp = getattr(conf, "rope_parameters", None) if major >= 5 else None  # 4.x keeps an unread dict as an attribute
    if isinstance(rp, dict):
        inner = rp.get("full_attention") if isinstance(rp.get("full_attention"), dict) else rp
        t = inner.get("rope_theta", t)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def probe(case: dict, folder: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])

    out = {"id": case["id"], "loads": False, "error": "", "forward": None, "inv_freq": None}
    (folder / "config.json").write_text(json.dumps(case["config"]), encoding="utf-8")
    try:
        conf = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - every refusal is a verdict
        out["error"] = _first_line(exc)
        return out
    out["loads"] = True
    dtype = getattr(conf, "torch_dtype", None)
    out["torch_dtype"] = None if dtype is None else str(dtype).replace("torch.", "")
    out["rope_theta"] = _theta(conf, major)
    out["shrunk"] = False
    if not _cheap(case["config"]):
        small = _tiny(case["config"])
        if small is None:
            return out
        (folder / "config.json").write_text(json.dumps(small), encoding="utf-8")
        try:
            conf = AutoConfig.from_pretrained(str(folder))
        except Exception as exc:  # noqa: BLE001 - shrinking made it unreadable: no forward verdict
            out["error"] = "shrunk: " + _first_line(exc)
            return out
        out["shrunk"] = True
    try:
        torch.manual_seed(0)
        # trust_remote_code=False: a config with auto_map builds the release's own class, never prompts (4.38's
        # prompt leaves a 15 s SIGALRM behind that fails a later case)
        model = AutoModelForCausalLM.from_config(conf, trust_remote_code=False).float()
        out["head_dim"] = _head_dim(model)
        rot = _rotary(model)
        if rot is not None:  # its own forward first: releases that set inv_freq there (4.4x's Phi-3 LongRoPE)
            out["attention_scaling"] = _attention_scaling(rot, torch.float32)
            out["inv_freq"] = [float(x) for x in rot.inv_freq.detach().double().flatten()]
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]))
        out["forward"] = True
    except Exception as exc:  # noqa: BLE001
        out["forward"], out["error"] = False, _first_line(exc)
    return out


def main(argv: list[str]) -> int:
    cases = [json.loads(line) for line in Path(argv[0]).read_text(encoding="utf-8").splitlines() if line.strip()]
    warnings.simplefilter("ignore")
    logging.disable(logging.ERROR)
    import transformers

    results = [{"transformers": transformers.__version__, "file": transformers.__file__}]
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                results.append(probe(case, folder))
            # 4.38's remote-code prompt (an auto_map config) arms a 15 s SIGALRM and leaves it armed when input()
            # fails: it would fail whichever case runs 15 s later
            signal.alarm(0)
    Path(argv[1]).write_text("".join(json.dumps(r) + "\n" for r in results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
