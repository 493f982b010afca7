"""quantize-kv writes scales for every KV-cache dtype that loads them (kvtool/quantize/formats.py), and names the
ones that ignore them, from the emulation table (kvtool/model/kv_emulations.json `scales`), not a list in code.

NVFP4: the scales are the per-layer global scales, amax / 2688 of the calibration K / V (checked against a
transformers forward of the same tokens, computed here), in the form the fp8 scales take (compressed-tensors
kv_cache_scheme, <attention>.k_scale / v_scale), which vLLM 0.33 loads for any --kv-cache-dtype.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvtool.model import kv_dtypes, kv_emulations
from kvtool.options import quantize_kv as options
from kvtool.quantize.formats import FORMATS


def test_every_dtype_that_loads_checkpoint_scales_has_a_format():
    loads = {n for n, r in kv_emulations.table().items() if r.scales == "checkpoint"}
    served = {d for f in FORMATS.values() for d in f.serves}
    assert loads and loads <= served, sorted(loads - served)
    assert tuple(FORMATS) == options.FORMATS  # the --format choices are the table's
    for f in FORMATS.values():
        assert all(kv_dtypes.get(d) is not None for d in f.serves), f.name
        assert f.eval_dtype in f.serves  # the quality report emulates the dtype the scales are for
    assert FORMATS["nvfp4"].max == 2688.0 and FORMATS["nvfp4"].default_observer == "absmax"


def test_the_ignoring_lines_are_the_tables_rows_that_do_not_read_scales():
    from kvtool.quantize.run import ignoring_lines

    lines = ignoring_lines()
    ignoring = [n for n, r in kv_emulations.table().items() if r.scales != "checkpoint"]
    assert ignoring and [line.split(":")[0] for line in lines] == ignoring
    assert all("ignores checkpoint scales" in line for line in lines)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LAYERS, KV = 3, 2
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=KV, head_dim=64,  # a head size vLLM serves NVFP4 at (FlashInfer)
            max_position_embeddings=256, tie_word_embeddings=True,
            vocab_size=49152)


@pytest.fixture
def tiny_src(tmp_path, smollm2_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    with torch.no_grad():  # K / V of different sizes per layer and head
        for name, p in model.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.mul_(1 + 4 * torch.rand(p.shape[0], 1))
    src = tmp_path / "src"
    model.save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    return src


def _calibration_amax(src, text_file, tokens: int, seq_len: int) -> dict:
    """Running max |K| / |V| per layer over the calibration tokens, from transformers' whole-model forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtest import running_kv_amax
    from kvtool.quantize.run import calibration_windows

    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:tokens]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    return running_kv_amax(model, calibration_windows(tok, ids, seq_len))


def test_nvfp4_global_scales_are_amax_over_2688_and_load(tmp_path, tiny_src, calib_text_file, capsys):
    from kvtool.cli import main
    from kvtool.eval.fp8 import read_checkpoint_scales

    dst = tmp_path / "dst"
    assert main(["quantize-kv", str(tiny_src), str(dst), "--format", "nvfp4", "--calib-text", str(calib_text_file),
                 "--calib-tokens", "160", "--seq-len", "64", "--no-eval", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "serve with vLLM --kv-cache-dtype nvfp4 or nvfp4_4over6" in out and "amax / 2688" in out
    for name, row in kv_emulations.table().items():  # one line per dtype that ignores them, none for the others
        assert (f"  {name}: ignores checkpoint scales" in out) == (row.scales != "checkpoint"), name

    amax = _calibration_amax(tiny_src, calib_text_file, 160, 64)
    scales = read_checkpoint_scales(dst)  # what eval and vLLM's loader take from the folder
    assert sorted(scales.k) == sorted(scales.v) == list(range(LAYERS))
    for i in range(LAYERS):
        for role, table in (("k", scales.k), ("v", scales.v)):
            want = amax[(i, role)].max() / 2688.0
            assert table[i].numel() == 1 and torch.allclose(table[i].reshape(()), want, rtol=1e-6, atol=0), (i, role)
    prov = json.loads((dst / "kvtool.json").read_text())
    assert prov["format"] == "nvfp4" and prov["serves"] == ["nvfp4", "nvfp4_4over6"] and prov["observer"] == "absmax:1"
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    # the queries' scales stay e4m3 ones (vLLM rounds queries to e4m3 for an NVFP4 cache too): amax / 448
    assert scales.q and all(float(scales.q[i].max()) > float(scales.k[i].max()) for i in scales.q)

    # kvtool lint accepts what was written: no scale vLLM drops (KV806), none of a shape it refuses (KV807)
    assert main(["lint", str(dst), "--format", "json"]) in (0, 1)
    codes = {f["code"] for m in json.loads(capsys.readouterr().out)["models"] for f in m["findings"]}
    assert not codes & {"KV801", "KV802", "KV806", "KV807"}, codes


def test_e5m2_scales_map_the_maximum_onto_57344(tmp_path, tiny_src, calib_text_file, capsys):
    """--format e5m2 (vLLM --kv-cache-dtype fp8_e5m2 divides by the same k_scale / v_scale): absmax scales are
    amax / 57344, e5m2's largest finite value."""
    from kvtool.cli import main
    from kvtool.eval.fp8 import read_checkpoint_scales

    dst = tmp_path / "dst"
    assert main(["quantize-kv", str(tiny_src), str(dst), "--format", "e5m2", "--observer", "absmax",
                 "--calib-text", str(calib_text_file), "--calib-tokens", "96", "--seq-len", "48", "--no-eval",
                 "--device", "cpu", "--no-q-scales"]) == 0
    assert "serve with vLLM --kv-cache-dtype fp8_e5m2\n" in capsys.readouterr().out
    amax = _calibration_amax(tiny_src, calib_text_file, 96, 48)
    scales = read_checkpoint_scales(dst)
    for i in range(LAYERS):
        for role, table in (("k", scales.k), ("v", scales.v)):
            assert torch.allclose(table[i].reshape(()), amax[(i, role)].max() / 57344.0, rtol=1e-6, atol=0)
    assert not scales.q


def test_nvfp4_quality_report_scores_the_nvfp4_cache(tmp_path, tiny_src, calib_text_file):
    """The report's rows are the dtype the scales are for, as `kvtool eval --kv-cache-dtype nvfp4` emulates it:
    the original, NVFP4 with global scale 1.0 (vLLM's default) and with the calibrated amax / 2688."""
    from kvtool.quantize.run import QuantizeOptions, quantize_kv

    dst = tmp_path / "dst"
    res = quantize_kv(str(tiny_src), str(dst), QuantizeOptions(
        src=str(tiny_src), dst=str(dst), format="nvfp4", calib_text=[str(calib_text_file)], calib_tokens=96,
        seq_len=48, eval_text=[str(calib_text_file)], eval_tokens=96, device="cpu"))
    labels = [r.label for r in res.quality]
    assert labels == ["original", "nvfp4 scale 1.0", "nvfp4 calibrated (absmax:1, tensor)"]
    cal, one = res.quality[2].metrics, res.quality[1].metrics
    assert cal["kld_mean"] > 0 and one["kld_mean"] > 0 and cal["kld_mean"] != one["kld_mean"]
