"""Session-scoped models for the eval tests (loaded once per worker).

KVTOOL_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs them on a GPU, in float32 so the exact
comparisons with a plain transformers loop still hold; the default is the CPU.
"""

from __future__ import annotations

import pytest

from eval_helpers import DEVICE


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # 2 cores shared by pytest-xdist workers: torch's default intra-op threads spin against each
    # other and make a SmolLM2 forward ~5x slower than one thread
    import torch

    if DEVICE != "cpu":
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def eval_device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa")
    return m.to(DEVICE).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    from eval_helpers import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm2_path, len(smollm2_tokenizer))


@pytest.fixture(scope="session")
def tiny_deepseek_path(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    from eval_helpers import tiny_deepseek

    return tiny_deepseek(tmp_path_factory.mktemp("tiny") / "tiny-deepseek", smollm2_path, len(smollm2_tokenizer))
