"""kvtool/model/engine_tables.py: every engine table in one format with one citation type, the one place that names
the newest release read, and a made-up vLLM release read by editing data only (a dry run through the CLI)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.model import engine_tables as et
from kvtool.model.engine_tables import Citation, citation, load
from kvtest import REPO

ROOTS = (REPO / "schemas" / "engines", REPO / "kvtool" / "model", REPO / "kvtool" / "budget")


def _cites(value):
    """Every Citation in a parsed table."""
    if isinstance(value, Citation):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _cites(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _cites(v)


def test_every_engine_table_is_registered_and_loads_in_the_one_format():
    # a JSON file beside the tables that cites an engine's source and is not in TABLES would be read by a loader
    # of its own: every file whose text has a "citation" key is a registered table
    citing = {str(p.relative_to(REPO)) for root in ROOTS for p in root.glob("*.json")
              if re.search(r'"\w*citations?"\s*:', p.read_text(encoding="utf-8"))}
    assert citing and citing <= set(et.TABLES), citing - set(et.TABLES)
    for name in et.TABLES:
        t = load(name)
        assert t.about and set(t.rows) == set(et.TABLES[name]), name
        raw = json.dumps(json.loads((REPO / name).read_text(encoding="utf-8")))
        # every citation in the file became a Citation: none is left as a string or a dict
        n_raw = len(re.findall(r'"\w*citations?": \{|"\w*citations?": \[\{', raw))
        assert not re.search(r'"\w*citations?": "', raw), name
        assert sum(1 for _ in _cites(t.rows)) >= n_raw, name
    assert sum(1 for n in et.TABLES for _ in _cites(load(n).rows)) > 100  # 134 when written


def test_a_citation_has_one_json_form():
    c = citation({"release": "0.33.0", "file": "vllm/config/cache.py", "function": "CacheConfig"})
    assert str(c) == "vllm/config/cache.py, CacheConfig (0.33.0)" and c.excerpt is None
    assert citation(c.as_json()) == c
    ex = {**c.as_json(), "excerpt": "vllm__config__cache.py.txt"}  # in tests/data/vllm/0.33.0/
    assert citation(ex).as_json() == ex
    for bad, needle in [
        ("vllm/config/cache.py, CacheConfig, 0.33.0", "not str"),  # the old string form
        ({"file": "f", "function": "g"}, "['release'] missing"),
        ({**c.as_json(), "line": 3}, "['line'] unknown"),
        ({**c.as_json(), "release": "latest"}, "not a release number"),
        ({**c.as_json(), "excerpt": "../../etc/passwd"}, "not a file name in tests/data/<engine>/<release>/"),
        ({**c.as_json(), "excerpt": "/etc/passwd"}, "not a file name in tests/data/<engine>/<release>/"),
        ({**c.as_json(), "function": ""}, "non-empty string"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)) as e:
            citation(bad, "x.json: dtypes[3].citation")
        assert str(e.value).startswith("x.json: dtypes[3].citation")


def test_every_excerpt_a_table_names_is_kept():
    named = [c for n in et.TABLES for c in _cites(load(n).rows) if c.excerpt]
    kept = [c for c in named if any((REPO / "tests" / "data" / e / c.release / c.excerpt).is_file() for e in et.ENGINES)]
    assert kept == named, [c for c in named if c not in kept]


def test_a_malformed_table_is_refused_naming_file_and_field(tmp_path, monkeypatch):
    for name in et.TABLES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    gpus = tmp_path / "kvtool/budget/gpus.json"
    data = json.loads(gpus.read_text())
    monkeypatch.setenv(et.ENV, str(tmp_path))
    for change, needle in [({"typo_gpus": []}, "keys ['typo_gpus'] unknown"), ({"about": None}, "about:"),
                           ({"release": "0.x"}, "release: '0.x'"), ({"engine": "vllm", "release": "0.1.0"},
                                                                    "vllm 0.1.0 is not in schemas/engines/releases.json")]:
        gpus.write_text(json.dumps({**data, **change}))
        et._read.cache_clear()
        with pytest.raises(ValueError, match=re.escape(needle)) as e:
            load("kvtool/budget/gpus.json")
        assert str(e.value).startswith("kvtool/budget/gpus.json: ")
    et._read.cache_clear()
    et._releases.cache_clear()


def test_one_place_names_the_newest_release_read():
    from kvtool.engines.releases import known
    from kvtool.eval import fp8_backends
    from kvtool.model import kv_dtypes, kv_scale_names

    read = {e: et.newest_read(e) for e in et.ENGINES}
    assert all(read[e] in known()[e] for e in et.ENGINES)
    # the Python tables that restate vLLM's code cite the newest release read, and its excerpts are kept
    assert fp8_backends.RELEASE == kv_scale_names.REMAP_RELEASE == read["vllm"]
    assert (REPO / "tests" / "data" / "vllm" / read["vllm"]).is_dir()
    assert fp8_backends.CPU_RELEASE == et.observed("vllm")
    # a table with its own release was read no later than the newest read
    from packaging.version import Version

    for name in et.TABLES:
        t = load(name)
        if t.release is not None and name != "kvtool/budget/platforms.json":
            assert Version(t.release) <= Version(read["vllm"]), name
    assert kv_dtypes.release() == load("kvtool/model/kv_dtypes.json").release


# --- no release number of an engine written into kvtool's code ------------------------------------------------
# Code names a release through kvtool.model.engine_tables (newest_read, observed, known) or a table's own
# `release`. Docstrings and comments cite where a fact was read (a citation stays true when a newer release is
# read), and so does a rule's documentation (define's `doc`); everything else a user reads, message or help, may
# not name the newest release read or the observed one.
ALLOWED: dict[str, str] = {}  # "path:line" -> why; empty: no exception today


def _docs(tree) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "define" and len(n.args) >= 5:
            out.add(id(n.args[4]))
    return out


def release_literals(text: str, releases: dict[str, set[str]]) -> list[str]:
    """The releases (or their X.Y) a string names next to its engine's name or source path."""
    hits = []
    for engine, vs in releases.items():
        if not re.search(rf"(?i)\b{engine}\b", text):
            continue
        for v in vs:
            short = ".".join(v.split(".")[:2])
            hits += re.findall(rf"(?<![\w.]){re.escape(short)}(?:\.\d+)?(?![\w]|\.\d)", text)
    return hits


