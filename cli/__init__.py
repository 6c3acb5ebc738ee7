"""The ``kvproof`` command line: one entry point, one module per subcommand.

Conventions (cli/README.md): a readable table by default, ``--json`` for machines; exit 0 ok,
1 a checked property failed, 2 bad input (one line on stderr, never a traceback). Commands
that need torch import it inside their ``run``.
"""
