"""A recipe step accepts exactly what its command accepts, over the architecture corpus (issue 15).

For every real config (tests/data/configs, /work/shared/configs where present) and every tiny
checkpoint the convert tests build (tests/convert/convert_tiny.py), written as a header-only
checkpoint (the attention tensors the architecture table names, one element each), each step's
options are given to the command (`kvtool convert --dry-run`, `kvtool rope SRC DST`) and to
`kvtool apply --dry-run` as a one-step recipe. Both must accept, or both refuse with the same
error line (file, field and message). An accepted rope step must plan the config.json, byte for
byte, that the command writes. No torch: planning never imports it.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvtest import DATA, run_without_torch, write_checkpoint
from kvtool.cli import main
from kvtool.errors import KvtoolError
from kvtool.io.jsonfile import dump_json_like
from kvtool.model.preflight import preflight
from kvtool.recipes.apply import apply_recipe
from kvtool.recipes.load import RecipeError, load_recipe
from kvtool.recipes.plan import StepRefused, plan_steps


def _tiny_configs() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("convert_tiny", DATA.parent / "convert" / "convert_tiny.py")
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    out = {}
    for mt in ct.ARCHS:
        for kv in ((1, 4) if mt == "gpt_bigcode" else (1, 2, 4)):
            out[f"tiny-{mt}-kv{kv}"] = {"model_type": mt, **ct.config_kwargs(mt, kv)}
    return out


def _corpus() -> dict[str, dict]:
    files = sorted(glob.glob(str(DATA / "configs" / "*.json"))) + sorted(glob.glob("/work/shared/configs/*.json"))
    out, seen = {}, set()
    for f in files:
        text = Path(f).read_bytes()
        digest = hashlib.sha256(text).hexdigest()
        if digest not in seen:  # the shared corpus repeats most of tests/data/configs
            seen.add(digest)
            out[Path(f).stem] = json.loads(text)
    return {**out, **_tiny_configs()}


CORPUS = _corpus()

# (recipe step, the command's flags): groups that divide, pool, expand and fail; every applicable RoPE type;
# a longrope without its factor files; swapped llama3 bands (the result lint refuses); a per-layer-type edit.
CONVERT = [
    ("{to: mqa}", ["--to", "mqa"]),
    ("{to: mha}", ["--to", "mha"]),
    ("{to: mqa, groups: 2}", ["--to", "mqa", "--groups", "2"]),
    *[(f"{{to: gqa, groups: {g}}}", ["--to", "gqa", "--groups", str(g)]) for g in (1, 2, 3, 4, 8)],
    ("{to: gqa}", ["--to", "gqa"]),
    ("{to: mqa, dtype: bf16}", ["--to", "mqa", "--dtype", "bf16"]),
    ("{to: mqa, refine_steps: 2}", ["--to", "mqa", "--refine-steps", "2"]),
    ("{to: mqa, method: aware, distill_steps: 3, calibration: {dataset: mixed}}",
     ["--to", "mqa", "--method", "aware", "--distill-steps", "3", "--calib-dataset", "mixed"]),
    ("{to: mqa, method: aware, calibration: {dataset: pydoc}}",
     ["--to", "mqa", "--method", "aware", "--calib-dataset", "pydoc"]),
    ("{to: mqa, method: aware, serve_context: 4096, calibration: {dataset: mixed}}",
     ["--to", "mqa", "--method", "aware", "--serve-context", "4096", "--calib-dataset", "mixed"]),
    ("{to: mqa, method: aware, calibration: {dataset: mixed}}",
     ["--to", "mqa", "--method", "aware", "--calib-dataset", "mixed"]),
    ("{to: gqa, groups: 2, method: aware, refine_steps: 2, grouping: similarity, calibration: {dataset: pydoc, "
     "tokens: 64, seq_len: 32}}", ["--to", "gqa", "--groups", "2", "--method", "aware", "--refine-steps", "2",
                                   "--grouping", "similarity", "--calib-tokens", "64", "--seq-len", "32"]),
]
ROPE = [
    ("{type: yarn, factor: 4}", ["--type", "yarn", "--factor", "4"]),
    ("{type: yarn, target_context: 131072, beta_fast: 16}", ["--type", "yarn", "--target-context", "131072",
                                                              "--beta-fast", "16"]),
    ("{type: llama3, factor: 8}", ["--type", "llama3", "--factor", "8"]),
    ("{type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1}",
     ["--type", "llama3", "--factor", "8", "--low-freq-factor", "4", "--high-freq-factor", "1"]),
    ("{type: linear, factor: 2, theta: 500000}", ["--type", "linear", "--factor", "2", "--theta", "500000"]),
    ("{type: dynamic, factor: 2, layout: v5}", ["--type", "dynamic", "--factor", "2", "--layout", "v5"]),
    ("{type: longrope, factor: 2}", ["--type", "longrope", "--factor", "2"]),
    ("{type: yarn, factor: 2, layer_type: sliding_attention, layout: v5}",
     ["--type", "yarn", "--factor", "2", "--layer-type", "sliding_attention", "--layout", "v5"]),
]


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("recipes")
    out = {}
    for kind, cases in (("convert", CONVERT), ("rope", ROPE)):
        for i, (step, _) in enumerate(cases):
            p = folder / f"{kind}{i}.yaml"
            p.write_text(f"version: 1\nsteps:\n  - {kind}: {step}\n")
            out[(kind, step)] = p
    return out


def _command(argv: list[str], capsys) -> str | None:
    """None when the command accepts, else its error line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("kvtool: error: ")]
    assert (rc == 0) == (not lines), (argv, rc, err)
    return lines[0] if lines else None


