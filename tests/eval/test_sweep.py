"""`kvtool eval --kv-sweep` (kvtool/eval/sweep.py) on the tiny random llama: one baseline pass, several options
per forward equal to separate evaluations, the frontier and the recommendation from the figures, the plot, and
bad input as one line with exit 2."""

from __future__ import annotations

import json
import math

import pytest

from kvtool.cli import main
from kvtool.eval import api, sweep
from kvtool.eval.sweep import SweepOption

from eval_helpers import DEVICE, mean_pooled_mqa

L, S, N = 64, 32, 160
FAST = ["--max-length", str(L), "--stride", str(S), "--max-tokens", str(N), "--device", DEVICE, "--dtype", "fp32"]


@pytest.fixture(scope="module")
def mqa(tmp_path_factory, tiny_llama_path):
    return mean_pooled_mqa(tiny_llama_path, tmp_path_factory.mktemp("sweep") / "tiny-mqa")


@pytest.fixture(scope="module")
def counted(tiny_llama_path, mqa, tiny_deepseek_path):
    """The sweep of the tiny llama, its MQA conversion and a tiny MLA model (the same tokenizer: the latent
    cache's emulation per row), with every model call recorded."""
    calls: list[tuple[str, int, bool]] = []
    real = api._Loaded.logits

    def logits(self, batch, keep):
        hooked = any(getattr(m, "_kvtool_kv_fn", None) is not None for m in self.model.modules())
        calls.append((self.name, int(batch.shape[0]), hooked))
        return real(self, batch, keep)

    mp = pytest.MonkeyPatch()
    mp.setattr(api._Loaded, "logits", logits)
    try:
        r = sweep.run(str(tiny_llama_path), [str(mqa), str(tiny_deepseek_path)], max_length=L, stride=S, max_tokens=N, device=DEVICE,
                      dtype="fp32", gates={"max_ppl_increase": 0.02})
    finally:
        mp.undo()
    return r, calls


def test_the_baseline_runs_once_per_window_and_options_share_forwards(counted, tiny_llama_path, mqa,
                                                                      tiny_deepseek_path):
    r, calls = counted
    from kvtool.eval.windows import windows

    n_windows = len(windows(N, L, S))
    base = str(tiny_llama_path)
    plain_base = [c for c in calls if c[0] == base and not c[2]]
    assert len(plain_base) == n_windows == r.forwards["baseline"]  # one baseline forward per window, no more
    mine = [o for o in r.options if o.model == base and o.kv_cache_dtype != sweep.OWN_DTYPE]
    theirs = [o for o in r.options if o.model == str(mqa)]
    # every option of a model in one forward (the tiny logits fit): rows = options, per window
    assert sorted(c[1] for c in calls if c[0] == base and c[2]) == [len(mine)] * n_windows
    mla = [o for o in r.options if o.model == str(tiny_deepseek_path)]
    assert sorted(c[1] for c in calls if c[0] == str(mqa)) == [len(theirs)] * n_windows
    assert sorted(c[1] for c in calls if c[0] == str(tiny_deepseek_path)) == [len(mla)] * n_windows
    assert len(calls) == 4 * n_windows
    assert r.forwards["rows"] == (len(mine) + len(theirs) + len(mla)) * n_windows


def test_batched_options_equal_separate_evaluations(counted, tiny_llama_path):
    """Each option's figures against an `evaluate` of that option alone (one window per forward): equal to
    float rounding (batched matmuls sum in another order), measured."""
    r, _ = counted
    assert len(r.options) >= 6  # MODEL and the two others, each at its own dtype and at least fp8
    assert any(o.model.endswith("tiny-deepseek") and o.kv_cache_dtype == "fp8" for o in r.options)
    for o in r.options:
        alone = api.evaluate(o.model, str(tiny_llama_path), max_length=L, stride=S, max_tokens=N, device=DEVICE,
                             dtype="fp32", kv_cache_dtype=o.kv_cache_dtype, kv_scales="checkpoint", layerwise=False)
        for key in ("ppl", "ppl_ratio", "kld_mean", "top1_agreement", "ppl_ratio_se", "kld_se"):
            assert o.metrics[key] == pytest.approx(alone.metrics[key], rel=1e-4, abs=1e-7), (o.label, key)
        assert o.metrics["tokens"] == alone.metrics["tokens"]
    own = next(o for o in r.options if not o.candidate and o.kv_cache_dtype == sweep.OWN_DTYPE)
    assert own.metrics["kld_mean"] == 0 and own.metrics["ppl_ratio"] == 1


