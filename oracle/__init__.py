"""The content oracle: what every block holds on every DCP rank, checked on every read of a step
plan. It judges ``kvproof.impl``, so it imports only ``kvproof.spec`` (never the code it checks,
never torch). See oracle/README.md.
"""
