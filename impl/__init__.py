"""The scheduler-side implementation: block hashing and the block pool (managers, the hybrid
coordinator and the KV-cache-manager facade build on them).

Checked against the executable spec in ``kvproof.spec``; may import ``kvproof.spec`` and the
standard library (plus icontract and xxhash), never torch. See impl/README.md.
"""
