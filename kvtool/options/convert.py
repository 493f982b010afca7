"""`kvtool convert` / the recipe's convert step: every option (the aware method's too), declared once."""

from __future__ import annotations

from kvtool.convert import defaults as aware
from kvtool.convert.defaults import AWARE_FIELDS, GROUPINGS, MLA_PRESETS, MLA_SOLVE, MLA_SOLVES
from kvtool.options.fields import argument, engine_option, operation, option
from kvtool.progress import FLAG_HELP
from kvtool.units import parse_kv_budget

DTYPES = ("keep", "bf16", "fp16", "fp32")
TEXT_FILES = {"$ref": "#/$defs/text_files"}  # one path or a list, relative to the recipe
# what an option works with (fields.Spec.applies): its section of --help, its label in the docs table
GQA, MLA, EVAL = ("--to gqa",), ("--to mla",), ("--eval",)
CALIBRATED = ("--method aware", "--to mla")  # both calibrate: kvtool/convert/aware and kvtool/convert/mla
KV_BUDGET_PATTERN = "^([0-9]*\\.?[0-9]+ ?[KMGTkmgt]?i?[Bb]|[0-9]*\\.?[0-9]+ ?%?)$"  # bytes with a unit, or a fraction


def merge_methods() -> list[str]:
    """The registered merge methods (kvtool/convert/methods.py and its plug-in modules)."""
    from kvtool.convert.methods import available_methods

    return available_methods()  # sorted: the order modules happen to be imported in must not show


def conversion_targets() -> list[str]:
    """The registered conversion targets (kvtool/convert/targets.py), in registration order."""
    from kvtool.convert.targets import target_names

    return target_names()


