"""What planner/serve_command.py says stock vLLM cannot reproduce (tests/vllm/ parses the
command itself with vLLM's parser)."""

from __future__ import annotations

import dataclasses

from kvproof.planner.serve_command import serve_command
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig

ATTENTION = LayoutConfig(groups=(CacheGroup(GroupKind.FULL_ATTENTION, 16),), attention_keys="chunk-ends")


def test_vllms_own_rules_leave_nothing_out():
    command = serve_command(ATTENTION, 1, 1, None, 8192, 256)
    assert command.not_reproduced == ()
    assert command.text() == "vllm serve <model> --tensor-parallel-size 1 --max-num-batched-tokens 8192 --max-num-seqs 256 --block-size 16"


def test_each_kvproof_rule_is_named():
    config = dataclasses.replace(ATTENTION, attention_keys="every-hash", eviction="compute", hash_block_size=8)
    named = serve_command(config, 1, 1, None, 8192, 256, eagle=True).not_reproduced
    assert [n.split(" (")[0] for n in named] == [
        "--attention-keys every-hash", "--eviction compute", "--eagle", "--hash-block-size 8"]
