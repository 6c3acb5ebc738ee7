"""kvproof: a formally specified KV-cache block manager for hybrid models under DCP.

The subpackages map the repository's top-level folders (setup.py derives the map):
``kvproof.spec`` (spec/), ``kvproof.impl`` (impl/), ``kvproof.sim`` (sim/), ``kvproof.oracle`` (oracle/), ``kvproof.kernels`` (kernels/),
``kvproof.proofs`` (proofs/), ``kvproof.cli`` (cli/) and the others beside them.
"""

__version__ = "0.1.0"
