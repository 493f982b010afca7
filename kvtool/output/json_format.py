"""`--format json`: one stable object, sorted keys."""

from __future__ import annotations

import json


def render_json(reports) -> str:
    return json.dumps({"models": [r.as_dict() for r in reports]}, indent=2, sort_keys=True) + "\n"
