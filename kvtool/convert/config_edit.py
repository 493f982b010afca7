"""config.json for the converted model: only the KV-head field(s) (and dtype, when asked) change.

Key order, unknown fields and values are kept; the text is re-serialised with indent 2 like
transformers writes it. Which keys hold the KV-head count comes from the table's
`kv_head_fields`; a boolean field (gpt_bigcode `multi_query`) means "one KV head".
"""

from __future__ import annotations

import json

from kvtool.errors import UsageError
from kvtool.model.spec import get_path as _get


def _set(d: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[last] = value


def kv_field_is_boolean(arch, config: dict) -> bool:
    """True when the table's KV-head field is a flag (only 1 or all heads can be expressed)."""
    return any(isinstance(_get(config, key, arch.defaults.get(key)), bool) for key in arch.kv_head_fields)


def rewrite_config(config: dict, arch, *, num_heads: int, target_kv_heads: int, dtype_name: str | None = None) -> dict:
    """A copy of `config` with the KV-head field(s) set (and dtype keys, when dtype_name is given)."""
    if not arch.kv_head_fields:
        raise UsageError(f"the {arch.model_type} table names no KV-head config field", file=arch.source_file,
                         field="kv_head_fields")
    out = json.loads(json.dumps(config))  # deep copy, order kept
    present = [k for k in arch.kv_head_fields if _get(out, k) is not None]
    targets = present or [arch.kv_head_fields[0]]
    for key in targets:
        current = _get(out, key, arch.defaults.get(key))
        if isinstance(current, bool):
            if target_kv_heads not in (1, num_heads):
                raise UsageError(f"{key} is a flag: only 1 (MQA) or {num_heads} (MHA) KV heads can be expressed",
                                 field=key)
            _set(out, key, target_kv_heads == 1)
        else:
            _set(out, key, target_kv_heads)
    if dtype_name:
        for key in ("dtype", "torch_dtype"):
            if key in out:
                out[key] = dtype_name
    return out


def dump_config(config: dict) -> str:
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"
