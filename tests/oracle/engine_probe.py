"""What one transformers release does with each config: run in a subprocess whose sys.path starts with that
release's folder (tests/oracle/engine_releases.py installs them), never imported by kvtool or the test process.

    python engine_probe.py CASES.jsonl OUT.jsonl

Each case ({"id", "config"}) is written to a folder and loaded the way users load it: AutoConfig.from_pretrained
(the config class of its model_type; trust_remote_code never set). Then, when the model is tiny, a model is built
with from_config, its RoPE inverse frequencies are read (the rotary embedding of the model, or of the first
layer's attention in releases before 4.43), and one forward of four tokens runs. One JSON line per case:
loads, error (first line), the values the release read (rope_theta, torch_dtype, head_dim of the attention
module), forward, inv_freq.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

CHEAP = {"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024, "intermediate_size": 1024}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _cheap(cfg: dict) -> bool:
    if isinstance(cfg.get("text_config"), dict):
        return False
    return "hidden_size" in cfg and "num_hidden_layers" in cfg and all(
        isinstance(cfg.get(k), int) and 0 < cfg[k] <= lim for k, lim in CHEAP.items() if k in cfg)


def _rotary(model):
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None:  # before 4.43 each attention module held its own
        layers = getattr(inner, "layers", None)
        attn = getattr(layers[0], "self_attn", None) if layers else None
        rot = getattr(attn, "rotary_emb", None)
    return rot if rot is not None and hasattr(rot, "inv_freq") else None


def _head_dim(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    hd = getattr(attn, "head_dim", None)
    return hd if isinstance(hd, int) else None


def _theta(conf, major: int):
    t = getattr(conf, "rope_theta", None)
    rp = getattr(conf, "rope_parameters", None) if major >= 5 else None  # 4.x keeps an unread dict as an attribute
    if isinstance(rp, dict):
        inner = rp.get("full_attention") if isinstance(rp.get("full_attention"), dict) else rp
        t = inner.get("rope_theta", t)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def probe(case: dict, folder: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])

    out = {"id": case["id"], "loads": False, "error": "", "forward": None, "inv_freq": None}
    (folder / "config.json").write_text(json.dumps(case["config"]), encoding="utf-8")
    try:
        conf = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - every refusal is a verdict
        out["error"] = _first_line(exc)
        return out
    out["loads"] = True
    dtype = getattr(conf, "torch_dtype", None)
    out["torch_dtype"] = None if dtype is None else str(dtype).replace("torch.", "")
    out["rope_theta"] = _theta(conf, major)
    if not _cheap(case["config"]):
        return out
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(conf)
        out["head_dim"] = _head_dim(model)
        rot = _rotary(model)
        if rot is not None:
            out["inv_freq"] = [float(x) for x in rot.inv_freq.detach().double().flatten()]
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]))
        out["forward"] = True
    except Exception as exc:  # noqa: BLE001
        out["forward"], out["error"] = False, _first_line(exc)
    return out


def main(argv: list[str]) -> int:
    cases = [json.loads(line) for line in Path(argv[0]).read_text(encoding="utf-8").splitlines() if line.strip()]
    warnings.simplefilter("ignore")
    logging.disable(logging.ERROR)
    import transformers

    results = [{"transformers": transformers.__version__, "file": transformers.__file__}]
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                results.append(probe(case, folder))
    Path(argv[1]).write_text("".join(json.dumps(r) + "\n" for r in results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
