"""kvtool: make LLM checkpoints safe and cheap to serve."""

import sys as _sys


def _leave_working_folder() -> None:
    """As a command (`python -m kvtool`, the `kvtool` script), the working folder never joins the import path: a
    model folder that ships `transformers/`, `typer/` or even `json.py` would otherwise be imported in their
    place, and run, when kvtool is started inside it. `python -m` puts the working folder first on sys.path
    (unless -P / -I / PYTHONSAFEPATH); an empty or relative entry (PYTHONPATH=":..." or ".") follows the working
    folder too, and any entry naming the working folder goes (site.py has made '' absolute by now). kvtool's own modules are found through its package path, not sys.path, so nothing of kvtool
    is lost. Runs before any other import of the package (this is its first statement); docs/safety.md."""
    import os  # loaded by the interpreter before any user code: never shadowed

    if _sys.argv[:1] == ["-m"] and not getattr(_sys.flags, "safe_path", False) and _sys.path:  # -P: 3.11+
        del _sys.path[0]  # the working folder `-m` inserted (argv[0] is "-m" while the package is being found)
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # the working folder was removed: nothing can be imported from it either
        here = None
    # site.py has made '' absolute (the working folder) by now; a relative entry is kept relative
    _sys.path[:] = [p for p in _sys.path if isinstance(p, str) and os.path.isabs(p)
                    and (here is None or os.path.realpath(p) != here)]


# a command line is `python -m kvtool` (argv[0] "-m" while this package loads) or the `kvtool` console script;
# a library import (`import kvtool` in a user's program) leaves that program's sys.path alone
if _sys.argv[:1] == ["-m"] or _sys.argv[:1] and _sys.argv[0].rsplit("/", 1)[-1] == "kvtool":
    _leave_working_folder()

__version__ = "0.1.0"
