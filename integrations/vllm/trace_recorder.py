"""``KVPROOF_RECORD=FILE``: the live traffic of a ``vllm serve`` as a Mooncake-format trace, for
``kvproof plan --trace FILE`` (docs/vllm.md, "Recording your traffic").

One JSON line per finished request, written when it finishes (``Scheduler._free_request``:
its output length is known only then), so lines are in finish order; the planner sorts by
timestamp (``sim.workload.read_workload``)::

    {"timestamp": 1532, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 7]}

* ``timestamp``: the request's arrival (vLLM's ``arrival_time``, stamped by the API server) in
  ms after the first request this engine was given;
* ``hash_ids``: the prompt in Mooncake's blocks of ``MOONCAKE_BLOCK`` (512) tokens, the last one
  partial. Each block's digest is a keyed BLAKE2b over the previous block's digest and this
  block's token ids (and what vLLM's own block hashes separate: the cache salt and LoRA adapter
  in the first, multimodal identifiers in the blocks their placeholders overlap), so equal ids
  mean an equal prefix up to and including that block; each new digest gets the next small
  int, except that a block extending an earlier prompt's partial last block takes its id
  (:class:`BlockIds`). The key is random per process and the digests never leave it: the file
  holds lengths, times and small ints, no token id and nothing a token id can be recovered from.

A line is one ``os.write`` on an ``O_APPEND`` descriptor (nothing buffered in the process), so
a killed server leaves whole lines; a short write (a full disk) is cut back and stops the
recording with one warning, and serving goes on. The recorder changes no vLLM state.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from array import array
from typing import Iterable, Optional, Sequence

from kvproof.integrations.vllm.violations import logger
from kvproof.sim.mooncake import MOONCAKE_BLOCK

ENV = "KVPROOF_RECORD"

_DIGEST = 16


def recording_path(value: Optional[str] = None) -> Optional[str]:
    """The file ``KVPROOF_RECORD`` names (``value`` overrides the environment), or None when
    unset or empty."""
    raw = os.environ.get(ENV, "") if value is None else value
    return raw.strip() or None


def check_path(path: str, first: bool) -> None:
    """Refuse, naming the value, a path the recording cannot be appended to. ``first``: this is
    the first process of the server, which creates the file and refuses one that already holds
    data (an earlier recording is never appended to: its timestamps would restart at 0).
    Raises ValueError; creates the file (empty) when ``first`` and it is absent."""
    def refuse(reason: str) -> ValueError:
        return ValueError(f"{ENV}={path!r}: {reason}; expected the path of a new or empty file in a writable folder")

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise refuse("is a folder")
    if not os.path.isdir(folder):
        raise refuse(f"folder {folder!r} does not exist")
    if first and os.path.exists(path) and os.path.getsize(path) > 0:
        size = os.path.getsize(path)
        raise refuse(f"already holds {size:,} bytes (an earlier recording?); move it or name a new file")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise refuse(f"cannot be opened for appending ({e.strerror})") from None
    os.close(fd)


def _frame(data: bytes) -> bytes:
    """Length-prefixed, so that no two sequences of fields hash the same bytes."""
    return len(data).to_bytes(8, "little") + data


class BlockIds:
    """Chained keyed digests of 512-token blocks, named by small ints in first-seen order.

    Mooncake's partial last block is a prefix of its id's 512 tokens (``sim.mooncake``), so a
    prompt's tail can share its id with the full block of a later, longer prompt that extends
    it (the next turn of a chat): a new block takes the id of the longest pending partial block
    after the same prefix whose tokens begin it -- a full block fixes the id's content, a longer
    partial one extends what is known of it. An id thus stands for one 512-token content (every
    partial use a prefix of it) and no two contents share one."""

    def __init__(self, key: Optional[bytes] = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)
        self._ids: dict[bytes, int] = {}
        self._next = 0
        #: Per prefix digest, the partial blocks after it no full block has claimed yet:
        #: (length, digest, id). Digests only: no token is kept.
        self._pending: dict[bytes, list[tuple[int, bytes, int]]] = {}

    def __len__(self) -> int:
        return self._next

    def _digest(self, chain: bytes, block: Sequence[int], extra: bytes) -> bytes:
        h = hashlib.blake2b(chain, key=self._key, digest_size=_DIGEST)
        h.update(_frame(array("q", block).tobytes()))
        h.update(_frame(extra))
        return h.digest()

    def _claim(self, chain: bytes, block: Sequence[int], digest: bytes) -> Optional[int]:
        """The id of the longest pending partial block after ``chain`` that ``block`` (digest
        ``digest``) extends, or None. A full block fixes that id; a longer partial one becomes
        the id's pending content in its place."""
        pending = self._pending.get(chain)
        for entry in sorted(pending or (), reverse=True):
            length, known, hash_id = entry
            if length < len(block) and self._digest(chain, block[:length], b"") == known:
                pending.remove(entry)
                if len(block) < MOONCAKE_BLOCK:
                    pending.append((len(block), digest, hash_id))
                return hash_id
        return None

    def hash_ids(self, tokens: Sequence[int], seed: bytes = b"",
                 extras: Optional[Sequence[bytes]] = None) -> list[int]:
        """One id per block of ``tokens`` (the last block partial). ``seed`` separates whole
        prompts (cache salt, adapter); ``extras[i]`` is mixed into block ``i`` (multimodal
        identifiers; such blocks never take or give an earlier id). Mutates the id table."""
        chain = hashlib.blake2b(_frame(seed), key=self._key, digest_size=_DIGEST).digest()
        out = []
        for i, start in enumerate(range(0, len(tokens), MOONCAKE_BLOCK)):
            block = tokens[start:start + MOONCAKE_BLOCK]
            extra = extras[i] if extras is not None else b""
            digest = self._digest(chain, block, extra)
            hash_id = self._ids.get(digest)
            if hash_id is None:
                hash_id = None if extra else self._claim(chain, block, digest)
                if hash_id is None:
                    hash_id, self._next = self._next, self._next + 1
                    if len(block) < MOONCAKE_BLOCK and not extra:
                        self._pending.setdefault(chain, []).append((len(block), digest, hash_id))
                self._ids[digest] = hash_id
            out.append(hash_id)
            chain = digest
        return out


