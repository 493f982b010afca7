"""`kvtool rope` / the recipe's rope step: every option, declared once."""

from __future__ import annotations

from kvtool.model.rope.types import applicable_types
from kvtool.options.fields import argument, engine_option, operation, option


def rope_types() -> list[str]:
    """The RoPE types `kvtool rope` writes (the type table's applicable kinds)."""
    return applicable_types()

LAYOUTS = ("both", "legacy", "v5")


@operation("rope")
class RopeOptions:
    src: str = argument(help="Model folder, config.json, or hub id (hub: --show only).")
    dst: str | None = argument(None, help="Output folder (new config.json, other files copied); required unless "
                                          "--in-place or --show (preview).")
    type: str | None = option(None, choices=rope_types, recipe_required=True, help=" | ".join(applicable_types()))
    factor: float | None = option(None, minimum=1, help="Scaling factor (>= 1).")
    target_context: int | None = option(None, minimum=1, help="Target context N: factor = N / original length.")
    original_max_position_embeddings: int | None = option(None, minimum=1,
                                                          help="Pre-scaling context (default: from the config).")
    theta: float | None = option(None, exclusive_minimum=0, help="New RoPE base (default: keep).")
    beta_fast: float | None = option(None, help="yarn: extrapolation bound (default 32).")
    beta_slow: float | None = option(None, help="yarn: interpolation bound (default 1).")
    attention_factor: float | None = option(None, exclusive_minimum=0,
                                            help="yarn / longrope: attention scaling (default: derived from factor).")
    low_freq_factor: float | None = option(None, exclusive_minimum=0, help="llama3 (default 1.0).")
    high_freq_factor: float | None = option(None, exclusive_minimum=0, help="llama3 (default 4.0).")
    short_factor_file: str | None = option(None, help="longrope: JSON list of rotary_dim/2 factors.")
    long_factor_file: str | None = option(None, help="longrope: JSON list of rotary_dim/2 factors.")
    layer_type: str = option("full_attention", help="Per-layer-type configs (gemma3): which layers to scale.")
    layout: str = option("both", choices=LAYOUTS, help="both (legacy rope_scaling + v5 rope_parameters) | legacy | v5")
    in_place: bool = option(False, recipe=False, help="Edit SRC/config.json (after writing config.json.bak).")
    link: bool = option(False, recipe=False, help="Hard-link unchanged files into DST instead of copying: saves "
                                                  "disk, but editing either copy in place changes both.")
    show: bool = option(False, recipe=False, help="Explain the RoPE setup: wavelengths before/after, served context.")
    engine: list[str] = engine_option("--show follows the one vLLM release named (its max_model_len arithmetic); a "
                                      "range or a second vLLM release is refused. Default: the installed vLLM, else "
                                      "the newest known.")
    plot: str | None = option(None, recipe=False,
                              help="Draw wavelength per dimension, before/after, to FILE.png (needs matplotlib).")

    # a recipe's step is this too (JSON Schema), beyond what each field declares
    RECIPE_SCHEMA = {"not": {"required": ["factor", "target_context"]}}
