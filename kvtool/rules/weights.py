"""Weights vs config, from safetensors headers only (KV6xx).

Tensor names come from the architecture table's templates (weights.attention, q/k/v/o/qkv, mla,
embed, lm_head); nothing here branches on model_type.
"""

from __future__ import annotations

import re

from kvtool.model.weight_shapes import MAX_LAYERS, embedding_mismatch, projection_mismatches
from kvtool.rules.registry import checker, define
from kvtool.values import is_int as _is_int

# Layers beyond num_hidden_layers that checkpoints legitimately carry (multi-token prediction).
EXTRA_LAYER_KEYS = ("num_nextn_predict_layers",)

define("KV601", "projection-shape-mismatch", "error",
       "An attention projection's shape does not match heads x head_dim x hidden_size",
       """
       What it does: reads the shapes of the attention projections from the safetensors headers
       (q/k/v/o, a fused qkv, or the MLA projections, named by the architecture table) and compares
       them with the config: q is (num_heads x head_dim, hidden), k and v (kv_heads x head_dim, hidden),
       o (hidden, num_heads x head_dim), fused qkv ((num_heads + 2 x kv_heads) x head_dim, hidden).
       Why it matters: a config edited without converting the weights (e.g. num_key_value_heads
       changed by hand) fails at load with a size mismatch, or loads a reshaped, meaningless matrix.
       Example: num_key_value_heads 2 in config.json, k_proj.weight of shape [256, 64] (4 heads x 64).
       Fix: restore the config the weights were trained with, or convert the weights
       (`kvtool convert`).
       """, hint="make config.json describe the stored weights (or convert the weights)", topic="weights")

define("KV602", "layer-count-mismatch", "error",
       "The layers stored in the weights do not match num_hidden_layers",
       """
       What it does: counts the decoder layers present in the safetensors headers (by the table's
       layer-name template) and compares with num_hidden_layers, allowing the extra
       multi-token-prediction layers a config declares (num_nextn_predict_layers).
       Why it matters: missing layers are randomly initialised at load; extra layers are silently
       ignored. Both are usually a truncated upload or a config from another model size.
       Example: num_hidden_layers 32 with tensors for model.layers.0 .. model.layers.29.
       Fix: upload the missing shards, or correct num_hidden_layers.
       """, hint="make num_hidden_layers match the stored layers", topic="weights")

define("KV603", "embedding-rows-mismatch", "error",
       "The embedding matrix's row count differs from vocab_size",
       """
       What it does: compares the first dimension of the token-embedding tensor with vocab_size.
       Why it matters: transformers refuses to load a mismatched embedding, and engines that pad
       the vocabulary compute the wrong padding.
       Example: vocab_size 32000 with model.embed_tokens.weight of shape [32064, 4096].
       Fix: set vocab_size to the number of embedding rows (after resize_token_embeddings).
       """, hint="set vocab_size to the embedding's row count", topic="weights")

define("KV604", "lm-head-missing", "error",
       "tie_word_embeddings is false but the checkpoint has no lm_head",
       """
       What it does: when the config says the output projection is not tied to the embeddings,
       checks that the lm_head tensor is stored.
       Why it matters: without it the output layer is randomly initialised at load: the model
       produces noise with no error at all.
       Example: {"tie_word_embeddings": false} and no lm_head.weight in any shard.
       Fix: set tie_word_embeddings to true if the model ties them, or add the missing tensor.
       """, hint="set tie_word_embeddings true, or store lm_head.weight", topic="weights")

define("KV605", "lm-head-ignored", "warning",
       "tie_word_embeddings is true but the checkpoint also stores an lm_head",
       """
       What it does: flags a stored lm_head tensor on a model whose config ties the output
       projection to the embeddings.
       Why it matters: with tied embeddings, transformers and vLLM replace (or skip) the stored
       lm_head, so if it differs from the embeddings the trained output layer is silently lost.
       Example: {"tie_word_embeddings": true} and lm_head.weight present.
       Fix: set tie_word_embeddings false if the head was trained separately, or drop the tensor.
       """, hint="set tie_word_embeddings false if the stored lm_head is distinct", topic="weights")

