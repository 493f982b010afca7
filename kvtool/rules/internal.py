"""Internal errors (KV000): a checker crashed; always a kvtool bug."""

from kvtool.rules.registry import define

define("KV000", "internal-error", "error", "A lint check crashed (a kvtool bug; please report it)",
       """
       What it does: reports that one group of checks raised an unexpected exception. The other
       checks still ran.
       Why it matters: the model was not fully checked.
       Example: a config value of a type no check anticipated.
       Fix: report the message to the kvtool maintainers; meanwhile, --ignore KV000 to continue.
       """, topic="internal")