def test_bytes_come_from_kv_budget(counted, tiny_llama_path, mqa, capsys):
    """The bytes per token are kv-budget's figure for that dtype and checkpoint (kvtool.model.kvcache)."""
    r, _ = counted
    for o in r.options:
        dtype = o.cache if o.kv_cache_dtype == sweep.OWN_DTYPE else o.kv_cache_dtype
        assert main(["kv-budget", o.model, "--kv-cache-dtype", dtype, "--format", "json"]) in (0, 1)  # 1: a finding
        d = json.loads(capsys.readouterr().out)
        assert o.bytes_per_token == pytest.approx(d["kv_bytes_per_token"]), o.label
    own = {o.model: o.bytes_per_token for o in r.options if o.kv_cache_dtype == sweep.OWN_DTYPE}
    assert own[str(mqa)] * 2 == own[str(tiny_llama_path)]  # 1 KV head instead of 2


def test_frontier_and_recommendation_follow_from_the_figures(counted):
    r, _ = counted
    for flag, metric in (("frontier_ppl", "ppl_ratio"), ("frontier_kld", "kld_mean")):
        for o in r.options:
            beaten = any(p.bytes_per_token <= o.bytes_per_token and p.metrics[metric] <= o.metrics[metric]
                         and (p.bytes_per_token < o.bytes_per_token or p.metrics[metric] < o.metrics[metric])
                         for p in r.options if p is not o)
            assert getattr(o, flag) is (not beaten), (o.label, flag)
    passing = [o for o in r.options if o.passed]
    assert r.recommended is not None and r.recommended.passed
    assert r.recommended.bytes_per_token == min(o.bytes_per_token for o in passing)
    for o in r.options:
        assert o.passed is (o.metrics["ppl_ratio"] - 1 <= 0.02)


def _opt(label, b, ratio, kld, candidate=False, passed=True):
    model, dtype = label.split(" + ") if candidate else ("m", label)
    o = SweepOption(model, dtype, b, dtype, candidate=candidate)
    assert o.label == label
    o.metrics = {"ppl_ratio": ratio, "kld_mean": kld}
    from kvtool.eval.gate import GateResult

    o.gates = [GateResult("max_ppl_increase", "ppl_increase", 0.02, ratio - 1, passed)]
    return o


def test_pareto_recommend_and_conversion_verdicts_on_given_figures():
    a = _opt("bf16", 100, 1.0, 0.0)
    b = _opt("fp8", 50, 1.01, 0.01)
    c = _opt("int4", 25, 1.30, 0.3, passed=False)
    d = _opt("worse fp8", 50, 1.02, 0.02)  # dominated by fp8 at the same bytes
    conv = _opt("mqa + bf16", 40, 1.005, 0.005, candidate=True)  # beats fp8 at fewer bytes
    conv2 = _opt("mqa + int4", 10, 1.5, 0.5, candidate=True, passed=False)  # nothing of MODEL is that small
    conv3 = _opt("gqa + fp8", 60, 1.2, 0.2, candidate=True)  # fp8 is better at fewer bytes
    opts = [a, b, c, d, conv, conv2, conv3]
    sweep.mark_frontier(opts)
    assert [o.label for o in opts if o.frontier_ppl] == ["bf16", "int4", "mqa + bf16", "mqa + int4"]
    assert not d.frontier_kld and not conv3.frontier_kld
    assert sweep.recommend(opts) is conv  # the smallest that passes
    verdicts = {v["option"]: v for v in sweep.conversion_verdicts(opts)}
    assert verdicts["mqa + bf16"]["beats_dtypes"] and verdicts["mqa + bf16"]["rival"] == "int4"
    assert verdicts["mqa + int4"]["beats_dtypes"] is None and verdicts["mqa + int4"]["rival"] is None
    assert not verdicts["gqa + fp8"]["beats_dtypes"] and verdicts["gqa + fp8"]["rival"] == "fp8"
    assert sweep.pareto([(1, math.nan), (2, 1.0)]) == [False, True]