def _as_command_says(exc: KvtoolError, kind: str) -> str:
    """The error line the command prints for the operation's error (an options field named by its flag)."""
    if exc.option and not exc.field:
        from kvtool.options.fields import OPERATIONS, flag_of

        exc = copy.copy(exc)
        exc.field = flag_of(OPERATIONS[kind], exc.option)
    return f"kvtool: error: {exc.line()}"


def _kind(path: Path) -> str:
    """The one step's kind, read without validating (a recipe whose options are refused does not load)."""
    import yaml

    return next(iter(yaml.safe_load(path.read_text())["steps"][0]))


def _recipe(path: Path, src: Path, dst: Path) -> str | None:
    """None when `kvtool apply --dry-run` accepts the recipe, else the operation's error line it stopped on."""
    try:
        apply_recipe(path, src, dst, dry_run=True, echo=lambda _line: None)
    except (StepRefused, RecipeError) as exc:
        # a recipe-only refusal has no cause: the command would have no twin
        assert exc.cause is not None or not isinstance(exc, StepRefused), exc.line()
        if exc.cause is not None:  # the step's plan, or its options object (declared bounds, when loaded)
            return _as_command_says(exc.cause, _kind(path))
        return f"kvtool: error: {exc.line()}"
    except KvtoolError as exc:  # refused before planning (the source itself): the command refuses it the same
        return f"kvtool: error: {exc.line()}"
    return None


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_recipe_steps_accept_and_refuse_as_the_commands_do(name, tmp_path, recipes, capsys):
    src = write_checkpoint(tmp_path / "src", CORPUS[name], shaped=False)
    verdicts = {}
    for step, flags in CONVERT:
        command = _command(["convert", str(src), *flags, "--dry-run"], capsys)
        recipe = _recipe(recipes[("convert", step)], src, tmp_path / "out")
        assert recipe == command, (name, step)
        verdicts[f"convert {step}"] = command is None
    for i, (step, flags) in enumerate(ROPE):
        dst = tmp_path / f"rope{i}"
        command = _command(["rope", str(src), str(dst), *flags], capsys)
        path = recipes[("rope", step)]
        recipe = _recipe(path, src, tmp_path / "out")
        assert recipe == command, (name, step)
        if command is None:  # the same edit: the planned config is the one the command wrote
            _, state = plan_steps(load_recipe(path), preflight(src, require_weights=False))
            assert dump_json_like(state.config) == (dst / "config.json").read_text(encoding="utf-8"), (name, step)
        verdicts[f"rope {step}"] = command is None
    assert len(verdicts) == len(CONVERT) + len(ROPE)