def scan(root: Path, releases: dict[str, set[str]]) -> list[str]:
    found = []
    for p in sorted(root.rglob("*.py")):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs = _docs(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                hits = release_literals(n.value, releases)
                where = f"{p.relative_to(root.parent)}:{n.lineno}"
                if hits and where not in ALLOWED:
                    found.append(f"{where}: {hits}")
    return found


def test_no_release_of_an_engine_is_written_in_code():
    releases = {"vllm": {et.newest_read("vllm"), et.observed("vllm")}, "transformers": {et.newest_read("transformers")}}
    assert scan(REPO / "kvtool", releases) == []


def test_the_release_scan_finds_what_it_forbids(tmp_path):
    pkg = tmp_path / "kvtool"
    pkg.mkdir()
    (pkg / "m.py").write_text('"""Read in vLLM 0.33.0 (a docstring cites)."""\n'
                              'HELP = "A KV-cache dtype vLLM 0.33 accepts"\n'
                              'FRACTION = "a fraction (0.33, 33%)"\n'
                              'define("KV1", "n", "error", "summary", "vllm 0.33, vllm/config/model.py")\n'
                              'MSG = f"vLLM {newest}\'s layer"  # vllm 0.33 in a comment\n'
                              'PIN = "transformers==5.25.0"\n')
    assert scan(pkg, {"vllm": {"0.33.0"}, "transformers": {"5.25.0"}}) == \
        ["kvtool/m.py:2: ['0.33']", "kvtool/m.py:6: ['5.25.0']"]


# --- reading a new release touches data and excerpts only: a dry run on a made-up vLLM 0.34.0 -----------------
NEW = "0.34.0"


def _new_release_tree(root: Path) -> Path:
    """The engine tables as a maintainer leaves them after reading vLLM NEW: only data files change."""
    for name in (*et.TABLES, *et.DERIVED):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)

    def edit(name, fn):
        p = root / name
        data = json.loads(p.read_text(encoding="utf-8"))
        fn(data)
        p.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    old = et.newest_read("vllm")

    def releases(d):
        d["known"]["vllm"].append(NEW)  # published
        d["read"]["vllm"] = NEW  # and its source read

    def reread(d):  # the table re-read at NEW: same rows, each citation now of NEW's source
        d["release"] = NEW
        for row in (d["dtypes"] if "dtypes" in d else d["emulations"].values()):
            if row.get("citation", {}).get("release") == old:
                row["citation"]["release"] = NEW

    def mla(d):  # the MLA backends NEW serves: the newest rows' ranges reach it
        for row in (*d["common"], *d["backends"]):
            if row["releases"].endswith(f"<={old}"):
                row["releases"] = row["releases"][: -len(old)] + NEW

    edit("schemas/engines/releases.json", releases)
    edit("kvtool/model/kv_dtypes.json", reread)
    edit("kvtool/model/kv_emulations.json", reread)
    edit("schemas/engines/mla_backends.json", mla)
    return root


