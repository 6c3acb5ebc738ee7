"""vLLM 0.33.0's KV-cache events from kvproof's key log (``impl/key_log.py``): what
``KvproofKVCacheManager.take_events`` hands the Scheduler, which publishes them
(``--kv-events-config``) at the end of ``update_from_output``.

One event per change, as vLLM's block pool emits them (docs/vllm.md, "KV-cache events"):

* a key attached to a block: ``BlockStored``, the key's hash (vLLM's ``request.block_hashes``
  entry at the prefix length it names) with the tokens it covers since the previous key
  boundary of its group (``block_size``), the hash there as ``parent_block_hash`` (None at 0),
  the request's LoRA, session and extra keys; consecutive keys of one keying call and group
  share one event, as vLLM batches a ``cache_full_blocks`` call;
* a key a block loses (evicted on reuse, retired by a longer key, dropped for a failed load):
  ``BlockRemoved`` with its hash and group;
* a successful ``reset_prefix_cache``: ``AllBlocksCleared``.

The covered span is the group's block (effective: times DCP for a sharded group) for a key at a
block end, one hash unit H for a key inside a block (vLLM's partial entries) and for every key
of an attention group keyed at every hash boundary (kvproof's default: the chain is one hash
unit a link, so each hash has one parent).
"""

from __future__ import annotations

from typing import Optional

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvproof.impl.key_log import CLEARED, REMOVED, STORED, KeyLog
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout

_ATTENTION = (GroupKind.FULL_ATTENTION, GroupKind.MLA)


class CacheEvents:
    """Turns the pool's key log into vLLM event objects; ``take`` drains them."""

    def __init__(self, layout: Layout, specs, log: KeyLog) -> None:
        self.log = log
        self._h = layout.hash_block_size
        every = layout.config.attention_keys == "every-hash"
        a = layout.cache_hit_alignment
        #: Per group: the span of a key at a block end (H where the group keys every hash unit:
        #: attention under ``every-hash`` when hits may end inside its blocks).
        self._block_span = tuple(
            self._h if every and g.group.kind in _ATTENTION and a < g.effective_block_size else g.effective_block_size
            for g in layout.groups)
        self._block = tuple(g.effective_block_size for g in layout.groups)
        self._meta = tuple((get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs)
        self._events: list = []

    def flush(self, request=None) -> None:
        """Mutates. Turn the log's records into events; ``request`` is the one whose keying
        attached the keys (every ``STORED`` record needs one: INV-EVENTS-REQUEST)."""
        records = self.log.take()
        if not records:
            return
        events, h = self._events, self._h
        started: list[BlockStored] = []
        run: Optional[BlockStored] = None  # the event consecutive keys extend
        end = 0  # the prefix length its last hash names
        mm = 0  # the multimodal item index reached within the run
        for kind, key, num_tokens in records:
            if kind == STORED:
                if request is None:
                    raise InvariantViolation("INV-EVENTS-REQUEST",
                                             f"key at {num_tokens} tokens (group {key[1]}) attached outside a request's keying")
                block_hash, group = key
                span = self._block_span[group] if num_tokens % self._block[group] == 0 else h
                start = num_tokens - span
                if run is None or run.group_idx != group or run.block_size != span or start != end:
                    mm = 0
                    parent = None if start == 0 else maybe_convert_block_hash(request.block_hashes[start // h - 1])
                    run = self._stored(request, group, span, parent)
                    events.append(run)
                    started.append(run)
                mm = self._extend(run, request, block_hash, start, mm)
                end = num_tokens
                continue
            run = None
            if kind == REMOVED:
                events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(key[0])], medium=MEDIUM_GPU,
                                           group_idx=key[1]))
            elif kind == CLEARED:
                events.append(AllBlocksCleared())
        for event in started:  # the per-block keys as vLLM publishes them (untagged)
            event.extra_keys = to_event_extra_keys(event.extra_keys)

    def reused(self, request, num_tokens: int) -> None:
        """Mutates. vLLM's ``kv_cache_report_mode="full"`` (a request's ``extra_args``): one
        ``BlockStored`` per group for the ``num_tokens``-token prefix a lookup hit, from token 0
        (no parent), at the group's span: a report of what is cached, not a change to it (as
        vLLM's, it repeats hashes stored before)."""
        self.flush()
        h = self._h
        for group, span in enumerate(self._block_span):
            if num_tokens >= span:
                event, mm = self._stored(request, group, span, None), 0
                for n in range(span, num_tokens - num_tokens % span + 1, span):
                    mm = self._extend(event, request, request.block_hashes[n // h - 1], n - span, mm)
                event.extra_keys = to_event_extra_keys(event.extra_keys)
                self._events.append(event)

    def _stored(self, request, group: int, span: int, parent) -> BlockStored:
        """An empty ``BlockStored`` for ``request``'s blocks of ``span`` tokens in ``group``."""
        lora = request.lora_request
        return BlockStored(
            block_hashes=[], parent_block_hash=parent, token_ids=[], block_size=span,
            lora_id=lora.adapter_id if lora else None, medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None, extra_keys=[], group_idx=group,
            kv_cache_spec_kind=self._meta[group][0], kv_cache_spec_sliding_window=self._meta[group][1],
            session_id=request.session_id,
        )

    @staticmethod
    def _extend(event: BlockStored, request, block_hash: bytes, start: int, mm: int) -> int:
        """Mutates ``event``. Append the block ``[start, start + block_size)`` named by
        ``block_hash``; returns the multimodal index reached (``generate_block_hash_extra_keys``)."""
        end = start + event.block_size
        event.block_hashes.append(maybe_convert_block_hash(block_hash))
        event.token_ids.extend(request.all_token_ids[start:end])
        extra, mm = generate_block_hash_extra_keys(request, start, end, mm)
        event.extra_keys.append(extra)
        return mm

    def take(self) -> list:
        """Mutates. The events since the last call, oldest first (what is still in the log
        holds no ``STORED`` record: the adapter flushes after each keying)."""
        self.flush()
        events, self._events = self._events, []
        return events