def test_quantize_kv_steps_refuse_as_the_command_does(tmp_path):
    """quantize-kv's plan (what the command runs before loading a model; torch-free) against the recipe
    step's, over the whole corpus: the same verdict and error line (an out-of-range observer included)."""
    from kvtool.model.preflight import check_loadable
    from kvtool.options.quantize_kv import QuantizeOptions
    from kvtool.quantize.run import plan

    cases = [("{calibration: {dataset: pydoc}}", {}),
             ("{strategy: attn_head, observer: 'absmax:1', calibration: {dataset: pydoc}}",
              {"strategy": "attn_head", "observer": "absmax:1"}),
             ("{observer: 'percentile:200', calibration: {dataset: pydoc}}", {"observer": "percentile:200"})]
    verdicts = set()
    for name, config in sorted(CORPUS.items()):
        src = write_checkpoint(tmp_path / name, config, shaped=False)
        for i, (step, kw) in enumerate(cases):
            try:
                dst = str(tmp_path / f"{name}.q{i}")
                check_loadable(src)  # as `kvtool quantize-kv` does first: the folder, then the options
                plan(str(src), dst, QuantizeOptions(src=str(src), dst=dst, **kw))
                command = None
            except KvtoolError as exc:
                command = _as_command_says(exc, "quantize-kv")
            r = tmp_path / f"q{i}.yaml"
            r.write_text(f"version: 1\nsteps:\n  - quantize-kv: {step}\n")
            assert _recipe(r, src, tmp_path / "out") == command, (name, step)
            verdicts.add(command is None)
    assert verdicts == {True, False}


def test_a_bad_observer_is_refused_by_the_dry_runs_alike_without_torch(tmp_path):
    """`kvtool quantize-kv SRC --dry-run --observer percentile:200` and `kvtool apply --dry-run` of the same
    step print the same error line (the recipe's at its step), in a fresh interpreter that never imports torch."""
    src = write_checkpoint(tmp_path / "src", CORPUS["smollm2-360m"], shaped=False)
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nsteps:\n  - quantize-kv: {observer: 'percentile:200', calibration: {dataset: pydoc}}\n")
    line = "observer 'percentile': P 200 is out of range (50 <= P <= 100)"
    cmd = run_without_torch(["quantize-kv", src, "--dry-run", "--observer", "percentile:200"])
    assert cmd.returncode == 2 and cmd.stderr == f"kvtool: error: --observer: {line}\n", cmd.stderr
    rec = run_without_torch(["apply", r, src, tmp_path / "out", "--dry-run"])
    assert rec.returncode == 2 and line in rec.stderr and rec.stderr.count("\n") == 1, rec.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("step", "flags"), [("{select: [KV999]}", ["--select", "KV999"]),
                                             ("{select: [KV1], ignore: [KV1, KV9999]}", ["--select", "KV1", "--ignore",
                                                                                      "KV1,KV9999"]),
                                             ("{select: [KV1], strict: true}", ["--select", "KV1", "--strict"])])
def test_lint_steps_refuse_as_the_command_does(step, flags, tmp_path, capsys):
    """`kvtool lint` and a recipe's lint step share kvtool.rules.run.plan: an unknown code, the same line."""
    src = write_checkpoint(tmp_path / "src", CORPUS["smollm2-360m"], shaped=False)
    rc = main(["lint", str(src), "--isolated", *flags])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvtool: error: ")]
    command = lines[0] if rc == 2 else None
    r = tmp_path / "r.yaml"
    r.write_text(f"version: 1\nsteps:\n  - lint: {step}\n")
    assert _recipe(r, src, tmp_path / "out") == command


HUGE = "9" * 400 + "%"  # overflows to infinity


