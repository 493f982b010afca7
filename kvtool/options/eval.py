"""`kvtool eval` / the recipe's eval step: every option, declared once (the quality gates' names too)."""

from __future__ import annotations

from kvtool.io import urls
from kvtool.model import kv_dtypes
from kvtool.options.convert import TEXT_FILES
from kvtool.options.fields import argument, operation, option
from kvtool.progress import FLAG_HELP

PERCENT = {"$ref": "#/$defs/percent"}  # 0.02 or "2%"
FORMATS = ("text", "json")
# auto, the vLLM KV-cache dtypes eval emulates (the rows of kvtool/model/kv_emulations.json), off
KV_CACHE_DTYPES = ("auto", *kv_dtypes.emulated(), "off")
KV_SCALE_SOURCES = ("checkpoint", "one")
GATE_FIELDS = ("max_ppl_increase", "max_kld", "min_top1")  # kvtool.eval.gate.GATES (a test checks)
FP8_ATTENTION = ("cache-only", "flash-attn", "flashinfer", "triton", "cpu")  # kvtool.eval.fp8_backends.CHOICES (a test checks)


# a server's URL: kvtool.io.urls' grammar, the one its parser takes (kvtool.eval.server.Server), refused when the
# options are made, so a dry run, a recipe and the API refuse what a run would, with its password never shown
SERVER_URL, SERVER_URL_FORMS = urls.SERVER_URL, urls.SERVER_URL_FORMS


@operation("eval")
class EvalOptions:
    model: str = argument(help="Model folder or hub id (the candidate).")
    baseline: str | None = option(None, recipe=False, help="Reference model (same tokenizer); with a server, its "
                                                           "served name (default: MODEL), or a model folder here "
                                                           "(a mixed run).")
    server: str | None = option(None, choices=SERVER_URL_FORMS, pattern=SERVER_URL, shown=urls.redact,
                                help="Score what an OpenAI-compatible server (vLLM, llama-cpp-python) at this "
                                     "URL serves under the name MODEL, from its prompt log-probabilities.")
    baseline_server: str | None = option(None, choices=SERVER_URL_FORMS, pattern=SERVER_URL, shown=urls.redact,
                                         help="The server of the baseline (default: --server); without "
                                              "--server, MODEL is a local folder scored against it.")
    served_model: str | None = option(None, cli=False, help="Recipe: the candidate's name on `server` (the "
                                                            "command's MODEL).")
    served_baseline: str | None = option(None, cli=False, help="Recipe: the baseline's name on `baseline_server` "
                                                               "(the command's --baseline).")
    top_logprobs: int = option(20, minimum=1, maximum=1000,
                               help="With a server: alternatives per token for the KL estimate (vLLM caps it at "
                                    "--max-logprobs, 20 by default).")
    server_timeout: float = option(300.0, minimum=1, maximum=86400,
                                   help="With a server: seconds one request may take (no retries).")
    served_kv_cache_dtype: str | None = option(None, choices=kv_dtypes.names(),
                                               help="With a server: the --kv-cache-dtype it serves, when it does not "
                                                    "tell (vLLM's /metrics does); the report says what its prefill "
                                                    "read from the cache (kvtool/model/kv_emulations.json reads).")
    served_chunk: int | None = option(None, minimum=1,
                                      help="With a server: the tokens it prefills at once (vLLM "
                                           "--max-num-batched-tokens with chunked prefill), when it does not tell "
                                           "(/server_info in vLLM's dev mode does).")
    text: list[str] = option(default_factory=list, repeatable=True, schema=TEXT_FILES,
                             help="UTF-8 text file(s), joined into one stream.")
    dataset: str | None = option(None, schema={"type": "string", "minLength": 1},
                                 help="pydoc (built-in, offline; the default), wikitext2, wikitext103 (need `datasets`).")
    max_length: int = option(1024, minimum=8, help="Window length L in tokens.")
    stride: int | None = option(None, minimum=1, help="Window step S < L (default L/2).")
    max_tokens: int | None = option(None, minimum=2, help="Use only the first N tokens of the stream.")
    device: str = option("auto", recipe=False, help="auto | cuda | cuda:N | cpu")
    dtype: str = option("auto", recipe=False, help="auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32")
    device_map: str | None = option(None, recipe=False, help="auto: shard over all GPUs (+CPU) with accelerate.")
    max_memory: str | None = option(None, recipe=False, help="With --device-map: per-device limits, e.g. "
                                                             "0=70GiB,cpu=100GiB (the rest is offloaded to disk).")
    batch_size: int | None = option(None, minimum=1, recipe=False,
                                    help="Windows per forward (default 1 on CPU, 8192/L on CUDA).")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES,
                                 help="The vLLM KV-cache dtype to emulate: K/V stored and read back as vLLM "
                                      "does, for every token (kvtool/model/kv_emulations.json); auto (fp8_e4m3 "
                                      "when the checkpoint has KV scales or declares an FP8 cache) | off | a dtype "
                                      "(docs/eval.md#kv-cache-dtypes). One the model's attention kind cannot be "
                                      "served with is refused.")
    kv_scales: str = option("checkpoint", choices=KV_SCALE_SOURCES, recipe=False,
                            help="checkpoint | one (1.0, vLLM's default)")
    fp8_attention: str = option("cache-only", choices=FP8_ATTENTION,
                                help="With an fp8 / fp8_e4m3 KV cache, what else vLLM's backend rounds to e4m3 (the "
                                     "newest release kvtool read; fp8_e5m2: cache-only or cpu): cache-only "
                                     "(K/V only) | flash-attn (FA3 on Hopper: + queries) | flashinfer (+ queries) | "
                                     "triton (+ queries and probabilities) | cpu (vLLM's CPU build: K/V truncated "
                                     "toward zero); an MLA checkpoint: cache-only (the latent "
                                     "cache, TRITON_MLA). docs/eval.md#fp8-attention")
    max_ppl_increase: str = option("2%", recipe="thresholds.max_ppl_increase", schema=PERCENT,
                                   help="Gate: PPL ratio - 1 (with --baseline; 'off' disables).")
    max_kld: float | None = option(None, recipe="thresholds.max_kld", minimum=0,
                                   help="Gate: mean KL(baseline||model), nats/token.")
    min_top1: float | None = option(None, recipe="thresholds.min_top1", minimum=0, maximum=1,
                                    help="Gate: top-1 agreement with the baseline.")
    kv_sweep: bool = option(False, help="Score MODEL under every KV-cache dtype eval emulates that vLLM serves for "
                                        "its attention, plus each --candidate, against one baseline pass; print "
                                        "KV bytes per token, PPL ratio, KLD, top-1, the Pareto frontier and the "
                                        "smallest option that passes the gates. docs/kv-frontier.md")
    candidate: list[str] = option(default_factory=list, repeatable=True, metavar="DIR", applies=("--kv-sweep",),
                                  schema={"type": "array", "items": {"type": "string", "minLength": 1}},
                                  help="A converted checkpoint of MODEL (same tokenizer) on the same frontier, at "
                                       "its own dtype and under every KV-cache dtype swept.")
    plot: str | None = option(None, recipe=False, metavar="FILE.png", applies=("--kv-sweep",),
                              help="Plot KV bytes per token against PPL ratio and KLD (.png, .svg or .pdf; needs "
                                   "matplotlib); hollow marks fail the gates.")
    format: str = option("text", choices=FORMATS, recipe=False, help="text | json")
    dry_run: bool = option(False, recipe=False, help="Print the estimated peak memory and time; evaluate nothing.")
    progress: bool | None = option(None, negatable=True, recipe=False, help=FLAG_HELP)