def _kvtool(args, root=None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(et.ENV, None)
    if root is not None:
        env[et.ENV] = str(root)
    r = subprocess.run([sys.executable, "-m", "kvtool", *args], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=120)
    return r.returncode, r.stdout + r.stderr


def test_a_new_vllm_release_is_read_by_editing_data_only(tmp_path):
    root = _new_release_tree(tmp_path / "data")
    changed = sorted(str(p.relative_to(root)) for p in root.rglob("*.json")
                     if p.read_bytes() != (REPO / p.relative_to(root)).read_bytes())
    assert changed == ["kvtool/model/kv_dtypes.json", "kvtool/model/kv_emulations.json",
                       "schemas/engines/mla_backends.json", "schemas/engines/releases.json"]

    # the one place: every Python table that restates vLLM's code now cites NEW
    probe = ("from kvtool.model import engine_tables as et, kv_dtypes, kv_scale_names as k;"
             "from kvtool.eval import fp8_backends as f;"
             "from kvtool.model import kv_emulations as e;"
             "print(et.newest_read('vllm'), kv_dtypes.release(), k.REMAP_RELEASE, f.RELEASE, e.release(),"
             "f.BACKENDS[1].citations[0])")
    env = {**os.environ, "PYTHONPATH": str(REPO), et.ENV: str(root)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split()[:5] == [NEW] * 5 and out.rstrip().endswith(f"({NEW})")

    config = str(REPO / "tests" / "data" / "configs" / "llama-3.1-8b.json")
    # lint: a range checks the releases it holds, NEW among them
    for root_, versions in ((None, [et.newest_read("vllm")]), (root, [et.newest_read("vllm"), NEW])):
        rc, out = _kvtool(["lint", config, "--engine", "vllm>=0.33", "--format", "json"], root_)
        assert rc == 0, out
        engines = {e["engine"]: e for e in json.loads(out)["models"][0]["engines"]}
        assert engines["vllm"]["versions"] == versions

    # lint KV805 asks kv_dtypes.json about the release it checks: at NEW only once the table was read there
    modelopt = tmp_path / "modelopt.json"
    cfg = json.loads(Path(config).read_text())
    modelopt.write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "modelopt",
                                                                  "kv_cache_quant_algo": "INT8"}}))
    codes = {}
    for label, root_ in (("before", None), ("after", root)):
        rc, out = _kvtool(["lint", str(modelopt), "--engine", f"vllm=={NEW}", "--format", "json"], root_)
        codes[label] = {f["code"] for f in json.loads(out)["models"][0]["findings"]}
    assert "KV805" not in codes["before"] and "KV805" in codes["after"], codes

    # kv-budget at NEW: no longer "not read", the FP8 cache sized by the table read at NEW
    notes = {}
    for label, root_ in (("before", None), ("after", root)):
        rc, out = _kvtool(["kv-budget", config, "--engine", f"vllm=={NEW}", "--kv-cache-dtype", "fp8",
                           "--format", "json"], root_)
        assert rc == 0, out
        notes[label] = " ".join(json.loads(out)["notes"])
    assert f"vLLM {NEW} is not a release kvtool has read" in notes["before"]
    assert f"vLLM {NEW} was not read for it" in notes["before"]
    assert "not a release kvtool has read" not in notes["after"] and "was not read for it" not in notes["after"]

    # the MLA rows NEW serves (lint KV404, convert --to mla, kv-budget): read from mla_backends.json's ranges
    probe = "from kvtool.engines import mla; r = mla.rows('%s'); print(r and r.head_sizes)" % NEW
    served = {}
    for label, root_ in (("before", None), ("after", root)):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop(et.ENV, None)
        env.update({et.ENV: str(root_)} if root_ else {})
        served[label] = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                                       check=True).stdout.strip()
    assert served["before"] == "None" and served["after"] == "(320, 512, 576)", served
