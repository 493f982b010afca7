"""Write the rule fixtures tests/data/rules/<CODE>/{fail,pass}*/ for the KV1xx, KV3xx-KV8xx rules.

Run `python tests/data/rules/build.py` after changing a fixture below; it rewrites only the codes
it defines (other rule owners add their folders by hand in the same layout). Each fixture is a model
folder: config.json, optionally tiny safetensors (numpy, a few KB), tokenizer / generation files,
and `kvtool-lint.json` holding lint options (e.g. {"tensor_parallel_size": 4}).
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# Real configs: the shared corpus next to the checkout (the committed fixtures keep a copy).
CORPUS = REPO.parent / "shared" / "configs"

LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
DEEPSEEK = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 32,
    "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 64, "max_position_embeddings": 512, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_layer_freq": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
           "num_experts_per_tok": 2, "sliding_window": None}
GEMMA3 = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 32,
    "max_position_embeddings": 2048, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"],
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 4,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
MPT = {
    "model_type": "mpt", "architectures": ["MPTForCausalLM"], "d_model": 16, "n_heads": 4, "n_layers": 2,
    "vocab_size": 32, "max_seq_len": 2048, "attn_config": {"alibi": True, "attn_type": "multihead_attention"},
    "torch_dtype": "bfloat16",
}
KV_SCHEME = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}}


def llama_tensors(cfg: dict, *, kv_heads: int | None = None, layers: int | None = None, vocab: int | None = None,
                  lm_head: bool = True, extra: dict | None = None) -> dict:
    """Tiny llama-layout weights; the keyword arguments deliberately break one dimension."""
    h, hd = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    kv = kv_heads if kv_heads is not None else cfg["num_key_value_heads"]
    f = np.float16
    t = {"model.embed_tokens.weight": np.zeros((vocab or cfg["vocab_size"], hidden), f),
         "model.norm.weight": np.ones((hidden,), f)}
    for i in range(layers if layers is not None else cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        t[f"{p}.q_proj.weight"] = np.zeros((h * hd, hidden), f)
        t[f"{p}.k_proj.weight"] = np.zeros((kv * hd, hidden), f)
        t[f"{p}.v_proj.weight"] = np.zeros((kv * hd, hidden), f)
        t[f"{p}.o_proj.weight"] = np.zeros((hidden, h * hd), f)
        t[f"model.layers.{i}.input_layernorm.weight"] = np.ones((hidden,), f)
    if lm_head:
        t["lm_head.weight"] = np.zeros((vocab or cfg["vocab_size"], hidden), f)
    t.update(extra or {})
    return t


def scales(cfg: dict, spelling: dict[str, str]) -> dict:
    """Per-layer scalar scales: spelling maps role -> suffix after self_attn (e.g. {"k": "k_scale"})."""
    return {f"model.layers.{i}.self_attn.{suffix}": np.array(0.05, np.float32)
            for i in range(cfg["num_hidden_layers"]) for suffix in spelling.values()}


def tokenizer(n_ids: int) -> dict:
    return {"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(n_ids)},
                                                           "merges": []}}


def write(folder: Path, config: dict, tensors: dict | None = None, *, options: dict | None = None,
          files: dict | None = None, metadata: dict | None = None, index: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)
    if options:
        (folder / "kvtool-lint.json").write_text(json.dumps(options) + "\n")
    for name, content in (files or {}).items():
        p = folder / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(json.dumps(content, indent=2) + "\n")
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def sharded(folder: Path, config: dict, tensors: dict, *, index_map: dict | None = None, no_index: bool = False,
            twice: str | None = None) -> None:
    """Two shards plus an index; index_map overrides or adds weight_map entries (None deletes);
    no_index leaves the index out; `twice` names a tensor stored in both shards."""
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    if twice is not None:
        for part in shards.values():
            if twice not in part:
                part.append(twice)
    folder.mkdir(parents=True, exist_ok=True)
    wm = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / fname))
        wm.update({n: fname for n in part})
    for k, v in (index_map or {}).items():
        if v is None:
            wm.pop(k, None)
        else:
            wm[k] = v
    write(folder, config, index=None if no_index else {"metadata": {"total_size": 0}, "weight_map": wm})


def c(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()


def build() -> None:
    F = {}  # "CODE/name" -> callable(folder)

    def fx(code, name, fn):
        F[f"{code}/{name}"] = fn

    # KV1xx heads ---------------------------------------------------------------------------
    fx("KV101", "fail_too_many", lambda d: write(d, c(LLAMA, num_key_value_heads=8)))
    fx("KV101", "fail_zero", lambda d: write(d, c(LLAMA, num_key_value_heads=0)))
    fx("KV101", "pass", lambda d: write(d, LLAMA))
    fx("KV102", "fail_mla_uneven", lambda d: write(d, c(DEEPSEEK, num_key_value_heads=3)))
    fx("KV102", "pass_mla", lambda d: write(d, DEEPSEEK))
    fx("KV102", "fail", lambda d: write(d, c(LLAMA, num_attention_heads=4, num_key_value_heads=3)))
    fx("KV102", "pass", lambda d: write(d, LLAMA))
    fx("KV103", "fail_tp4", lambda d: write(d, c(LLAMA, hidden_size=24, num_attention_heads=6, num_key_value_heads=2),
                                            options={"tensor_parallel_size": 4}))
    fx("KV103", "pass_tp4", lambda d: write(d, c(LLAMA, hidden_size=32, num_attention_heads=8),
                                            options={"tensor_parallel_size": 4}))
    fx("KV104", "fail_tp4", lambda d: write(d, c(LLAMA, hidden_size=48, num_attention_heads=12, num_key_value_heads=6),
                                            options={"tensor_parallel_size": 4}))
    fx("KV104", "pass_tp4_replicated", lambda d: write(d, c(LLAMA, hidden_size=48, num_attention_heads=12,
                                                            num_key_value_heads=2), options={"tensor_parallel_size": 4}))
    fx("KV104", "pass_tp2_split", lambda d: write(d, c(LLAMA, hidden_size=48, num_attention_heads=12,
                                                       num_key_value_heads=6), options={"tensor_parallel_size": 2}))
    fx("KV105", "fail", lambda d: write(d, c(LLAMA, head_dim=8)))
    fx("KV105", "pass", lambda d: write(d, c(LLAMA, head_dim=4)))
    fx("KV106", "fail", lambda d: write(d, c(LLAMA, hidden_size=18)))
    fx("KV106", "pass_explicit_head_dim", lambda d: write(d, c(LLAMA, hidden_size=18, head_dim=4, model_type="mistral",
                                                             architectures=["MistralForCausalLM"])))
    fx("KV106", "fail_llama_explicit_head_dim", lambda d: write(d, c(LLAMA, hidden_size=18, head_dim=4)))
    fx("KV107", "fail_partial", lambda d: write(d, c(LLAMA, hidden_size=64, head_dim=16, partial_rotary_factor=0.3125,
                                                     model_type="stablelm", architectures=["StableLmForCausalLM"])))
    fx("KV107", "fail_odd_head_dim", lambda d: write(d, c(LLAMA, hidden_size=20, num_attention_heads=4, head_dim=5)))
    fx("KV107", "pass_partial", lambda d: write(d, c(LLAMA, hidden_size=64, head_dim=16, partial_rotary_factor=0.25,
                                                     model_type="stablelm", architectures=["StableLmForCausalLM"])))

    # KV3xx sliding windows / layer types ---------------------------------------------------
    fx("KV301", "fail_zero", lambda d: write(d, c(GEMMA3, sliding_window=0)))
    fx("KV301", "fail_string", lambda d: write(d, c(GEMMA3, sliding_window="512")))
    fx("KV301", "pass_null", lambda d: write(d, c(QWEN2, sliding_window=None)))
    fx("KV301", "pass", lambda d: write(d, GEMMA3))
    fx("KV302", "fail_null_window", lambda d: write(d, c(QWEN2, use_sliding_window=True, sliding_window=None)))
    fx("KV302", "fail_no_layer", lambda d: write(d, c(QWEN2, use_sliding_window=True, sliding_window=4096,
                                                      max_window_layers=4)))
    fx("KV302", "pass_qwen25_disabled", lambda d: write(d, QWEN2))
    fx("KV302", "pass_enabled", lambda d: write(d, c(QWEN2, use_sliding_window=True, sliding_window=4096,
                                                     max_window_layers=2)))
    fx("KV303", "fail", lambda d: write(d, c(GEMMA3, sliding_window=4096)))
    fx("KV303", "pass", lambda d: write(d, GEMMA3))
    fx("KV304", "fail", lambda d: write(d, c(GEMMA3, layer_types=["sliding_attention"])))
    fx("KV304", "pass", lambda d: write(d, GEMMA3))
    fx("KV305", "fail", lambda d: write(d, c(GEMMA3, layer_types=["sliding", "full_attention"])))
    fx("KV305", "pass", lambda d: write(d, GEMMA3))

    # KV4xx MLA / MoE ------------------------------------------------------------------------
    fx("KV401", "fail_zero_rope", lambda d: write(d, c(DEEPSEEK, qk_rope_head_dim=0)))
    fx("KV401", "fail_v_string", lambda d: write(d, c(DEEPSEEK, v_head_dim="8")))
    fx("KV401", "fail_q_lora_zero", lambda d: write(d, c(DEEPSEEK, q_lora_rank=0)))
    fx("KV401", "pass", lambda d: write(d, DEEPSEEK))
    fx("KV402", "fail", lambda d: write(d, c(DEEPSEEK, qk_rope_head_dim=7)))
    fx("KV402", "pass", lambda d: write(d, DEEPSEEK))
    fx("KV403", "fail", lambda d: write(d, c(DEEPSEEK, head_dim=24, qk_nope_head_dim=24)))
    fx("KV403", "fail_qk_head_dim", lambda d: write(d, c(DEEPSEEK, qk_head_dim=32)))
    fx("KV403", "pass", lambda d: write(d, c(DEEPSEEK, head_dim=8, qk_head_dim=16)))
    for real, name in (("glm-5.2.json", "fail_glm52"), ("glm-5.json", "pass_glm5")):
        src = CORPUS / real
        fx("KV403", name, lambda d, src=src: write(d, json.loads(src.read_text())))
    # Real configs from the shared corpus, as named fixtures (the corpus README lists their sources).
    for code, name, real in (("KV302", "pass_qwen25_real", "qwen2.5-7b-instruct.json"),
                             ("KV303", "fail_phi35_real", "phi-3.5-mini-instruct.json"),
                             ("KV105", "fail_gemma2_real", "gemma-2-9b.json"),
                             ("KV506", "fail_command_r_real", "command-r-v01.json"),
                             ("KV504", "pass_tinyllama_real", "tinyllama-1.1b-chat-v0.4.json"),
                             ("KV504", "pass_gemma3_eos_list_real", "gemma-3-1b-it.json"),
                             ("KV411", "pass_qwen3_moe_real", "qwen3-30b-a3b.json"),
                             ("KV414", "pass_deepseek_v3_real", "deepseek-v3.json"),
                             ("KV703", "fail_phi2_remote_code_real", "phi-2-msft-remote-code.json")):
        fx(code, name, lambda d, src=CORPUS / real: write(d, json.loads(src.read_text())))
    fx("KV411", "fail", lambda d: write(d, c(MIXTRAL, num_experts_per_tok=10)))
    fx("KV411", "fail_zero", lambda d: write(d, c(MIXTRAL, num_experts_per_tok=0)))
    fx("KV411", "pass", lambda d: write(d, MIXTRAL))
    fx("KV412", "fail", lambda d: write(d, c(DEEPSEEK, n_shared_experts=-1)))
    fx("KV412", "pass_none", lambda d: write(d, c(DEEPSEEK, n_shared_experts=0)))
    fx("KV413", "fail_first_k", lambda d: write(d, c(DEEPSEEK, first_k_dense_replace=40)))
    fx("KV413", "fail_freq", lambda d: write(d, c(DEEPSEEK, moe_layer_freq=0)))
    fx("KV413", "fail_mlp_only", lambda d: write(d, c(QWEN2, model_type="qwen2_moe", num_experts=4,
                                                      num_experts_per_tok=2, decoder_sparse_step=1,
                                                      mlp_only_layers=[0, 9])))
    fx("KV413", "pass", lambda d: write(d, DEEPSEEK))
    fx("KV414", "fail_groups", lambda d: write(d, c(DEEPSEEK, n_group=3)))
    fx("KV414", "fail_topk_group", lambda d: write(d, c(DEEPSEEK, topk_group=3)))
    fx("KV414", "pass", lambda d: write(d, DEEPSEEK))

    # KV5xx dtype / vocab / positions -------------------------------------------------------
    fx("KV501", "fail_typo", lambda d: write(d, c(LLAMA, torch_dtype="bf16")))
    fx("KV501", "fail_int", lambda d: write(d, c(LLAMA, torch_dtype="int8")))
    fx("KV501", "fail_wrapper_top_level", lambda d: write(d, {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "dtype": "float17",
        "text_config": c(LLAMA, torch_dtype=_DROP, dtype="bfloat16"), "vision_config": {"model_type": "clip_vision_model"}}))
    fx("KV501", "pass_v5", lambda d: write(d, c(LLAMA, torch_dtype=_DROP, dtype="bfloat16")))
    fx("KV502", "fail", lambda d: write(d, c(LLAMA, dtype="bfloat16", torch_dtype="float32")))
    fx("KV502", "pass", lambda d: write(d, c(LLAMA, dtype="bfloat16", torch_dtype="bfloat16")))
    fx("KV503", "fail", lambda d: write(d, LLAMA, files={"tokenizer.json": tokenizer(40)}))
    fx("KV503", "pass_padded_vocab", lambda d: write(d, LLAMA, files={"tokenizer.json": tokenizer(30)}))
    fx("KV504", "fail_config", lambda d: write(d, c(LLAMA, eos_token_id=[2, 32])))
    fx("KV504", "fail_generation_config", lambda d: write(d, LLAMA, files={
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 99]}}))
    fx("KV504", "fail_type", lambda d: write(d, c(LLAMA, pad_token_id="</s>")))
    fx("KV504", "pass", lambda d: write(d, c(LLAMA, eos_token_id=[2, 31], pad_token_id=None), files={
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 31]}}))
    fx("KV505", "fail_mpt", lambda d: write(d, c(MPT, rope_scaling={"type": "linear", "factor": 4.0})))
    fx("KV505", "pass_mpt", lambda d: write(d, MPT))
    fx("KV506", "fail", lambda d: write(d, c(LLAMA, model_max_length=131072)))
    fx("KV506", "pass", lambda d: write(d, c(LLAMA, model_max_length=256)))

    # KV6xx weights vs config ----------------------------------------------------------------
    fx("KV601", "fail_kv_heads_edited", lambda d: write(d, LLAMA, llama_tensors(LLAMA, kv_heads=4)))
    fx("KV601", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV602", "fail_missing_layer", lambda d: write(d, c(LLAMA, num_hidden_layers=3), llama_tensors(LLAMA)))
    fx("KV602", "fail_extra_layer", lambda d: write(d, LLAMA, llama_tensors(LLAMA, layers=3)))
    fx("KV602", "pass_mtp_layer", lambda d: write(d, c(LLAMA, num_nextn_predict_layers=1),
                                                   llama_tensors(LLAMA, layers=3)))
    fx("KV603", "fail", lambda d: write(d, LLAMA, llama_tensors(LLAMA, vocab=40)))
    fx("KV603", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV604", "fail", lambda d: write(d, LLAMA, llama_tensors(LLAMA, lm_head=False)))
    fx("KV604", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV605", "fail", lambda d: write(d, c(LLAMA, tie_word_embeddings=True), llama_tensors(LLAMA)))
    fx("KV605", "pass", lambda d: write(d, c(LLAMA, tie_word_embeddings=True), llama_tensors(LLAMA, lm_head=False)))
    fx("KV606", "fail_header_too_large", lambda d: write(d, LLAMA, files={
        "model.safetensors": struct.pack("<Q", 200_000_000) + b"{}" + b"\0" * 16}))
    fx("KV606", "fail_bad_length", lambda d: write(d, LLAMA, files={
        "model.safetensors": struct.pack("<Q", 4096) + b'{"__metadata__": {}}'}))
    fx("KV606", "fail_empty_file", lambda d: write(d, LLAMA, files={"model.safetensors": b""}))
    fx("KV606", "fail_offsets_past_end", lambda d: write(d, LLAMA, files={"model.safetensors": _truncated(LLAMA)}))
    fx("KV606", "fail_overlapping_offsets", lambda d: write(d, LLAMA, files={"model.safetensors": _edited(
        LLAMA, lambda h: h["model.embed_tokens.weight"].update(data_offsets=h["lm_head.weight"]["data_offsets"]))}))
    fx("KV606", "fail_trailing_bytes", lambda d: write(d, LLAMA, files={
        "model.safetensors": _edited(LLAMA, lambda h: None, tail=b"\0" * 16)}))
    fx("KV606", "fail_metadata_not_strings", lambda d: write(d, LLAMA, files={
        "model.safetensors": _edited(LLAMA, lambda h: h.update(__metadata__={"format": "pt", "step": 100}))}))
    fx("KV606", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV606", "pass_metadata_null", lambda d: write(d, LLAMA, files={
        "model.safetensors": _edited(LLAMA, lambda h: h.update(__metadata__=None))}))
    fx("KV607", "fail", lambda d: write(d, LLAMA, index={"metadata": {}, "weight_map": None}))
    fx("KV607", "fail_empty", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={
        n: None for n in llama_tensors(LLAMA)}))
    fx("KV607", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV608", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={
        "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}))
    fx("KV608", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV609", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={"model.norm.weight": None}))
    fx("KV609", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV610", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={
        "model.norm.weight": "model-00003-of-00003.safetensors"}))
    fx("KV610", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV611", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), no_index=True))
    fx("KV611", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV612", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), twice="model.norm.weight"))
    fx("KV612", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))

    # KV7xx security ---------------------------------------------------------------------------
    # The .bin files hold a harmless marker, not a pickle: kvtool must flag them by name only.
    marker = b"not a pickle: kvtool never opens .bin files\n"
    fx("KV701", "fail", lambda d: write(d, LLAMA, files={"pytorch_model.bin": marker}))
    fx("KV701", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV702", "fail", lambda d: write(d, LLAMA, llama_tensors(LLAMA), files={"training_args.bin": marker}))
    fx("KV702", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    fx("KV703", "fail", lambda d: write(d, c(LLAMA, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})))
    fx("KV703", "pass", lambda d: write(d, LLAMA))
    fx("KV704", "fail", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={
        "model.norm.weight": "../outside.safetensors"}))
    fx("KV704", "fail_absolute", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA), index_map={
        "model.norm.weight": "/etc/passwd"}))
    fx("KV704", "pass", lambda d: sharded(d, LLAMA, llama_tensors(LLAMA)))

    # KV8xx KV-cache quantization --------------------------------------------------------------
    q = c(LLAMA, quantization_config=KV_SCHEME)
    fx("KV801", "fail_no_scales", lambda d: write(d, q, llama_tensors(LLAMA)))
    fx("KV801", "fail_v_missing", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(LLAMA, {"k": "k_scale"}))))
    fx("KV801", "pass", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(LLAMA, {"k": "k_scale", "v": "v_scale"}))))
    fx("KV801", "pass_modelopt", lambda d: write(
        d, c(LLAMA, quantization_config={"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}),
        llama_tensors(LLAMA, extra=scales(LLAMA, {"k": "k_proj.k_scale", "v": "v_proj.v_scale"}))))
    fx("KV801", "fail_output_scale_only", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(
        LLAMA, {"k": "k_proj.output_scale", "v": "v_proj.output_scale"}))))
    fx("KV801", "pass_legacy_kv_scale", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(LLAMA, {"kv": "kv_scale"}))))
    fx("KV802", "fail", lambda d: write(d, LLAMA, llama_tensors(LLAMA, extra=scales(LLAMA, {"k": "k_scale", "v": "v_scale"}))))
    fx("KV802", "pass", lambda d: write(d, LLAMA, llama_tensors(LLAMA)))
    int4 = c(LLAMA, quantization_config={**KV_SCHEME, "kv_cache_scheme": {
        "num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}})
    fx("KV804", "fail_int4_channel", lambda d: write(d, int4))
    fx("KV804", "pass_fp8_tensor", lambda d: write(d, q))
    fx("KV804", "pass_fp8_attn_head", lambda d: write(d, c(LLAMA, quantization_config={
        **KV_SCHEME, "kv_cache_scheme": {**KV_SCHEME["kv_cache_scheme"], "strategy": "attn_head"}})))
    fx("KV803", "fail_output_scale", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(
        LLAMA, {"k": "k_proj.output_scale", "v": "v_proj.output_scale"}))))
    fx("KV803", "fail_metadata", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(
        LLAMA, {"k": "k_scale", "v": "v_scale"})), metadata={"kvtool.kv_scale_point": "pre_rope"}))
    fx("KV803", "pass", lambda d: write(d, q, llama_tensors(LLAMA, extra=scales(
        LLAMA, {"k": "k_scale", "v": "v_scale"})), metadata={"kvtool.kv_scale_point": "post_rope"}))

    for code in sorted({k.split("/")[0] for k in F}):
        shutil.rmtree(HERE / code, ignore_errors=True)
    for key, fn in F.items():
        fn(HERE / key)
    print(f"wrote {len(F)} fixtures for {len({k.split('/')[0] for k in F})} rules under {HERE}")
    demo(HERE.parent / "lint_demo" / "broken-llama")


def demo(folder: Path) -> None:
    """The README's broken checkpoint: a KV-head count edited by hand, a bad dtype, an eos id past the
    vocabulary, a stray pickle, and FP8 KV declared without scales."""
    shutil.rmtree(folder, ignore_errors=True)
    cfg = c(LLAMA, num_key_value_heads=4, torch_dtype="bf16", eos_token_id=[2, 32],
            quantization_config=KV_SCHEME)
    write(folder, cfg, llama_tensors(LLAMA), files={
        "training_args.bin": b"not a pickle: kvtool never opens .bin files\n",
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 32]}})
    print(f"wrote {folder}")


def _truncated(cfg: dict) -> bytes:
    """A valid safetensors file cut short: its last tensor's offsets run past the end."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "m.safetensors"
        save_file(llama_tensors(cfg), str(p))
        data = p.read_bytes()
    return data[:-64]


def _edited(cfg: dict, edit, *, tail: bytes = b"") -> bytes:
    """A valid safetensors file whose header dict `edit` changed in place, with `tail` appended."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "m.safetensors"
        save_file(llama_tensors(cfg), str(p))
        data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:] + tail


if __name__ == "__main__":
    build()
