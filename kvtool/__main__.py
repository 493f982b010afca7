import sys

try:
    from kvtool.cli import _entry
except KeyboardInterrupt:  # Ctrl-C while the command modules load: nothing was started
    from kvtool import console

    console.out("kvtool: interrupted: nothing was written", err=True)
    sys.exit(130)

_entry()
