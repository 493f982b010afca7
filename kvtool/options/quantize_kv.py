"""`kvtool quantize-kv` / the recipe's quantize-kv step: every option, declared once."""

from __future__ import annotations

from kvtool.options.convert import TEXT_FILES
from kvtool.options.fields import argument, operation, option
from kvtool.progress import FLAG_HELP

DEFAULT_OBSERVER = "absmax-pow2:2"  # kept equal to kvtool.quantize.observers.DEFAULT_OBSERVER (a test checks)
STRATEGIES = ("tensor", "attn_head")  # kvtool.quantize.calibrate.STRATEGIES (a test checks)
FORMATS = ("e4m3", "e5m2", "nvfp4")  # kvtool.quantize.formats.FORMATS (a test checks)
MIN_CALIB_TOKENS = 16  # fewer tokens give too few samples of each head's amax to set a scale on


@operation("quantize-kv")
class QuantizeOptions:
    src: str = argument(help="Source model folder (config.json + safetensors); never modified.")
    dst: str | None = argument(None, help="Output folder (written to a temporary folder, renamed when complete); "
                                          "required, except with --dry-run.")
    calib_dataset: str | None = option(None, recipe="calibration.dataset", schema={"type": "string", "minLength": 1},
                                       help="pydoc (built-in, offline; the default) | wikitext2 | wikitext103 (train "
                                            "split; need `datasets`).")
    calib_text: list[str] = option(default_factory=list, repeatable=True, recipe="calibration.text", schema=TEXT_FILES,
                                   help="UTF-8 calibration text file (repeatable; instead of --calib-dataset).")
    calib_tokens: int = option(2048, recipe="calibration.tokens", minimum=MIN_CALIB_TOKENS,
                               help="Calibration tokens taken from the text.")
    seq_len: int = option(512, recipe="calibration.seq_len", minimum=8, help="Tokens per calibration sequence.")
    strategy: str = option("tensor", choices=STRATEGIES,
                           help="tensor (one scale per layer) | attn_head (one per KV head).")
    observer: str | None = option(None, schema={"type": "string", "pattern": "^[a-z][a-z0-9_-]*(:[0-9.]+)?$"},
                                  help="absmax[:H] | absmax-pow2[:H] | attn-out[:H] | percentile:P | mse (default: "
                                       "the format's; e4m3 / e5m2: absmax-pow2:2, 2x the observed max rounded up to "
                                       "a power of two; nvfp4: absmax, the global scale amax / 2688).")
    q_scales: bool = option(True, negatable=True,
                            help="Also calibrate the queries' scales and write <attention>.q_scale beside k_scale / "
                                 "v_scale: vLLM loads them and its FP8-query backends (FlashAttention 3 on "
                                 "Hopper, FlashInfer, Triton) divide queries by them; without them it uses 1.0.")
    format: str = option("e4m3", choices=FORMATS,
                         help="The KV cache the scales are for: e4m3 (vLLM --kv-cache-dtype fp8 / fp8_e4m3) | e5m2 "
                              "(fp8_e5m2) | nvfp4 (nvfp4 and nvfp4_4over6: k_scale / v_scale are NVFP4's per-layer "
                              "global scales).")
    device: str = option("auto", recipe=False, help="auto | cuda | cuda:N | cpu.")
    dtype: str = option("auto", recipe=False, help="Model dtype for calibration: auto (bf16 on CUDA, fp32 on CPU) | "
                                                   "bf16 | fp16 | fp32.")
    no_eval: bool = option(False, recipe=False, help="Skip the quality report.")
    eval_text: list[str] = option(default_factory=list, repeatable=True, recipe=False,
                                  help="Held-out text for the report (default: kvtool's built-in evaluation text).")
    eval_tokens: int = option(1024, recipe=False, minimum=2, help="Tokens of held-out text for the report.")
    link: bool = option(False, recipe=False, help="Hard-link the unchanged source shards into DST instead of copying "
                                                  "them: saves disk, but editing either copy in place changes both.")
    force: bool = option(False, recipe=False, help="Replace a non-empty DST.")
    dry_run: bool = option(False, recipe=False, help="Print the estimated peak memory and time; write nothing.")
    progress: bool | None = option(None, negatable=True, recipe=False, help=FLAG_HELP)
    # False: load the whole model for calibration (the reference the tests compare with)
    layerwise: bool = option(True, cli=False, recipe=False, help="Calibrate one decoder layer at a time.")
