"""The islands benchmark suite (distribution islands-bench), outside the installed library.

Experiments: one per registry claim, each writing JSON, a plot and a markdown summary (`islands bench NAME`,
the command this package adds to islands' CLI through the islands.commands entry point). It drives islands
through its public API only: top-level names, the subpackages' `__all__`, islands.config and islands.app
(bench/tests/test_public_only.py keeps it so).
"""
