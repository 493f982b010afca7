"""kvtool never runs a checkpoint's code: not with `yes y |` on stdin, not with a silent open pipe.

Before this, transformers' trust_remote_code was left unset: for a checkpoint whose config.json or
tokenizer_config.json names Python files through auto_map, transformers asked "run the custom
code? [y/N]" on stdin, so `yes y | kvtool eval MODEL` ran the checkpoint's code, and an open pipe
that sent nothing stalled eval. These tests hold two layers independently: the command line (stdin
replaced by /dev/null in the entry point) and the loaders (trust_remote_code=False at every call).
"""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile import models
from tests.hostile.harness import TRAP_ENV, check_refusal

REPO = Path(__file__).resolve().parents[2]
TIME_BOUND_S = 90.0
# the tests that use `evil` need SmolLM2's tokenizer (a real-model fixture): marked slow
slow = pytest.mark.slow  # a torch + transformers import on a loaded 2-core machine, then the refusal


@pytest.fixture(scope="module")
def evil(tmp_path_factory, request):
    """{"config": folder with config.json auto_map, "tokenizer": folder with tokenizer_config.json auto_map}."""
    root = tmp_path_factory.mktemp("evil")
    smollm2 = request.getfixturevalue("smollm2_path")
    return {"config": models.config_remote_code(root / "config_auto_map"),
            "tokenizer": models.tokenizer_remote_code(root / "tokenizer_auto_map", smollm2)}


class _SilentPipe:
    """An open pipe that never sends anything (and never closes while the command runs)."""

    def __enter__(self):
        self.r, self.w = os.pipe()
        return self.r

    def __exit__(self, *exc):
        os.close(self.r)
        os.close(self.w)


STDINS = ["yes_y", "silent_open_pipe", "devnull"]


def _run(args, folder, trap, stdin_kind, **kw):
    if stdin_kind == "yes_y":
        return check_refusal(args, sources=[folder], trap=trap, input=b"y\n" * 1000, timeout=TIME_BOUND_S, **kw)
    if stdin_kind == "silent_open_pipe":
        with _SilentPipe() as r:
            return check_refusal(args, sources=[folder], trap=trap, stdin=r, timeout=TIME_BOUND_S, **kw)
    return check_refusal(args, sources=[folder], trap=trap, timeout=TIME_BOUND_S, **kw)


@slow
@pytest.mark.parametrize("stdin_kind", STDINS)
@pytest.mark.parametrize("which", ["config", "tokenizer"])
def test_eval_refuses_remote_code_whatever_stdin_says(evil, tmp_path, which, stdin_kind):
    folder = evil[which]
    trap = tmp_path / "trap"
    _run(["eval", folder, "--max-tokens", "64", "--max-length", "32", "--device", "cpu"], folder, trap, stdin_kind,
         names=["auto_map"], allow_progress=True)


# config.json's evil model_type has no architecture table, so quantize-kv refuses it before any load
# (and need not name auto_map); the tokenizer case reaches transformers, which must refuse it.
QUANTIZE_NAMES = {"tokenizer": ["tokenizer_config.json", "auto_map"], "config": []}


@slow
@pytest.mark.parametrize("stdin_kind", ["yes_y", "silent_open_pipe"])
@pytest.mark.parametrize("which", ["tokenizer", "config"])
def test_quantize_kv_refuses_remote_code(evil, tmp_path, which, stdin_kind):
    folder = evil[which]
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    dst = tmp_path / "out"
    _run(["quantize-kv", folder, dst, "--calib-text", calib, "--device", "cpu", "--no-eval"], folder,
         tmp_path / "trap", stdin_kind, names=QUANTIZE_NAMES[which], dst=dst)


# The loaders themselves, called directly: trust_remote_code=False holds even when stdin says "y".

