"""Builders for the eval tests: a tiny random llama, a mean-pooled MQA copy, a checkpoint with KV scales."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# KVTOOL_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the eval tests on a GPU, still in float32
DEVICE = os.environ.get("KVTOOL_TEST_DEVICE", "cpu")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def tiny_llama(folder: Path, tokenizer_from: Path, vocab_size: int, seed: int = 0) -> Path:
    """A 2-layer random llama (GQA 4/2 heads) that shares tokenizer_from's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_from, folder)
    return folder


def tiny_deepseek(folder: Path, tokenizer_from: Path, vocab_size: int, seed: int = 0) -> Path:
    """A 2-layer random DeepSeek-V3 MLA model (dense MLPs, q_lora_rank null as `convert --to mla` writes it;
    latent 16 + rope 8) that shares tokenizer_from's tokenizer. kv_a_layernorm's weights are spread (0.5..4) so
    the latent dims differ in scale, as a conversion's do."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                           topk_group=1, max_position_embeddings=1024, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.copy_(torch.linspace(0.5, 4.0, cfg.kv_lora_rank))
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_from, folder)
    return folder


def mean_pooled_mqa(src: Path, dst: Path) -> Path:
    """A copy of a llama checkpoint with K/V heads mean-pooled into one (num_key_value_heads=1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = model.config
    kv, hd = cfg.num_key_value_heads, cfg.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                pooled = proj.weight.reshape(kv, hd, -1).mean(0)
                proj.weight = torch.nn.Parameter(pooled.contiguous())
                proj.out_features = hd
    cfg.num_key_value_heads = 1
    model.save_pretrained(dst)
    copy_tokenizer(src, dst)
    return dst


def with_kv_scales(src: Path, dst: Path, scales: dict[int, tuple], spelling: str = "k_scale") -> Path:
    """src's weights (linked, not copied) plus a shard of per-layer K/V scales and a kv_cache_scheme.

    spelling: "k_scale" (compressed-tensors: self_attn.k_scale / v_scale), "attn.k_scale" (vLLM),
    or "kv_scale" (legacy: one tensor for both, takes the k value).
    """
    from safetensors.torch import save_file
    import torch

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
        "quantization_status": "compressed",
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    copy_tokenizer(src, dst)
    # a hard link, not a symlink: a shard the index names must not resolve outside the folder (KV704)
    try:
        os.link((src / "model.safetensors").resolve(), dst / "model-00001-of-00002.safetensors")
    except OSError:  # another file system
        shutil.copyfile(src / "model.safetensors", dst / "model-00001-of-00002.safetensors")
    tensors = {}
    for layer, (k, v) in scales.items():
        base = f"model.layers.{layer}.self_attn"
        if spelling == "kv_scale":
            tensors[f"{base}.kv_scale"] = torch.tensor(float(k))
            continue
        kname, vname = ("attn.k_scale", "attn.v_scale") if spelling == "attn.k_scale" else ("k_scale", "v_scale")
        tensors[f"{base}.{kname}"] = torch.as_tensor(k, dtype=torch.float32)
        tensors[f"{base}.{vname}"] = torch.as_tensor(v, dtype=torch.float32)
    save_file(tensors, str(dst / "model-00002-of-00002.safetensors"))
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        weight_map = {n: "model-00001-of-00002.safetensors" for n in f.keys()}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def reference_nll(model, ids, max_length: int, stride: int) -> tuple[float, int]:
    """(NLL sum, tokens) of the plain transformers loop from the HF perplexity guide (labels = -100 masking)."""
    import torch

    seq = torch.tensor(ids)[None].to(model.device)
    n = seq.shape[1]
    total, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, n, stride):
            end = min(begin + max_length, n)
            trg = end - prev_end
            inp = seq[:, begin:end]
            labels = inp.clone()
            labels[:, :-trg] = -100
            loss = model(input_ids=inp, labels=labels).loss
            valid = int((labels[:, 1:] != -100).sum())
            total += float(loss) * valid
            count += valid
            prev_end = end
            if end == n:
                break
    return total, count
