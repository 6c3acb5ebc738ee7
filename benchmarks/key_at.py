"""Cost of ``impl.hashing.key_at`` (the one cache-key function, with its INV-HASH-BOUNDARY check)
against building the key tuple by hand, in CPU time per call (best of ``--repeat`` runs of
``--calls`` calls; the cost of an empty call is subtracted from both).

    python benchmarks/key_at.py
"""

from __future__ import annotations

import argparse
import sys
import time

from kvproof.impl.hashing import key_at


def per_call(fn, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, time.process_time() - start)
    return best / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    hashes = [bytes(32)] * 100
    empty = per_call(lambda: None, args.calls, args.repeat)
    checked = per_call(lambda: key_at(hashes, 512, 16, 1), args.calls, args.repeat) - empty
    bare = per_call(lambda: (hashes[512 // 16 - 1], 1), args.calls, args.repeat) - empty
    print(f"key_at {checked * 1e9:.0f} ns, by hand {bare * 1e9:.0f} ns, check {1e9 * (checked - bare):.0f} ns per key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
