"""`--method aware` calibrates layer by layer: one layer in memory, same result as the whole model,
merged layers kept on disk (not in memory) until written."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.cli import main  # noqa: E402
from kvtool.convert.aware.calibration import run_layerwise  # noqa: E402
from kvtool.convert.aware.merge import MergeSettings, merge_layer  # noqa: E402
from kvtool.convert.aware.modules import install_proj, read_proj  # noqa: E402
from kvtool.runtime.layerwise import open_layerwise  # noqa: E402

H, KV, HD, LAYERS = 4, 4, 16, 3
SETTINGS = MergeSettings(num_heads=H, num_kv_heads=KV, target_kv_heads=2, head_dim=HD)
IDS = (torch.arange(4 * 48).reshape(4, 48) * 13 + 5) % 500


def _tiny(folder, model_type="llama", seed=0, vocab=500):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                               num_attention_heads=H, num_key_value_heads=KV, head_dim=HD, vocab_size=vocab,
                               max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper attention than the init, so merging changes the function visibly
        for name, p in model.named_parameters():
            if "self_attn" in name and name.endswith("weight"):
                p.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def _whole_model_reference(src):
    """The calibration as one forward of the whole transformers model with a merging pre-hook per
    attention module."""
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = {"x": {}, "merged": {}}

    def merge(module, args, kwargs):
        from kvtool.convert.aware.attention import LayerInputs

        x, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        out["x"][module.layer_idx] = x
        new, _ = merge_layer(LayerInputs(x, cos, sin, float(module.scaling)), read_proj(module), SETTINGS)
        out["merged"][module.layer_idx] = new
        install_proj(module, new, H)

    hooks = [layer.self_attn.register_forward_pre_hook(merge, with_kwargs=True) for layer in converted.model.layers]
    with torch.no_grad():
        converted.model(input_ids=IDS, use_cache=False)
    for hook in hooks:
        hook.remove()
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Layer-wise calibration of a tiny llama, recording what each layer_fn call saw."""
    src = _tiny(tmp_path_factory.mktemp("lw") / "llama")
    seen = {}
    with open_layerwise(src) as lm:
        def layer_fn(i, inp, proj):
            new, _ = merge_layer(inp, proj, SETTINGS)
            seen[i] = {"inp": inp, "merged": new, "real_layers": lm.real_layers(),
                       "embedding": lm.model.get_input_embeddings().weight.device.type}
            return new

        run_layerwise(lm, IDS, layer_fn, H)
        after = lm.real_layers()
    return src, seen, after


def test_calibration_holds_one_decoder_layer_at_a_time(tiny_run):
    _, seen, after = tiny_run
    assert sorted(seen) == list(range(LAYERS))
    for i, rec in seen.items():
        assert rec["real_layers"] == [i]  # every other layer's parameters are on the meta device
        assert rec["embedding"] == "meta"
    assert after == []


def test_layerwise_merge_equals_the_whole_model_calibration(tiny_run):
    src, seen, _ = tiny_run
    ref = _whole_model_reference(src)
    for i in range(LAYERS):
        torch.testing.assert_close(seen[i]["inp"].x, ref["x"][i], rtol=1e-5, atol=1e-5)
        for f in ("q", "k", "v", "o"):
            torch.testing.assert_close(getattr(seen[i]["merged"], f), getattr(ref["merged"][i], f),
                                       rtol=1e-4, atol=1e-5)


def _convert(src, dst, *extra):
    return main(["convert", str(src), str(dst), "--to", "gqa", "--groups", "2", "--method", "aware",
                 "--calib-tokens", "256", "--no-eval", "--no-progress", *extra])


def test_cli_layerwise_and_whole_model_write_the_same_checkpoint(tmp_path, smollm2_path, private_tmp):
    import shutil

    from kvtool.io.reader import CheckpointReader

    src = _tiny(tmp_path / "src", seed=1, vocab=49152)  # SmolLM2's tokenizer
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    assert _convert(src, tmp_path / "lw") == 0
    assert _convert(src, tmp_path / "whole", "--method-opt", "layerwise=false") == 0
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before
    assert list(private_tmp.glob("kvtool-*")) == []  # the merged layers' spill folder is gone
    details = {k: json.loads((tmp_path / k / "kvtool.json").read_text())["method_details"] for k in ("lw", "whole")}
    assert details["lw"]["calibration_model"] == {"mode": "layerwise"}
    assert details["whole"]["calibration_model"]["mode"] == "whole_model"
    with CheckpointReader(tmp_path / "lw") as a, CheckpointReader(tmp_path / "whole") as b:
        assert a.names() == b.names()
        for n in a.names():
            torch.testing.assert_close(a.get(n), b.get(n), rtol=1e-5, atol=1e-6)


def test_merged_layers_wait_on_disk_and_go_on_failure(tmp_path, smollm2_path, private_tmp, monkeypatch):
    import shutil

    from kvtool.convert.aware import merge as merge_mod
    from kvtool.convert.aware.method import AwareMerge
    from kvtool.errors import InputError

    src = _tiny(tmp_path / "src", seed=2, vocab=49152)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    folders = []
    real_prepare = AwareMerge.prepare

    def prepare(self, job):
        real_prepare(self, job)
        # after calibration every merged layer is a file, none is held by the method
        folders.append(sorted(p.name for p in self._merged.folder.iterdir()))

    monkeypatch.setattr(AwareMerge, "prepare", prepare)
    assert _convert(src, tmp_path / "ok") == 0
    assert folders == [[f"layer-{i:05d}.safetensors" for i in range(LAYERS)]]
    assert list(private_tmp.glob("kvtool-*")) == []

    calls = []
    real_merge = merge_mod.merge_layer

    def failing(inp, src_proj, settings):
        calls.append(1)
        if len(calls) == 2:
            raise InputError("simulated failure in layer 1", field="--method")
        return real_merge(inp, src_proj, settings)

    monkeypatch.setattr(merge_mod, "merge_layer", failing)
    assert _convert(src, tmp_path / "failed") == 2
    assert not (tmp_path / "failed").exists()
    assert list(private_tmp.glob("kvtool-*")) == []  # the spill folder went with the failure
