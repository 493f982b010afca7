"""Recipe files (KV96x): `kvtool lint recipe.yaml` validates a recipe without running it (the check itself is
kvtool/recipes/lint.py: it needs the recipe loader, which sits above the lint engine)."""

from __future__ import annotations

from kvtool.rules.registry import define

define("KV961", "recipe-invalid", "error", "Recipe file does not match the recipe schema",
       """
       What it does: validates a recipe YAML against schemas/recipe.schema.json: a `version`, an
       ordered list of `steps`, each a mapping with exactly one of convert, rope, quantize-kv, lint,
       eval, and no unknown or duplicate keys anywhere.
       Why it matters: a typo such as `metod: aware` would otherwise silently fall back to a default
       and ship a different model than the one reviewed in the pull request.
       Example: steps: [{convert: {to: gqa, groups: 8, metod: aware}}]
       Fix: correct the key named in the message; `kvtool rule KV961` and docs/apply.md list the format.
       """, hint="fix the key named in the message (see the recipe format in docs/apply.md)", topic="recipe")

define("KV962", "recipe-missing-file", "error", "A text file named by a recipe does not exist",
       """
       What it does: checks that every calibration or evaluation `text` path in a recipe exists,
       resolved relative to the recipe file.
       Why it matters: the pipeline would fail after hours of conversion work, at the step that
       needs the file.
       Example: calibration: {text: data/calib.txt} with no recipes/data/calib.txt
       Fix: commit the file next to the recipe or correct the relative path.
       """, hint="paths are relative to the recipe file", topic="recipe")
