"""kvtool.quantize.observer_specs: the `--observer` check is torch-free and names the classes that compute."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_spec_checks_never_import_torch():
    code = ("import sys\nfrom kvtool.errors import UsageError\n"
            "from kvtool.quantize.observer_specs import OBSERVERS, canonical, parse_spec\n"
            "assert canonical('absmax') == 'absmax:1' and canonical('percentile:99.9') == 'percentile:99.9'\n"
            "for spec in ('percentile:200', 'percentile', 'mse:3', 'absmax:x', 'nope'):\n"
            "    try:\n        parse_spec(spec)\n    except UsageError:\n        pass\n"
            "    else:\n        raise AssertionError(spec)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_every_entry_names_a_class_of_its_name():
    pytest.importorskip("torch")
    from kvtool.quantize.observers import OBSERVERS, Observer

    for name, entry in OBSERVERS.items():
        assert issubclass(entry.cls, Observer) and entry.cls.name == name


def test_the_options_default_is_the_registrys():
    from kvtool.options.quantize_kv import DEFAULT_OBSERVER as OPTIONS_DEFAULT
    from kvtool.quantize.observer_specs import DEFAULT_OBSERVER, parse_spec

    assert OPTIONS_DEFAULT == DEFAULT_OBSERVER
    parse_spec(DEFAULT_OBSERVER)
