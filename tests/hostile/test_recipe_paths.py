"""A recipe names files (eval and calibration texts, longrope factor files) relative to its folder: a recipe
from a pull request must not make kvtool read a file of the machine's (/proc/self/environ, ~/.ssh/..., a
secret beside the checkout) and calibrate on it or hash it into kvtool.json. Generated over the ways a path
leaves the folder x the recipe keys that name files x `kvtool apply --dry-run`, `kvtool apply` and
`kvtool lint RECIPE`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"
SECRET = "the machine's secret\n" * 50


def _escapes(ws: Path) -> dict[str, str]:
    """Each way a recipe path can leave the recipe's folder (ws/r), as the recipe writes it."""
    secret = ws / "secret.txt"
    secret.write_text(SECRET)
    (ws / "r").mkdir(exist_ok=True)
    (ws / "r" / "inside-link.txt").symlink_to(secret)
    (ws / "r" / "sub").mkdir(exist_ok=True)
    (ws / "r" / "sub" / "up").symlink_to(ws)  # a folder link whose target lies above the recipe's folder
    return {"parent": "../secret.txt", "absolute": str(secret), "home": "~/secret.txt", "proc": "/proc/self/environ",
            "link": "inside-link.txt", "folder-link": "sub/up/secret.txt", "deep-parent": "sub/../../secret.txt"}


_KEYS = {
    "eval-text": "  - eval: {{text: '{p}', max_tokens: 16, thresholds: {{max_kld: 0.5}}}}\n",
    "calibration-list": "  - quantize-kv: {{calibration: {{text: [ok.txt, '{p}'], tokens: 64}}}}\n",
    "rope-factor-file": "  - rope: {{type: longrope, factor: 2, short_factor_file: '{p}', long_factor_file: ok.json}}\n",
}


@pytest.mark.parametrize("key", sorted(_KEYS))
@pytest.mark.parametrize("escape", ["parent", "absolute", "home", "proc", "link", "folder-link", "deep-parent"])
def test_a_recipe_path_outside_its_folder_is_refused_unread(tmp_path, key, escape) -> None:
    p = _escapes(tmp_path)[escape]
    folder = tmp_path / "r"
    (folder / "ok.txt").write_text("a calibration text inside the folder\n" * 20)
    (folder / "ok.json").write_text("[1.0, 1.0, 1.0, 1.0]")
    recipe = folder / "recipe.yaml"
    recipe.write_text("version: 1\nname: r\nsteps:\n" + _KEYS[key].format(p=p))
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    env = {"HOME": str(tmp_path)}  # `~` would name tmp_path/secret.txt if it were expanded
    for dry in (["--dry-run"], []):
        out = tmp_path / "out"
        check_refusal(["apply", recipe, m, out, *dry], sources=[m, folder], dst=out, env=env,
                      names=[str(recipe), repr(p), "recipe's folder"])
    r = run_kvtool(["lint", recipe], env=env)
    assert r.rc == 1 and "KV962" in r.stdout and "recipe's folder" in r.stdout, r.stdout + r.stderr
    assert "secret" not in r.stdout.replace("secret.txt", ""), r.stdout  # named, never read


def test_a_path_inside_the_folder_through_a_link_inside_it_is_read(tmp_path) -> None:
    """The rule is where the file lies, not how it is spelt: a link to a file inside the folder is fine."""
    folder = tmp_path / "r"
    (folder / "texts").mkdir(parents=True)
    (folder / "texts" / "eval.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    os.symlink("texts/eval.txt", folder / "eval.txt")
    recipe = folder / "recipe.yaml"
    recipe.write_text("version: 1\nname: r\nsteps:\n  - eval: {text: sub/../eval.txt, max_tokens: 16}\n")
    (folder / "sub").mkdir()
    r = run_kvtool(["lint", recipe])
    assert r.rc == 0 and "KV962" not in r.stdout, r.stdout + r.stderr
