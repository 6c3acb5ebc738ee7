"""kvproof: a formally specified KV-cache block manager for hybrid models under DCP.

The subpackages map the repository's top-level folders:
``kvproof.spec`` (spec/), ``kvproof.impl`` (impl/), ``kvproof.kernels`` (kernels/),
``kvproof.proofs`` (proofs/) and ``kvproof.cli`` (cli/).
"""

__version__ = "0.1.0"
