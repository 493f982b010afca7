"""`python -m kvtool.options [--write | --check]`: regenerate (or check) the recipe schema and the docs tables."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from kvtool import console
    from kvtool.options import docs, schema

    ap = argparse.ArgumentParser(prog="python -m kvtool.options", description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite schemas/recipe.schema.json and the docs tables")
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale (the default)")
    args = ap.parse_args(argv)
    path = schema.schema_path()
    committed = json.loads(path.read_text(encoding="utf-8"))
    files = {path: schema.dumps(schema.recipe_schema(committed)) + "\n", **docs.expected()}
    stale = [p for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    gone = docs.obsolete()
    if args.write:
        for p in stale:
            p.write_text(files[p], encoding="utf-8")
            console.out(f"wrote {p}")
        for p in gone:
            p.unlink()
            console.out(f"removed {p} (every command's page holds its table)")
        return 0
    for p in stale + gone:
        console.out(f"stale: {p} (run python -m kvtool.options --write)", err=True)
    return 1 if stale or gone else 0


if __name__ == "__main__":
    sys.exit(main())
