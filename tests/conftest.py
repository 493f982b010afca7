"""Shared fixtures. Helper functions live in tests/kvtest.py (`from kvtest import ...`)."""

from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on 2 cores: two torch thread pools spinning against each other made a SmolLM2
    # forward ~9x slower than one thread each (measured). Set before any test imports torch;
    # subprocesses inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest

from kvtest import DATA, REPO, write_config, write_safetensors  # noqa: F401 - re-exported for old imports
from torch_lane import module_is_heavy, needs_torch, torch_installed


def pytest_configure(config):
    """`-n N` balances by work stealing (an idle worker takes half of the other's queue): xdist's default `load`
    left one worker idle for the run's last half-minute (docs/testing.md). Set here, not in addopts, so pytest
    without xdist (the vLLM lane's venv) still starts; an explicit --dist is kept."""
    if getattr(config.option, "dist", "no") == "load" and not any(
            a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args):
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    """The `torch` marker, set from what each test imports (tests/torch_lane.py): `pytest -m "not torch"`.
    The engine lane (marker `engines`: nine transformers releases, scripts/engine_lane.sh) and the vLLM lane
    (marker `vllm`: scripts/vllm_lane.sh) run only when -m names them; every other run deselects them."""
    for item in items:
        if needs_torch(item):
            item.add_marker(pytest.mark.torch)
    for marker in ("engines", "vllm"):  # the vLLM lane (scripts/vllm_lane.sh) likewise
        if marker not in (config.getoption("markexpr", "") or ""):
            lane = [i for i in items if i.get_closest_marker(marker)]
            if lane:
                config.hook.pytest_deselected(items=lane)
                items[:] = [i for i in items if not i.get_closest_marker(marker)]


def pytest_ignore_collect(collection_path, config):
    """Without torch, `-m "not torch"` skips importing the test modules that import it at top level (all their
    tests are torch tests); any other run still collects them, so a missing torch is an error there."""
    if collection_path.suffix != ".py" or torch_installed():
        return None
    if "not torch" in (config.getoption("markexpr", "") or "") and module_is_heavy(Path(collection_path)):
        return True
    return None


@pytest.fixture(autouse=True)
def _threads_at_start():
    """The threads alive when the test starts: the hostile harness runs kvtool in-process only when the test has
    started none of its own (a stand-in server's thread would write where the run reads); a thread an earlier test
    of this worker left behind does not count (tests/hostile/harness.py in_process)."""
    import sys
    import threading

    # the harness is imported under two names (tests/hostile on sys.path, and as a package): note it in both
    loaded = [m for m in (sys.modules.get("harness"), sys.modules.get("tests.hostile.harness")) if m is not None]
    for m in loaded:
        m.THREADS_AT_START = frozenset(threading.enumerate())
    yield
    for m in loaded:
        m.THREADS_AT_START = frozenset()


@pytest.fixture(autouse=True)
def _no_signal_carried_over():
    """A test that sends this process SIGTERM (tests/io/test_io_staging.py) leaves kvtool.errors.SIGNALS_RECEIVED
    set, after which kvtool.cli takes any later error in the process for an interrupt (exit 130: a later
    tests/convert/test_convert_cli.py test failed so in one run): each test starts without one."""
    yield
    from kvtool.errors import SIGNALS_RECEIVED

    SIGNALS_RECEIVED.clear()


@pytest.fixture
def tiny_llama_config() -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 256, "rope_theta": 10000.0, "torch_dtype": "float32",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temp folder of our own (tempfile's default for this test), to see what a command leaves behind there."""
    import tempfile

    t = tmp_path / "tmp"
    t.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    return t


# Real pretrained checkpoints (kvtool.fixtures) and the pydoc text split, for any test.
def _fixture_or_skip(getter):
    from kvtest import fixture_or_skip

    return fixture_or_skip(getter)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF folder (llama, 9 heads, 3 KV heads)."""
    from kvtool import fixtures

    return _fixture_or_skip(fixtures.smollm2_dir)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma-3-270M as a float32 HF folder (gemma3_text, 1 KV head, sliding layers)."""
    from kvtool import fixtures

    return _fixture_or_skip(fixtures.gemma3_dir)


@pytest.fixture(scope="session")
def _pydoc_text_files(tmp_path_factory):
    from kvtool.datasets import write_text_files

    return write_text_files(tmp_path_factory.mktemp("pydoc_text"))


@pytest.fixture(scope="session")
def calib_text_file(_pydoc_text_files) -> Path:
    """Calibration part of pydoc_data.topics (disjoint from eval_text_file)."""
    return _pydoc_text_files[0]


@pytest.fixture(scope="session")
def eval_text_file(_pydoc_text_files) -> Path:
    """Evaluation part of pydoc_data.topics."""
    return _pydoc_text_files[1]
