"""Calibration text the model writes itself (`--calib-dataset self`): no dataset, no network.

The merge must preserve the model's behaviour on what it will be served; the model's own samples follow
its distribution rather than one source's. Plain sampling at T = 1 repeats itself (issue 17: 7.89x on
another genre, worse than pydoc), so each sequence starts from a different short opening (several
genres, so no single style dominates), and sampling uses a repetition penalty, a ban on repeated 4-grams
and a slightly lowered temperature. Generation is seeded, so a conversion is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Short openings of many kinds of text; sequence i starts from OPENINGS[i % len]. Chosen to span genres
# (not tuned on any evaluation text).
OPENINGS = (
    "The", "In 1887,", "Dear Sir,", "Once upon a time", "Abstract.", "Q: How do I", "Yesterday the city council",
    "Chapter 1", "Ingredients:", "I have been thinking about", "The following terms", "Hi everyone,",
    "According to a new study,", "She opened the door and", "Step 1:", "Review:", "The history of",
    "When I was young,", "def main():", "Breaking news:", "It was late in the evening when", "Introduction",
    "My favourite", "The court held that", "Why do", "Thank you for your letter", "There are three reasons",
    "The weather", "He said", "Photosynthesis is", "Welcome to", "In the beginning",
)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_p: float = 0.95
    repetition_penalty: float = 1.15
    no_repeat_ngram_size: int = 4
    seed: int = 0
    batch: int = 16


def generate_ids(model, tokenizer, n_seqs: int, seq_len: int, sampling: Sampling = Sampling(),
                 openings: tuple[str, ...] = OPENINGS,
                 on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """[n_seqs, seq_len] token ids: each row an opening and the model's continuation of it.
    on_batch(rows done): progress."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the model may not end a sequence early (its end-of-text token is banned): every row has seq_len tokens
    banned = [[t] for t in {tokenizer.eos_token_id, pad} if t is not None]
    gen = torch.Generator().manual_seed(sampling.seed)
    rows: list[torch.Tensor] = []
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen)))
        for start in range(0, n_seqs, sampling.batch):
            prompts = [openings[i % len(openings)] for i in range(start, min(n_seqs, start + sampling.batch))]
            enc = [tokenizer(p, add_special_tokens=False)["input_ids"][: seq_len - 1] or [pad] for p in prompts]
            width = max(len(e) for e in enc)
            ids = torch.full((len(enc), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, e in enumerate(enc):  # left padding: every prompt ends where generation starts
                ids[r, width - len(e):] = torch.tensor(e)
                mask[r, width - len(e):] = 1
            new = seq_len - min(len(e) for e in enc)
            cfg = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new,
                                   temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                   repetition_penalty=sampling.repetition_penalty,
                                   no_repeat_ngram_size=sampling.no_repeat_ngram_size, bad_words_ids=banned or None,
                                   pad_token_id=pad, eos_token_id=None)
            with torch.no_grad():
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
            for r, e in enumerate(enc):
                rows.append(out[r, width - len(e):][:seq_len].cpu())
            if on_batch is not None:
                on_batch(len(rows))
    finally:
        torch.random.set_rng_state(state)
    return torch.stack(rows)


def write_calibration(src, tokenizer, n_seqs: int, seq_len: int, *, device, sampling: Sampling = Sampling(),
                      on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """generate_ids with the whole model at src loaded for the time of the generation (float32)."""
    from kvtool.runtime.layerwise import release_free_memory
    from kvtool.runtime.torch_utils import load_model

    model = load_model(src, device=device, dtype=torch.float32)
    try:
        return generate_ids(model, tokenizer, n_seqs, seq_len, sampling, on_batch=on_batch)
    finally:
        del model
        release_free_memory()