@pytest.mark.parametrize(("step", "flags", "refusal"), [
    ("{dataset: pydoc, max_length: 64, stride: 32}", ["--max-length", "64", "--stride", "32"], None),
    ("{dataset: pydoc, max_length: 64, stride: 64}", ["--max-length", "64", "--stride", "64"], "--stride: must be"),
    ("{dataset: pydoc, max_tokens: 1}", ["--max-tokens", "1"], "--max-tokens: must be at least 2"),
    (f"{{dataset: pydoc, thresholds: {{max_ppl_increase: '{HUGE}'}}}}", ["--max-ppl-increase", HUGE],
     "is not a finite number >= 0"),
    ("{dataset: pydoc, thresholds: {max_ppl_increase: '2%', min_top1: 0.9}}",
     ["--max-ppl-increase", "2%", "--min-top1", "0.9"], None),
])
def test_eval_steps_refuse_as_the_command_does(step, flags, refusal, tmp_path, capsys):
    """`kvtool eval MODEL --baseline SRC --dry-run` and a recipe's eval step share kvtool.eval.run.plan: the
    window, token and gate refusals, the same line; no torch either way."""
    src = write_checkpoint(tmp_path / "src", CORPUS["smollm2-360m"], shaped=False)
    command = _command(["eval", str(src), "--baseline", str(src), "--dataset", "pydoc", *flags, "--dry-run"], capsys)
    r = tmp_path / "r.yaml"
    assert (command is None) == (refusal is None) and (refusal is None or refusal in command), command
    r.write_text(f"version: 1\nsteps:\n  - eval: {step}\n")
    assert _recipe(r, src, tmp_path / "out") == command


def test_the_corpus_exercises_both_verdicts_of_every_kind(tmp_path, capsys):
    """Guards the parity test against a corpus where everything is refused (or accepted) for a dull reason."""
    assert len(CORPUS) >= 80
    picks = {"llama-3.1-8b": ("convert", 0, None), "gpt2": ("convert", 0, "gpt2 cannot be converted"),
             "smollm2-360m": ("rope", 0, None), "mpt-7b-shrunk": ("rope", 0, "not RoPE")}
    for name, (kind, i, refusal) in picks.items():
        src = write_checkpoint(tmp_path / name, CORPUS[name], shaped=False)
        flags = (CONVERT if kind == "convert" else ROPE)[i][1]
        argv = ["convert", str(src), *flags, "--dry-run"] if kind == "convert" else \
            ["rope", str(src), str(tmp_path / f"{name}.out"), *flags]
        got = _command(argv, capsys)
        assert (got is None) == (refusal is None) and (refusal is None or refusal in got), (name, got)


def test_planning_never_imports_torch(tmp_path):
    """Run in a fresh interpreter: a recipe of convert + rope + quantize-kv plans without importing torch."""
    import subprocess

    src = write_checkpoint(tmp_path / "src", CORPUS["smollm2-360m"], shaped=False)
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nsteps:\n  - rope: {type: yarn, factor: 2}\n  - convert: {to: mqa}\n"
                 "  - quantize-kv: {calibration: {dataset: pydoc}}\n  - lint: {}\n")
    code = ("import sys\nfrom kvtool.recipes.apply import apply_recipe\n"
            f"apply_recipe({str(r)!r}, {str(src)!r}, {str(tmp_path / 'out')!r}, dry_run=True)\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "1. rope: yarn factor 2" in res.stdout and "3. quantize-kv: FP8 KV scales" in res.stdout


SHIPPED = {"llama-2-7b-gqa8": "llama-2-7b-hf", "llama-3.1-8b-fp8-kv": "llama-3.1-8b",
           "mistral-7b-yarn-32k": "mistral-7b-instruct-v0.1", "qwen2.5-7b-yarn-128k": "qwen2.5-7b-instruct",
           "smollm2-135m-mqa-fp8": "smollm2-360m"}


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_shipped_recipes_plan_on_their_models_config(recipe, tmp_path):
    """Each recipe in recipes/ passes `kvtool apply --dry-run` on (a header-only copy of) the model it names."""
    src = write_checkpoint(tmp_path / "src", CORPUS[SHIPPED[recipe]], shaped=False)
    path = DATA.parents[1] / "recipes" / f"{recipe}.yaml"
    lines = []
    report = apply_recipe(path, src, tmp_path / "out", dry_run=True, echo=lines.append)
    assert report["dry_run"] and len(report["plan"]) == len(load_recipe(path).steps) == len(lines) - 1
