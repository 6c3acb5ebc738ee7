"""The executable specification of kvproof.

Pure Python on ints, tuples and frozen dataclasses; imports nothing of ours except within
``kvproof.spec`` and nothing heavier than icontract. Every rule is an icontract contract whose
description starts with its invariant id (see docs/spec.md).
"""
