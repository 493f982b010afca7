"""Session-scoped models for the eval tests (loaded once per worker)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    from eval_helpers import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", smollm2_path, len(smollm2_tokenizer))
