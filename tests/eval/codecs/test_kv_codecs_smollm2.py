"""The TurboQuant presets on SmolLM2-135M's real K / V: measured, their error orders as their bits do.

K and V are captured from every attention layer on the first 256 tokens of the pydoc evaluation text; each
preset's codec runs on the layers vLLM quantizes (all but its boundary layers), as kvtool eval reads them
(every token's K / V read back from the cache, as decoding reads them). Measured on this machine (float32,
512 tokens): reconstruction error |x - x'|^2 / |x|^2 of K + V 0.010 (k8v4), 0.018 (4bit_nc), 0.040 (k3v4_nc),
0.074 (3bit_nc); KLD to the unquantized model 0.014, 0.050, 0.200, 0.223; PPL ratio 1.010, 1.071, 1.170, 1.220.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.eval.codecs import get
from kvtool.model import kv_dtypes, kv_emulations
from kvtool.runtime.kv_hooks import kv_hook

pytestmark = [pytest.mark.slow, pytest.mark.real_weights]

ORDER = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")  # most bits first


def _codec(name: str, layers: int):
    e, row = kv_emulations.get(name), kv_dtypes.get(name)
    f, params = get(e.codec), dict(e.params)
    n = min(row.boundary_layers, layers // 2)
    skip = set(range(n)) | set(range(layers - n, layers))

    def fn(layer, k, v):
        if layer in skip:
            return k, v
        return f(k, role="k", params=params, row=row, scale=None), f(v, role="v", params=params, row=row, scale=None)

    return fn


def test_turboquant_error_orders_as_its_bits(smollm2_model, smollm2_tokenizer, eval_text_file):
    """Measured: reconstruction error of K + V, and the KLD of the model's next-token distribution to the
    unquantized model's, grow strictly from k8v4 to 4bit_nc to k3v4_nc to 3bit_nc; boundary layers are left
    as they are."""
    model = smollm2_model
    device = next(model.parameters()).device
    ids = smollm2_tokenizer(eval_text_file.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, :256]
    ids = ids.to(device)
    layers = model.config.num_hidden_layers
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(layer, k, v):
        seen[layer] = (k.clone(), v.clone())
        return k, v

    with torch.no_grad(), kv_hook(model, capture):
        base = model(ids).logits.float().log_softmax(-1)
    recon, kld = [], []
    for name in ORDER:
        fn = _codec(name, layers)
        err = 0.0
        for layer, (k, v) in seen.items():
            k2, v2 = fn(layer, k, v)
            err += float(((k2 - k) ** 2).sum() / (k ** 2).sum() + ((v2 - v) ** 2).sum() / (v ** 2).sum())
        recon.append(err)
        with torch.no_grad(), kv_hook(model, fn):
            lp = model(ids).logits.float().log_softmax(-1)
        kld.append(float((base.exp() * (base - lp)).sum(-1).mean()))
    assert all(a < b for a, b in zip(recon, recon[1:])), dict(zip(ORDER, recon))
    assert all(a < b for a, b in zip(kld, kld[1:])), dict(zip(ORDER, kld))
    assert kld[0] > 0  # the cheapest preset still changed something
