"""Simulation tooling around the scheduler side: the trace formats (kvproof's JSON Lines and
Mooncake's), the workloads of ``kvproof plan`` and the replay driver that runs a trace through
``kvproof.impl``'s scheduler with the content oracle watching.

May import ``kvproof.spec``, ``kvproof.impl`` and ``kvproof.oracle``; never torch. See sim/README.md.
"""