@operation("convert")
class ConvertOptions:
    METHOD_FIELDS = AWARE_FIELDS  # given to the merge method (kvtool.convert.heads.method_options)
    src: str = argument(help="Source model folder (config.json + safetensors).")
    dst: str | None = argument(None, help="Output folder; required, except with --dry-run.")
    to: str = option(choices=conversion_targets, recipe_required=True,
                     help="Conversion target (registry: kvtool/convert/targets.py).")
    groups: int | None = option(None, short="-g", minimum=1, applies=GQA, help="KV heads after conversion.")
    kv_rank: int | None = option(None, minimum=1, applies=MLA,
                                 help="Latent dimensions cached per token and layer (kv_lora_rank).")
    rope_dim: int | None = option(None, minimum=2, applies=MLA,
                                  help="Dimensions of the shared RoPE key cached beside the latent "
                                       "(qk_rope_head_dim; even, at most head_dim - 2; default: docs/convert-mla.md).")
    kv_budget: str | None = option(None, choices=("BYTES (7.5KiB, 7680B)", "FRACTION (0.33, 33%)"),
                                   pattern=KV_BUDGET_PATTERN, parse=parse_kv_budget, metavar="BYTES|FRACTION",
                                   applies=MLA,
                                   help="KV cache per token instead of --kv-rank, as bytes (7.5KiB, 7680B) "
                                        "or a fraction of the source's (0.33, 33%).")
    preset: str | None = option(None, choices=tuple(MLA_PRESETS), applies=MLA,
                                help="The dimensions an MLA kernel fixes: "
                                     + ", ".join(f"{k} = kv_lora_rank {r} + rope {d}" for k, (r, d) in MLA_PRESETS.items())
                                     + " (FlashMLA, CUTLASS MLA).")
    mla_solve: str | None = option(None, choices=tuple(MLA_SOLVES), applies=MLA,
                                   help="How each layer is solved: mqa-seed (the aware MQA merge written as "
                                        "MLA, plus per-head keys from the latent) | joint (the rope key merged per "
                                        f"pair, keys and values in one latent); default {MLA_SOLVE}.")
    engine: list[str] = engine_option("the engine that will serve the result: vllm==X writes only the MLA rows "
                                      "(kv_lora_rank + qk_rope_head_dim) that release serves; transformers alone "
                                      "writes any size (vLLM refuses the others). Default: the installed vLLM (as lint "
                                      "and kv-budget), else the newest release kvtool has read.", recipe=True,
                                      applies=MLA)
    dry_run: bool = option(False, recipe=False, help="Print the plan and write nothing.")
    force: bool = option(False, recipe=False, help="Replace a non-empty DST.")
    dtype: str = option("keep", choices=DTYPES, help="keep | bf16 | fp16 | fp32 (floating tensors only).")
    max_shard_size: str = option("5GB", schema={"type": "string", "pattern": "^[0-9]*\\.?[0-9]+ ?[KMGTkmgt]?i?[Bb]?$"},
                                 help="Largest output shard, e.g. 5GB, 500MB.")
    method: str = option("mean", choices=merge_methods, help="Merge method (registry: kvtool/convert/methods.py).")
    method_opt: list[str] = option(default_factory=list, repeatable=True, recipe=False,
                                   help="KEY=VALUE option for the merge method (repeatable).")
    eval: bool | None = option(None, negatable=True, recipe=False,
                               help="Run the perplexity check on the result (default: on with a CUDA GPU).")
    eval_tokens: int = option(4096, recipe=False, minimum=2, applies=EVAL,
                              help="Tokens of the built-in evaluation text.")
    max_ppl_increase: str | None = option(None, recipe=False, applies=EVAL,
                                          help="Fail (exit 1) above this perplexity rise, e.g. 5%.")
    max_kld: float | None = option(None, recipe=False, applies=EVAL, help="Fail (exit 1) above this mean KL divergence.")
    progress: bool | None = option(None, negatable=True, recipe=False, help=FLAG_HELP)
    calib_dataset: str | None = option(None, recipe="calibration.dataset", schema={"type": "string", "minLength": 1},
                                       applies=CALIBRATED, help="Calibration text: mixed (the default: pydoc, The Devil's Dictionary and the "
                                            "Jargon File, built-in, offline) | pydoc (built-in) | self | pydoc+self "
                                            "(text the model writes itself, offline) | wikitext2 | wikitext103 "
                                            "(train split; need `datasets`).")
    calib_text: str | None = option(None, recipe="calibration.text", schema=TEXT_FILES, applies=CALIBRATED,
                                    help="Calibration text file (instead of --calib-dataset).")
    calib_tokens: int | None = option(None, recipe="calibration.tokens", minimum=aware.MIN_CALIB_TOKENS,
                                      applies=CALIBRATED, help=f"Calibration tokens ({aware.CALIB_TOKENS}; "
                                           f"{aware.CALIB_TOKENS_REFINE} with --refine-steps and no --distill-steps).")
    refine_steps: int | None = option(None, minimum=0, applies=CALIBRATED,
                                      help="Optimizer steps per layer after the merge or "
                                           "solve (0).")
    distill_steps: int | None = option(None, minimum=0, applies=CALIBRATED,
                                       help="End-to-end distillation steps after the "
                                            "merge or solve (0).")
    seq_len: int | None = option(None, recipe="calibration.seq_len", minimum=aware.MIN_SEQ_LEN, applies=CALIBRATED,
                                 help=f"Tokens per calibration sequence ({aware.SEQ_LEN_CLOSED_FORM}; "
                                      f"{aware.SEQ_LEN_REFINE} with --refine-steps or --distill-steps).")
    grouping: str | None = option(None, choices=GROUPINGS, applies=("--method aware",),
                                  help=f"Which KV heads share a group: {' | '.join(GROUPINGS)} "
                                       f"(default {aware.GROUPING}: the groups whose measured merge error is lowest).")
    serve_context: int | None = option(None, minimum=2, applies=CALIBRATED,
                                       help="The longest context the result will serve, in tokens "
                                            "(the config's max_position_embeddings); shorter merges better within it.")