define("KV606", "safetensors-header-invalid", "error",
       "A safetensors file is one the safetensors library refuses to open",
       """
       What it does: validates every safetensors header by the library's own rules (safetensors
       0.8.0, src/tensor.rs read_metadata / Metadata::validate) without reading tensor data: the
       8-byte length (at most 100 MB, inside the file), UTF-8 JSON as serde_json reads it, a
       string-to-string __metadata__ given once, known dtypes, integer shapes, and data_offsets that,
       sorted, tile the data section from 0 to the last byte of the file with no gap, overlap or
       trailing bytes, each tensor holding exactly shape x dtype bytes.
       Why it matters: the library refuses such a file, so the model does not load; a tool that
       reads it anyway (overlapping offsets) hands one tensor's bytes to another.
       Example: two tensors with data_offsets [0, 4096], or 16 bytes after the last tensor.
       Fix: re-download or re-save the file.
       """, hint="re-download or re-save the safetensors file", topic="weights")

define("KV607", "index-invalid", "error",
       "model.safetensors.index.json has no usable weight_map (missing, empty, or not file names)",
       """
       What it does: checks that the sharded-checkpoint index has a weight_map object whose values
       are shard file names.
       Why it matters: loaders find every tensor through the weight_map; without it nothing loads.
       Example: {"metadata": {...}, "weight_map": null}
       Fix: regenerate the index (save_pretrained writes it).
       """, hint="regenerate model.safetensors.index.json", topic="weights")

define("KV608", "index-entry-missing", "error",
       "The index maps a tensor to a shard that does not contain it",
       """
       What it does: checks every weight_map entry: the named shard must hold that tensor.
       Why it matters: loaders open the shard the index names and fail with a missing-key error.
       Example: "model.layers.3.mlp.up_proj.weight": "model-00002-of-00004.safetensors" when that
       tensor is in shard 3.
       Fix: regenerate the index from the shards.
       """, hint="regenerate the index from the shards", topic="weights")

define("KV609", "index-unlisted-tensor", "warning",
       "A shard holds a tensor the index does not list",
       """
       What it does: flags tensors stored in a shard but absent from the index's weight_map.
       Why it matters: loaders that follow the index never load them; if the model needs them they
       are randomly initialised.
       Example: k_scale tensors added to a shard by a quantization script that did not update the index.
       Fix: regenerate the index from the shards.
       """, hint="regenerate the index from the shards", topic="weights")

define("KV610", "shard-missing", "error",
       "A shard file named by the index does not exist",
       """
       What it does: checks that every file the index's weight_map names exists in the model folder.
       Why it matters: the model cannot load; usually an interrupted download or upload.
       Example: weight_map names model-00004-of-00004.safetensors, which is absent.
       Fix: download or upload the missing shard.
       """, hint="download or upload the missing shard", topic="weights")

define("KV611", "safetensors-without-index", "error",
       "Several safetensors files and no model.safetensors.index.json",
       """
       What it does: flags a model folder with more than one *.safetensors file and no index.
       Why it matters: without an index transformers reads only model.safetensors and silently
       ignores the other files (or finds no weights at all when none has that name), so which
       files form the model is ambiguous; kvtool refuses to guess.
       The same holds for an index beside a model.safetensors it does not name: transformers loads
       that file alone (it looks for the index only when model.safetensors is absent), vLLM the
       shards the index lists.
       Example: model-00001-of-00002.safetensors and model-00002-of-00002.safetensors, no index.
       Fix: add the index (save_pretrained writes it), or remove the files that are not the model.
       """, hint="add model.safetensors.index.json or remove the stray files", topic="weights")

define("KV612", "tensor-in-two-shards", "error",
       "One tensor name is stored in two safetensors files",
       """
       What it does: flags a tensor name that appears in more than one shard.
       Why it matters: which copy a loader uses depends on the index or on file order; the other
       copy is silently ignored, and the two may differ.
       Example: model.norm.weight in both model-00001-of-00002 and model-00002-of-00002.
       Fix: regenerate the shards so each tensor is stored once.
       """, hint="re-save the checkpoint so each tensor is stored once", topic="weights")

define("KV613", "weights-not-pulled", "info",
       "The weight files are Git LFS pointers: the weights were not pulled, so no weight check ran",
       """
       What it does: recognises Git LFS pointer files (`version https://git-lfs.github.com/spec/v1`, `oid`,
       `size`) where safetensors shards should be, reports them once with the size each stands for, and skips
       every check that reads safetensors headers (KV6xx shapes, layer count, embedding, lm_head, KV8xx scales);
       the config-only rules still run. An info by default; `kvtool lint --require-weights` makes it an error.
       Why it matters: a repository cloned without LFS (CI checkouts often are) holds ~130-byte text files;
       read as safetensors they look corrupt (a header "length" of ~2.3e18 bytes) and hide the real cause.
       Example: model-00001-of-00004.safetensors is 134 bytes starting with "version https://git-lfs...".
       Fix: `git lfs install && git lfs pull`; in GitHub Actions, `actions/checkout` with `lfs: true`.
       """, hint="git lfs install && git lfs pull (GitHub Actions: actions/checkout with `lfs: true`)",
       topic="weights")

