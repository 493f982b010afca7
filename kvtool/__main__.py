from kvtool.cli import _entry

_entry()
