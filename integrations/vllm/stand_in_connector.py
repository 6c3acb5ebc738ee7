"""A stand-in KV connector, scheduler side only: vLLM's Scheduler drives it as any connector,
so kvproof's checks can be staged with externally computed tokens on a CPU (the engine
harness, ``EngineHarness(kv_transfer_config=...)``).

It plays a remote store that holds every prompt's KV: asked how many tokens it can load beyond
a request's local hit, it offers up to ``external_blocks`` blocks of ``block_size`` tokens
(``kv_connector_extra_config``), whole blocks only, short of the request's last token (which
the model must compute to sample), loaded synchronously or, with ``is_async``, between steps.
A request it once loaded for is offered nothing again (a resumed request reuses its hit). No KV
moves: the worker-side methods are never called on a scheduler.

    KVTransferConfig(kv_connector="StandInConnector", kv_role="kv_both",
                     kv_connector_module_path="kvproof.integrations.vllm.stand_in_connector",
                     kv_connector_extra_config={"external_blocks": 2, "block_size": 16, "is_async": True})
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA


def _positive_int(config: dict, name: str, default: int) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StandInConnector: {name} {value!r} must be an integer >= 1")
    return value


class StandInConnector(KVConnectorBase_V1, SupportsHMA):
    """Offers external tokens to every request once (see the module docstring); hybrid layouts
    included (vLLM's hybrid allocator asks connectors for ``SupportsHMA``)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.external_blocks = _positive_int(extra, "external_blocks", 1)
        self.block_size = _positive_int(extra, "block_size", 16)
        is_async = extra.get("is_async", False)
        if not isinstance(is_async, bool):
            raise ValueError(f"StandInConnector: is_async {is_async!r} must be true or false")
        self.is_async = is_async
        self._served: set[str] = set()
        #: request id -> external tokens it was allocated (what a worker would load)
        self.loads: dict[str, int] = {}

    # --- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._served:
            return 0, False
        last = (request.num_tokens - 1) // self.block_size * self.block_size  # whole blocks below the last token
        end = min(num_computed_tokens + self.external_blocks * self.block_size, last)
        n = max(end - num_computed_tokens, 0)
        return n, self.is_async and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens:
            self._served.add(request.request_id)
            self.loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    # --- worker side: never called on a scheduler ---------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError("StandInConnector has no worker side")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("StandInConnector has no worker side")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        raise NotImplementedError("StandInConnector has no worker side")

    def wait_for_save(self) -> None:
        raise NotImplementedError("StandInConnector has no worker side")