def request_seed(cache_salt: Optional[str], lora: Optional[tuple[str, str]]) -> bytes:
    """What separates equal token ids vLLM would not share: the salt, the adapter (name, path)."""
    parts = [cache_salt or "", *(lora or ("", ""))]
    return b"".join(_frame(p.encode("utf-8", "surrogatepass")) for p in parts)


def block_extras(num_tokens: int, features: Iterable[tuple[str, int, int]]) -> Optional[list[bytes]]:
    """Per block, the identifiers of the multimodal inputs ``(identifier, offset, length)``
    whose placeholder overlaps it; None without any."""
    features = list(features)
    if not features:
        return None
    blocks = -(-num_tokens // MOONCAKE_BLOCK)
    extras = [b""] * blocks
    for identifier, offset, length in features:
        first, last = offset // MOONCAKE_BLOCK, (offset + max(length, 1) - 1) // MOONCAKE_BLOCK
        for b in range(first, min(last, blocks - 1) + 1):
            extras[b] += _frame(identifier.encode("utf-8", "surrogatepass"))
    return extras


class TraceRecorder:
    """The recording of one engine (see the module docstring). ``key`` None: a random one."""

    def __init__(self, path: str, key: Optional[bytes] = None) -> None:
        self.path = path
        self._ids = BlockIds(key)
        self._origin: Optional[float] = None
        self._fd: Optional[int] = None
        self.stopped: Optional[str] = None  # why recording stopped (a failed write), or None
        self.written = 0
        self.skipped = 0  # requests without token ids (prompt embeddings)

    def arrived(self, arrival_time: float) -> None:
        """A request reached the engine; the first one is time 0."""
        if self._origin is None:
            self._origin = arrival_time

    def line(self, arrival_time: float, prompt: Sequence[int], output_length: int, seed: bytes = b"",
             extras: Optional[Sequence[bytes]] = None) -> str:
        """The JSON line of one finished request (no newline). Assigns its blocks' ids."""
        self.arrived(arrival_time)
        timestamp = max(0, round((arrival_time - self._origin) * 1000))  # an API server may stamp out of order
        return json.dumps({"timestamp": timestamp, "input_length": len(prompt), "output_length": output_length,
                           "hash_ids": self._ids.hash_ids(prompt, seed, extras)}, separators=(", ", ": "))

    def finished(self, request) -> None:
        """Record a vLLM ``Request`` that finished (reads it only)."""
        if self.stopped is not None:
            return
        prompt = request.prompt_token_ids
        if prompt is None or getattr(request, "prompt_embeds", None) is not None or not prompt:
            self.skipped += 1  # no token content to key blocks by
            return
        lora = request.lora_request
        seed = request_seed(request.cache_salt, (lora.lora_name, str(lora.lora_path)) if lora else None)
        extras = block_extras(len(prompt), ((f.identifier, f.mm_position.offset, f.mm_position.length)
                                            for f in request.mm_features or ()))
        self.write(self.line(request.arrival_time, prompt, request.num_output_tokens, seed, extras))

    def write(self, text: str) -> None:
        """Append ``text`` and a newline as one write; on failure, leave whole lines and stop."""
        if self.stopped is not None:
            return
        data = (text + "\n").encode()
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(self._fd).st_size
            done = os.write(self._fd, data)
            if done != len(data):
                os.ftruncate(self._fd, size)
                raise OSError(f"wrote {done} of {len(data)} bytes")
        except OSError as e:
            self.stopped = f"{ENV}={self.path!r}: recording stopped after {self.written:,} requests: {e}"
            logger.warning("kvproof: %s; serving goes on", self.stopped)
            return
        self.written += 1
