"""Folders for the hostile-input tests: a tiny llama, and checkpoints that ship Python code.

The Python files in the "evil" folders create the trap file (tests/hostile/harness.py TRAP_ENV)
when imported: if kvtool (or transformers on its behalf) ever runs checkpoint code, the test sees it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.kvtest import write_config, write_safetensors

LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 128, "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

PAYLOAD = '''import os
_trap = os.environ.get("KVTOOL_HOSTILE_TRAP")
if _trap:
    open(_trap, "w").write("checkpoint code ran")
'''


def llama_tensors(cfg: dict = LLAMA, rng=None) -> dict:
    rng = rng or np.random.default_rng(0)
    h, kv, hd = cfg["hidden_size"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                  p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, h),
                  p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                  p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                  p + "post_attention_layernorm.weight": (h,)})
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in t.items()}


def llama(folder: Path, cfg: dict = LLAMA, *, side_files: bool = True) -> Path:
    """A tiny llama folder: config, one safetensors shard, a generation config and a README."""
    write_config(folder, cfg)
    write_safetensors(folder / "model.safetensors", llama_tensors(cfg))
    if side_files:
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
        (folder / "README.md").write_text("# tiny llama\n")
    return folder


def big_llama(folder: Path, layers: int = 6, hidden: int = 1024) -> Path:
    """A llama large enough (~100+ MB) that converting it takes seconds: room to interrupt it."""
    cfg = {**LLAMA, "hidden_size": hidden, "intermediate_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 1024}
    return llama(folder, cfg)


def config_remote_code(folder: Path) -> Path:
    """An unknown model_type whose config.json auto_map names the checkpoint's own Python classes."""
    cfg = {"model_type": "evil_model", "architectures": ["EvilForCausalLM"], "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
           "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    write_config(folder, cfg)
    write_safetensors(folder / "model.safetensors", {"w": np.zeros((4, 4), np.float32)})
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (folder / name).write_text(PAYLOAD)
    return folder


def llama_with_tokenizer(folder: Path, tokenizer_from: Path) -> Path:
    """A tiny random llama that transformers can run, with tokenizer_from's tokenizer (SmolLM2's)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def tokenizer_remote_code(folder: Path, tokenizer_from: Path) -> Path:
    """A tiny llama whose tokenizer_config.json auto_map names the checkpoint's tokenizer code."""
    llama_with_tokenizer(folder, tokenizer_from)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.update({"tokenizer_class": "EvilTokenizer",
               "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}})
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    (folder / "tokenization_evil.py").write_text(PAYLOAD)
    return folder
