import sys

try:
    from kvtool.cli import _entry
except KeyboardInterrupt:  # Ctrl-C while the command modules load: nothing was started
    print("kvtool: interrupted: nothing was written", file=sys.stderr)
    sys.exit(130)

_entry()
