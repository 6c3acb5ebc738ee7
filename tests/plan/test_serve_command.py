"""What planner/serve_command.py says stock vLLM cannot reproduce, and the environment that serves
kvproof's rules with its manager (tests/vllm/ parses the command itself with vLLM's parser)."""

from __future__ import annotations

import dataclasses

import pytest

from kvproof.planner.serve_command import serve_command
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig

ATTENTION = LayoutConfig(groups=(CacheGroup(GroupKind.FULL_ATTENTION, 16),), attention_keys="prompt-tail")


def test_vllms_own_rules_leave_nothing_out():
    command = serve_command(ATTENTION, 1, 1, None, 8192, 256)
    assert command.not_reproduced == ()
    assert command.text() == "vllm serve <model> --tensor-parallel-size 1 --max-num-batched-tokens 8192 --max-num-seqs 256 --block-size 16"


def test_each_kvproof_rule_is_named_for_stock_vllm():
    config = dataclasses.replace(ATTENTION, attention_keys="every-hash", eviction="compute", hash_block_size=8)
    named = serve_command(config, 1, 1, None, 8192, 256, eagle=True, manager="vllm").not_reproduced
    assert [n.split(" (")[0] for n in named] == [
        "--attention-keys every-hash", "--eviction compute", "--eagle", "--hash-block-size 8"]


def test_kvproofs_rules_are_served_by_its_manager():
    """Rules stock vLLM lacks start the command with kvproof's manager, its options parsed back by
    the manager's own parser as the plan's rules; nothing is then left unreproduced."""
    from kvproof.integrations.vllm import serving_options

    for keys, eviction in (("every-hash", "lru"), ("every-hash", "compute"), ("chunk-ends", "lru"), ("chunk-ends", "compute")):
        config = dataclasses.replace(ATTENTION, attention_keys=keys, eviction=eviction)
        command = serve_command(config, 1, 1, None, 8192, 256)
        env = dict(command.env)
        assert env["KVPROOF_MANAGER"] == "kvproof" and command.not_reproduced == ()
        served = serving_options.parse(env.get(serving_options.ENV))
        assert (served.attention_keys, served.eviction) == (keys, eviction)
        assert command.text().startswith("KVPROOF_MANAGER=kvproof " + (f"KVPROOF_OPTIONS={env[serving_options.ENV]} "
                                                                       if serving_options.ENV in env else "") + "vllm serve ")


def test_the_manager_can_be_chosen():
    # vLLM's rules in kvproof's manager: its defaults differ, so the option says which.
    assert serve_command(ATTENTION, 1, 1, None, 8192, 256, manager="kvproof").env == (
        ("KVPROOF_MANAGER", "kvproof"), ("KVPROOF_OPTIONS", "attention_keys=prompt-tail"))
    stock = serve_command(dataclasses.replace(ATTENTION, eviction="compute"), 1, 1, None, 8192, 256, manager="vllm")
    assert stock.env == () and [n.split(" (")[0] for n in stock.not_reproduced] == ["--eviction compute"]
    with pytest.raises(ValueError, match="manager 'sglang' must be one of auto, vllm, kvproof"):
        serve_command(ATTENTION, 1, 1, None, 8192, 256, manager="sglang")
