"""What this machine can hold: a size flag whose run would need more memory than is available is
refused up front, naming the flag, the estimate and the largest value that fits (docs/replay.md,
"Limits"). The estimates are the commands' own (bytes per block, per rank); this module only
compares them with the memory available now."""

from __future__ import annotations

from typing import Optional

#: The block pool and its bookkeeping in ``kvproof replay`` (``BlockPool`` + managers + content
#: oracle), per block at its peak: 105 bytes measured, 199 with the slow tier's whole-pool
#: check (``ICONTRACT_SLOW=1``; docs/replay.md, "Limits"); rounded up.
#: ``tests/cli/test_limits.py`` keeps it an upper bound.
REPLAY_BYTES_PER_BLOCK = 240


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> Optional[int]:
    """Bytes this process could still allocate: the kernel's MemAvailable, capped by the
    cgroup's memory limit (containers). None where neither can be read (not Linux)."""
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            candidates.append(max(limit - usage, 0))
    return min(candidates) if candidates else None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(flag: str, value: int, bytes_per_unit: int, fixed_bytes: int, what: str,
                 available: Optional[int] = None) -> None:
    """Raise ValueError if ``fixed_bytes + value * bytes_per_unit`` exceeds the memory available
    (``available``, default: :func:`available_memory`; no check when it is unknown)."""
    available = available_memory() if available is None else available
    need = fixed_bytes + value * bytes_per_unit
    if available is None or need <= available:
        return
    most = max((available - fixed_bytes) // bytes_per_unit, 0)
    raise ValueError(
        f"{flag} {value:,} needs about {_gb(need)} ({what}), but this machine has {_gb(available)} available; "
        f"expected {flag} <= {most:,}"
    )