def _loaders():
    import torch

    from kvtool.runtime.layerwise import open_layerwise
    from kvtool.runtime.torch_utils import load_model, load_tokenizer

    cpu = torch.device("cpu")

    def layerwise(p):
        with open_layerwise(p, device=cpu, dtype=torch.float32, attn="sdpa"):
            pass

    def whole(p):
        with open_layerwise(p, device=cpu, dtype=torch.float32, attn="sdpa", layerwise=False):
            pass

    return {"load_model": lambda p: load_model(p, device=cpu, dtype=torch.float32),
            "load_tokenizer": load_tokenizer, "layerwise_skeleton": layerwise, "layerwise_whole": whole}


# (folder, loader, names auto_map): the config folder has no tokenizer files, so its tokenizer load
# fails before any auto_map is consulted; it must still fail without running code.
LOADER_CASES = [("config", "load_model", True), ("config", "layerwise_skeleton", True),
                ("config", "layerwise_whole", True), ("tokenizer", "load_tokenizer", True),
                ("config", "load_tokenizer", False)]


@slow
@pytest.mark.parametrize("which,loader,named", LOADER_CASES, ids=[f"{w}-{l}" for w, l, _ in LOADER_CASES])
def test_loaders_refuse_remote_code_with_yes_on_stdin(evil, tmp_path, monkeypatch, which, loader, named):
    from kvtool.errors import InputError

    from kvtool.model import preflight

    trap = tmp_path / "trap"
    monkeypatch.setenv(TRAP_ENV, str(trap))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 100))  # what `yes y |` would answer
    # this layer alone: without the pre-load gate (kvtool.model.preflight), transformers itself must refuse
    monkeypatch.setattr(preflight, "check_loadable", lambda *paths: None)
    with pytest.raises(InputError) as ei:
        _loaders()[loader](evil[which])
    line = ei.value.line()
    assert "\n" not in line, line
    if named:
        assert "auto_map" in line and "never runs it" in line, line
    assert not trap.exists()
    assert sys.stdin.read(2) == "y\n"  # nobody read the answers


@slow
def test_main_never_hands_stdin_to_a_command(evil, tmp_path, monkeypatch, capsys):
    """In-process main(): stdin is an empty stream for the run and restored afterwards."""
    from kvtool.cli import main

    trap = tmp_path / "trap"
    monkeypatch.setenv(TRAP_ENV, str(trap))
    mine = io.StringIO("y\n" * 100)
    monkeypatch.setattr(sys, "stdin", mine)
    assert main(["eval", str(evil["config"]), "--max-tokens", "64", "--device", "cpu"]) == 2
    assert "auto_map" in capsys.readouterr().err
    assert sys.stdin is mine and mine.read(2) == "y\n" and not trap.exists()


def test_entry_point_points_fd0_at_devnull(tmp_path):
    """A library reading fd 0 directly (or a child process) gets EOF, not the caller's pipe."""
    code = ("import os, sys; import kvtool.cli as c; c.main = lambda argv=None: "
            "(print(repr(os.read(0, 10)), sys.stdin.read(), file=sys.stderr), 0)[1]; c._entry()")
    with _SilentPipe() as r:
        p = subprocess.run([sys.executable, "-c", code], stdin=r, capture_output=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    assert p.stderr.decode().strip() == "b''", p.stderr


# Every transformers load in kvtool passes trust_remote_code=False, by reading the source.
LOADERS = {"from_pretrained", "from_config", "pipeline", "get_class_from_dynamic_module"}


def _load_calls():
    for path in sorted((REPO / "kvtool").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in LOADERS:
                    yield path, node


def _passes_false(path: Path, node: ast.Call) -> bool:
    for kw in node.keywords:
        if kw.arg == "trust_remote_code":
            return isinstance(kw.value, ast.Constant) and kw.value.value is False
        if kw.arg is None and isinstance(kw.value, ast.Name):  # **kwargs: the dict literal that builds them
            src = path.read_text(encoding="utf-8")
            if f'"trust_remote_code": False' in src:
                return True
    return False


def test_every_transformers_load_passes_trust_remote_code_false():
    calls = list(_load_calls())
    assert len(calls) >= 7, "the scan found fewer loads than kvtool has; is it still looking?"
    bad = [f"{p.relative_to(REPO)}:{n.lineno}" for p, n in calls if not _passes_false(p, n)]
    assert not bad, f"transformers loads without trust_remote_code=False: {bad}"
