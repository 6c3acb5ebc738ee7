"""The drift guard (integrations/vllm/manager_surface.py): what the installed vLLM's code uses of
its KV-cache manager, read from its source, is the checked-in ``SURFACE``; vLLM's own manager has
all of it; ``missing_from`` names what a candidate lacks; the extractor finds each way vLLM's
code reaches the manager (shown on a small source tree written here)."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402

from kvproof.integrations.vllm import manager_surface as ms  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402


@pytest.fixture(scope="module")
def extracted():
    return ms.extract()


def test_the_installed_vllm_uses_exactly_the_recorded_surface(extracted):
    uses, sites = extracted
    recorded = {u.path: u for u in ms.SURFACE}
    found = {u.path: u for u in uses}
    new = [f"{u.name} ({u.kind}, keywords {list(u.keywords)}) at {', '.join(sites[u.name])}"
           for p, u in found.items() if recorded.get(p) != u]
    gone = [f"{u.name} ({u.kind}, keywords {list(u.keywords)})" for p, u in recorded.items() if found.get(p) != u]
    assert not new and not gone, (
        "vLLM's use of its KV-cache manager changed; a stand-in manager must follow.\n"
        f"used now (new or changed): {new}\nrecorded but not used so: {gone}"
    )


def test_the_surface_reaches_the_scheduler_engine_and_connectors(extracted):
    uses, sites = extracted
    by_name = {u.name: u for u in uses}
    allocate = by_name["allocate_slots"]
    assert allocate.kind == "call" and {"num_lookahead_tokens", "delay_cache_blocks", "num_encoder_tokens",
                                        "num_external_computed_tokens", "new_computed_blocks"} <= set(allocate.keywords)
    assert sites["allocate_slots"] == ["v1/core/sched/scheduler.py:914", "v1/core/sched/scheduler.py:1435"]
    assert {"hash_block_size", "use_eagle", "num_hash_lookahead_tokens", "metrics_collector"} <= set(by_name["__init__"].keywords)
    assert by_name["usage"].kind == "read"  # a property, never called
    assert by_name["coordinator.single_type_managers[*].kv_cache_spec"].contexts == ("scheduler", "engine")
    assert by_name["coordinator.full_attention_group_id"].kind == "optional"  # getattr with a default
    assert "connector" in by_name["block_pool"].contexts  # KVConnectorBase.bind_kv_cache_manager
    assert all(u.contexts for u in uses) and len({u.path for u in uses}) == len(uses)


def _vllm_scheduler():
    layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 16)),
                                         max_model_len=4096))
    return EngineHarness(layout, 64).scheduler


def test_vllm_s_own_manager_has_the_whole_surface():
    manager = _vllm_scheduler().kv_cache_manager
    assert type(manager) is KVCacheManager
    assert ms.missing_from(manager) == []  # every path walked on the live object, [*] on every group
    assert ms.missing_from(KVCacheManager) == []  # and one level deep on the class


class _Partial:
    """A stand-in that forgot things: no ``take_events``, ``allocate_slots`` without
    ``num_lookahead_tokens``, no ``usage``, a coordinator whose managers lack ``kv_cache_spec``."""

    def __init__(self, real: KVCacheManager = None, **options) -> None:
        self._real = real
        self.coordinator = type("Coordinator", (), {})()
        self.coordinator.enable_partial_hash_hits = True
        self.coordinator.single_type_managers = [type("M", (), {"block_size": 16})()]

    def allocate_slots(self, request, num_new_tokens, *, num_new_computed_tokens=0, new_computed_blocks=None,
                       num_encoder_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                       full_sequence_must_fit=False, has_scheduled_reqs=False, reserved_blocks=0,
                       skip_zeroing_group_ids=()):
        raise NotImplementedError

    def __getattr__(self, name):
        if name in ("take_events", "usage", "_real"):
            raise AttributeError(name)
        return getattr(self._real, name)


def test_missing_from_names_each_thing_a_stand_in_lacks():
    missing = ms.missing_from(_Partial(_vllm_scheduler().kv_cache_manager), contexts=("scheduler", "engine"))
    assert sorted(missing) == sorted([
        "method allocate_slots: no keyword parameter 'num_lookahead_tokens'",
        "method take_events",
        "attribute usage",
        "attribute coordinator.single_type_managers[*].kv_cache_spec",
        "method coordinator.get_num_blocks_to_allocate",
    ])


def test_missing_from_a_class_reads_methods_parameters_and_self_attributes():
    class Stand:
        def __init__(self, kv_cache_config, max_model_len, **unused):
            self.block_pool = None

        def free(self):  # vLLM passes the request
            pass

        def get_blocks(self, *args):
            pass

    missing = ms.missing_from(Stand, contexts=("scheduler",))
    assert "method free: takes 0 positional arguments, vLLM passes 1" in missing
    assert not any(m.startswith("method __init__") for m in missing)  # **unused takes the rest

    class Narrow:
        def __init__(self, kv_cache_config, max_model_len, scheduler_block_size, hash_block_size):
            pass

    assert "method __init__: no keyword parameter 'use_eagle'" in ms.missing_from(Narrow, contexts=("scheduler",))
    assert not any(m.startswith(("attribute block_pool", "method get_blocks")) for m in missing)
    assert "method allocate_slots" in missing and "attribute coordinator" in missing


SAMPLE_TREE = {
    "v1/core/sched/scheduler.py": '''
        class Scheduler:
            def __init__(self):
                self.kv_cache_manager = KVCacheManager(kv_cache_config=c, use_eagle=True)  # its arguments are
            def schedule(self):
                self.kv_cache_manager.allocate_slots(r, 4, num_lookahead_tokens=1)
                for m in self.kv_cache_manager.coordinator.single_type_managers:
                    m.block_size
                blocks = self.kv_cache_manager.get_blocks(r)   # return values are not followed
                blocks.get_block_ids()
                return self.kv_cache_manager.usage
    ''',
    "v1/engine/core.py": '''
        def probe(self):
            manager = getattr(self.scheduler, "kv_cache_manager", None)
            for i, (group, m) in enumerate(zip(groups, manager.coordinator.single_type_managers)):
                m.kv_cache_spec
    ''',
    "distributed/connector.py": '''
        class Base:
            def bind_kv_cache_manager(self, kv_cache_manager):
                self._kv_cache_manager = kv_cache_manager
                self._pool = kv_cache_manager.block_pool
            def later(self):
                self._pool.get_cached_block(h, g)
                getattr(self._kv_cache_manager.coordinator, "full_attention_group_id", None)
        class Sub(Base):
            def use(self):
                self._kv_cache_manager.kv_cache_config.num_blocks
    ''',
    "v1/unrelated.py": "x = 1\n",
}


def test_extract_follows_names_self_attributes_loops_and_getattr(tmp_path):
    for relative, source in SAMPLE_TREE.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    uses, sites = ms.extract(str(tmp_path))
    assert {u.name: (u.kind, u.contexts, u.positional, u.keywords) for u in uses} == {
        "__init__": ("call", ("scheduler",), 0, ("kv_cache_config", "use_eagle")),
        "allocate_slots": ("call", ("scheduler",), 2, ("num_lookahead_tokens",)),
        "block_pool": ("read", ("connector",), 0, ()),
        "block_pool.get_cached_block": ("call", ("connector",), 2, ()),
        "coordinator": ("read", ("scheduler", "engine", "connector"), 0, ()),
        "coordinator.full_attention_group_id": ("optional", ("connector",), 0, ()),
        "coordinator.single_type_managers": ("read", ("scheduler", "engine"), 0, ()),
        "coordinator.single_type_managers[*]": ("read", ("scheduler", "engine"), 0, ()),
        "coordinator.single_type_managers[*].block_size": ("read", ("scheduler",), 0, ()),
        "coordinator.single_type_managers[*].kv_cache_spec": ("read", ("engine",), 0, ()),
        "get_blocks": ("call", ("scheduler",), 1, ()),
        "kv_cache_config": ("read", ("connector",), 0, ()),
        "kv_cache_config.num_blocks": ("read", ("connector",), 0, ()),
        "usage": ("read", ("scheduler",), 0, ()),
    }
    assert sites["block_pool.get_cached_block"] == ["distributed/connector.py:7"]
