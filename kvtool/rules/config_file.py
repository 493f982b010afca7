"""`[tool.kvtool]` in the nearest pyproject.toml: defaults for `kvtool lint`, like ruff's `[tool.ruff]`.

    [tool.kvtool]
    select = ["KV"]                  # codes or prefixes
    ignore = ["KV703"]
    strict = false                   # warnings fail too
    tensor-parallel-size = 8
    format = "text"                  # text | json | sarif | github
    engines = ["transformers==4.44.2", "vllm>=0.6,<0.9"]   # releases to check (default: the installed ones)

    [tool.kvtool.per-file-ignores]
    "models/legacy/*" = ["KV2"]      # glob on the model path given to lint, or on a finding's file

Command-line options override these. Unknown keys are an error (exit 2), so a typo never silently
turns a check off. Keys may be written kebab-case or snake_case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

from kvtool.errors import UsageError
from kvtool.io.inputfile import TOML_LIMIT, read_text

_KEYS = {"select", "ignore", "strict", "tensor-parallel-size", "format", "per-file-ignores", "engines"}


@dataclass
class LintSettings:
    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    strict: bool | None = None
    tensor_parallel_size: int | None = None
    format: str | None = None
    per_file_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    engines: tuple[str, ...] | None = None  # engine requirements (kvtool.engines.releases.resolve reads them)
    source: Path | None = None  # the pyproject.toml these came from

    def ignored_for(self, *paths: str | None) -> tuple[str, ...]:
        """Codes / prefixes per-file-ignores switch off for a model path or a finding's file."""
        return ignored_codes(self.per_file_ignores, *paths)


def ignored_codes(per_file_ignores: dict[str, tuple[str, ...]], *paths: str | None) -> tuple[str, ...]:
    """Codes / prefixes a per-file-ignores table switches off for any of `paths` (a model path, a finding's file)."""
    out: list[str] = []
    for pattern, codes in per_file_ignores.items():
        if any(p and _matches(p, pattern) for p in paths):
            out += codes
    return tuple(out)


def _matches(path: str, pattern: str) -> bool:
    posix = str(PurePosixPath(Path(path).as_posix()))  # PurePosixPath drops a leading "./"
    pat = pattern.rstrip("/")
    return fnmatch(posix, pat) or fnmatch(posix, pat + "/*") or posix.startswith(pat + "/")


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml from `start` (default: the working directory) upward."""
    try:
        here = (start or Path.cwd()).resolve()
    except FileNotFoundError:  # the working folder was removed under the shell: it holds no pyproject.toml
        return None
    for folder in (here, *here.parents):
        cand = folder / "pyproject.toml"
        if cand.is_file():
            return cand
    return None


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise UsageError("reading [tool.kvtool] needs Python 3.11+ or `pip install tomli`", file=str(path)) from None
    text = read_text(path, what="pyproject.toml", limit=TOML_LIMIT)  # InputError (exit 2) if unreadable
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"invalid TOML: {exc}", file=str(path)) from None
    except RecursionError:  # tomllib parses nested arrays / inline tables recursively
        raise UsageError("invalid TOML: arrays or inline tables nested too deeply", file=str(path)) from None


def _codes(value, path: Path, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise UsageError("must be a list of rule codes or prefixes", file=str(path), field=f"tool.kvtool.{key}")
    return tuple(v.strip().upper() for v in value)


def load_settings(path: Path | None, *, formats: tuple[str, ...] | None = None) -> LintSettings:
    """Settings from a pyproject.toml (an empty LintSettings when it has no [tool.kvtool]). `formats`: the output
    formats `format` must be one of (given by the caller that renders, so the engine imports no renderer)."""
    if path is None:
        return LintSettings()
    tool = _load_toml(path).get("tool", {})
    if not isinstance(tool, dict):  # `tool = 1`: another tool's section cannot be read, nor kvtool's
        raise UsageError("must be a table", file=str(path), field="tool")
    table = tool.get("kvtool")
    if table is None:
        return LintSettings(source=path)
    if not isinstance(table, dict):
        raise UsageError("must be a table", file=str(path), field="tool.kvtool")
    norm = {k.replace("_", "-"): v for k, v in table.items()}
    if len(norm) != len(table):
        twice = sorted(k for k in norm if sum(1 for t in table if t.replace("_", "-") == k) > 1)
        raise UsageError(f"{twice[0]} is given twice (as kebab-case and snake_case)", file=str(path),
                         field=f"tool.kvtool.{twice[0]}")
    unknown = sorted(set(norm) - _KEYS)
    if unknown:
        raise UsageError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}",
                         file=str(path), field="tool.kvtool")
    s = LintSettings(source=path)
    if "select" in norm:
        s.select = _codes(norm["select"], path, "select")
    if "ignore" in norm:
        s.ignore = _codes(norm["ignore"], path, "ignore")
    if "strict" in norm:
        if not isinstance(norm["strict"], bool):
            raise UsageError("must be true or false", file=str(path), field="tool.kvtool.strict")
        s.strict = norm["strict"]
    if "tensor-parallel-size" in norm:
        tp = norm["tensor-parallel-size"]
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise UsageError("must be a positive integer", file=str(path), field="tool.kvtool.tensor-parallel-size")
        s.tensor_parallel_size = tp
    if "format" in norm:
        if formats is not None and norm["format"] not in formats:
            raise UsageError(f"must be one of {', '.join(formats)}", file=str(path), field="tool.kvtool.format")
        s.format = norm["format"]
    if "engines" in norm:
        e = norm["engines"]
        if not isinstance(e, list) or not all(isinstance(v, str) and v.strip() for v in e):
            raise UsageError("must be a list of engine requirements, e.g. [\"transformers==4.44.2\"]", file=str(path),
                             field="tool.kvtool.engines")
        s.engines = tuple(e)
    if "per-file-ignores" in norm:
        pfi = norm["per-file-ignores"]
        if not isinstance(pfi, dict):
            raise UsageError("must be a table of glob = [codes]", file=str(path), field="tool.kvtool.per-file-ignores")
        s.per_file_ignores = {str(k): _codes(v, path, f"per-file-ignores.{k}") for k, v in pfi.items()}
    return s
