"""The model dtype declared in config.json (KV501, KV502)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define

# torch dtype names transformers resolves with getattr(torch, name); activations need a float type.
FLOAT_DTYPES = (
    "float32", "float", "float16", "half", "bfloat16", "float64", "double",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
)
OTHER_DTYPES = ("int8", "uint8", "int16", "int32", "int64", "int", "long", "short", "bool")
DTYPE_KEYS = ("dtype", "torch_dtype")  # v5 writes dtype; older transformers torch_dtype

define("KV501", "dtype-invalid", "error",
       "dtype / torch_dtype is not a floating-point torch dtype name",
       """
       What it does: checks that dtype (transformers v5) and torch_dtype (older releases) name a
       floating-point torch dtype such as bfloat16, float16 or float32.
       Why it matters: transformers resolves the name with getattr(torch, name) and vLLM derives its
       compute dtype from it; a typo fails at load and an integer dtype is not a compute dtype
       (quantized checkpoints keep the activation dtype here and describe the rest in
       quantization_config).
       Example: {"torch_dtype": "bf16"}  or  {"torch_dtype": "int8"}
       Fix: use a torch name: bfloat16, float16 or float32.
       """, hint="use bfloat16, float16 or float32", topic="dtype")

define("KV502", "dtype-conflict", "warning",
       "dtype and torch_dtype are both set and disagree",
       """
       What it does: flags a config that carries both dtype and torch_dtype with different values.
       Why it matters: transformers v5 reads dtype and ignores torch_dtype, older releases and some
       engines read torch_dtype: the same checkpoint loads in a different precision depending on the
       tool.
       Example: {"dtype": "bfloat16", "torch_dtype": "float32"}
       Fix: keep one key (dtype for transformers >= 5) or make both agree.
       """, hint="make dtype and torch_dtype agree, or keep only one", topic="dtype")


def _name(v) -> str | None:
    if not isinstance(v, str):
        return None
    return v[len("torch."):] if v.startswith("torch.") else v


@checker("dtype")
def check_dtype(ctx) -> None:
    spec = ctx.spec
    _check_level(ctx, ctx.config, spec.prefixed)
    if spec.wrapper_key:
        # a multimodal wrapper's own dtype: transformers resolves it too (the wrapper's config is
        # loaded first and its dtype drives the whole model's load)
        _check_level(ctx, spec.full_config, lambda k: k)


def _check_level(ctx, cfg: dict, path_of) -> None:
    seen: dict[str, str] = {}
    for k in DTYPE_KEYS:
        if k not in cfg or cfg[k] is None:
            continue
        v, key = cfg[k], path_of(k)
        name = _name(v)
        if name in FLOAT_DTYPES:
            seen[key] = name
        elif name in OTHER_DTYPES:
            ctx.report("KV501", f"{key} = {v!r} is not a floating-point dtype; activations cannot run in it", path=key)
        else:
            ctx.report("KV501", f"{key} = {v!r} is not a torch dtype name", path=key)
    if len(set(seen.values())) > 1:
        (k1, v1), (k2, v2) = seen.items()
        ctx.report("KV502", f"{k1} = {v1!r} but {k2} = {v2!r}; transformers >= 5 uses {k1}, older tools {k2}",
                   path=k2)