def test_aliases_are_scored_once(tiny_llama_path):
    """fp8 and fp8_e4m3 emulate the same cache: one option, listed with both names."""
    opts, _ = sweep.options_for(str(tiny_llama_path), [])
    names = [o.kv_cache_dtype for o in opts] + [n for o in opts for n in o.same_as]
    assert "fp8" in names and "fp8_e4m3" in names
    assert not any(o.kv_cache_dtype == "fp8_e4m3" for o in opts if "fp8" in [o.kv_cache_dtype, *o.same_as]
                   and o.kv_cache_dtype != "fp8")
    assert sweep.emulation_key("fp8") == sweep.emulation_key("fp8_e4m3")


@pytest.mark.torch
def test_cli_text_json_and_plot(tiny_llama_path, mqa, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # --plot: the `plot` extra, like kv-budget's plot tests
    plot = tmp_path / "frontier.png"
    rc = main(["eval", str(tiny_llama_path), "--kv-sweep", "--candidate", str(mqa), *FAST, "--plot", str(plot),
               "--max-kld", "0", "--progress"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kv sweep" in err  # the progress line of the long work, on stderr
    assert "recommend float32" in out or "recommend bfloat16" in out or "recommend float16" in out  # KLD 0: only it
    assert "K/V read back from the cache for every token" in out
    assert "tiny-mqa + " in out and "convert   tiny-mqa" in out
    rc = main(["eval", str(tiny_llama_path), "--kv-sweep", *FAST, "--format", "json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["recommended"] and d["forwards"]["baseline"] >= 1
    assert all("kv_bytes_per_token" in o and "frontier" in o for o in d["options"])


@pytest.mark.torch
@pytest.mark.parametrize("extra,needle", [
    (lambda p, t: ["--candidate", str(t / "missing")], "missing"),
    (lambda p, t: ["--candidate", str(p)], "--candidate"),
    (lambda p, t: ["--candidate", str(t / "x")], None),
    (lambda p, t: ["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    (lambda p, t: ["--plot", str(t / "a.txt")], "--plot"),
    (lambda p, t: ["--plot", str(t / "no" / "a.png")], "folder does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_llama_path, tmp_path, capsys, extra, needle):
    if needle is None:  # a candidate with another tokenizer: same size, two ids swapped
        import shutil

        other = tmp_path / "x"
        shutil.copytree(tiny_llama_path, other)
        tok = json.loads((other / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
        (other / "tokenizer.json").write_text(json.dumps(tok))
        needle = "different tokenizers"
    rc = main(["eval", str(tiny_llama_path), "--kv-sweep", *FAST, *extra(tiny_llama_path, tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("kvtool: error:") and needle in err[0], err


@pytest.mark.torch
def test_candidate_and_plot_go_with_kv_sweep(tiny_llama_path, capsys):
    rc = main(["eval", str(tiny_llama_path), *FAST, "--candidate", str(tiny_llama_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--candidate" in err and "--kv-sweep" in err


@pytest.mark.torch
def test_a_recipe_eval_step_sweeps(tiny_llama_path, tmp_path, capsys):
    """The recipe's eval step takes kv_sweep (one options declaration, one plan / apply): its report is the
    sweep's."""
    r = tmp_path / "sweep.yaml"
    r.write_text("version: 1\nsteps:\n  - eval:\n      dataset: pydoc\n      max_tokens: 160\n      max_length: 64\n"
                 "      stride: 32\n      kv_sweep: true\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(tiny_llama_path), str(dst), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    step = d["steps"][0]
    assert step["passed"] is True
    metrics = step["details"]["metrics"]
    assert metrics["recommended"] and len(metrics["options"]) >= 2