_READER_CODES = {"header": "KV606", "index-invalid": "KV607", "index-missing-tensor": "KV608",
                 "index-extra": "KV609", "index-missing-file": "KV610",
                 "unindexed-shards": "KV611", "tensor-twice": "KV612"}


@checker("weights")
def check_lfs_pointers(ctx) -> None:
    pointers = ctx.checkpoint.lfs_pointers
    if pointers:
        from kvtool.io.lfs import not_pulled_message

        ctx.report("KV613", not_pulled_message(pointers) + "; the weight checks were skipped",
                   file=ctx.file_of(pointers[0].file),
                   severity="error" if ctx.options.require_weights else None)


@checker("weights")
def check_reader_problems(ctx) -> None:
    for prob in ctx.checkpoint.problems:
        code = _READER_CODES.get(prob.kind)
        if code is None:
            continue
        what = f"{prob.tensor}: " if prob.tensor and prob.kind == "header" else ""
        ctx.report(code, f"{what}{prob.message}", path=prob.tensor,
                   file=ctx.file_of(prob.file) if prob.file else None)


@checker("weights")
def check_projection_shapes(ctx) -> None:
    for m in projection_mismatches(ctx.spec, ctx.checkpoint.tensors):
        ctx.report("KV601", m.message(), path=m.name, file=ctx.file_of(ctx.checkpoint.tensors[m.name].file))


def _incomplete(ckpt) -> bool:
    return any(p.is_error for p in ckpt.problems)


def _layer_pattern(spec) -> re.Pattern | None:
    tmpl = spec.arch.weights.get("layer")
    if not tmpl or "{layer}" not in tmpl:
        return None
    return re.compile("^" + re.escape(tmpl).replace(re.escape("{layer}"), r"(\d+)") + r"\.")


@checker("weights")
def check_layer_count(ctx) -> None:
    spec, tensors = ctx.spec, ctx.checkpoint.tensors
    n = spec.num_layers
    pat = _layer_pattern(spec)
    if not tensors or not n or n > MAX_LAYERS or pat is None or _incomplete(ctx.checkpoint):
        return  # a damaged or partial checkpoint is reported by the reader rules
    found = {int(m.group(1)) for name in tensors if (m := pat.match(name))}
    if not found:
        return  # the table's names do not fit these weights: nothing to count
    extra = sum(ctx.config.get(k) for k in EXTRA_LAYER_KEYS if _is_int(ctx.config.get(k)))
    key = spec.key("num_layers") or "num_hidden_layers"
    missing = sorted(set(range(n)) - found)
    beyond = sorted(i for i in found if i >= n + extra)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        ctx.report("KV602", f"{key} = {n} but the weights have no tensors for layer(s) {shown} "
                            f"({len(found & set(range(n)))} of {n} present)", path=key)
    elif beyond:
        ctx.report("KV602", f"{key} = {n} but the weights hold {len(beyond)} more layer(s) "
                            f"(up to index {beyond[-1]}) that will be ignored", path=key)


@checker("weights")
def check_embeddings(ctx) -> None:
    spec, tensors = ctx.spec, ctx.checkpoint.tensors
    if not tensors:
        return
    w = spec.arch.weights
    embed = tensors.get(w.get("embed", "")) if w.get("embed") else None
    bad = embedding_mismatch(spec, tensors)
    if bad is not None:
        key, message = bad
        ctx.report("KV603", message, path=key, file=ctx.file_of(embed.file))
    if embed is None or not w.get("lm_head"):
        return  # without the embedding the table's names may not fit these weights
    r = spec.values.get("tie_word_embeddings")
    tie = r.value if r is not None else None
    if not isinstance(tie, bool):
        return  # unknown default: transformers' per-model defaults decide, not kvtool
    key = spec.key("tie_word_embeddings") or "tie_word_embeddings"
    head = tensors.get(w["lm_head"])
    if not tie and head is None:
        ctx.report("KV604", f"{key} is false but no shard stores {w['lm_head']}; the output layer would be "
                            "randomly initialised", path=key)
    elif tie and head is not None:
        ctx.report("KV605", f"{key} is true but {w['lm_head']} is stored; loaders replace it with "
                            f"{embed.name}", path=w["lm_head"], file=ctx.file_of(head.file))
