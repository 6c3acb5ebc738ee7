"""planner/serve_command.py's ``vllm serve`` lines, parsed by vLLM 0.33.0's own ``vllm serve``
argument parser: every engine argument the plan sets comes out as the plan's value."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

pytest.importorskip("vllm")

from kvproof.integrations.vllm import serving_options  # noqa: E402
from kvproof.planner.serve_command import MODEL_PLACEHOLDER, serve_command  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode  # noqa: E402
from kvproof.spec.layout import LayoutConfig  # noqa: E402


@pytest.fixture(scope="module")
def parse():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))

    def run(text: str):
        """The engine arguments of a command line; its leading ``NAME=VALUE`` environment (kvproof's
        manager) must be what the plugin accepts."""
        argv = shlex.split(text.replace(MODEL_PLACEHOLDER, "some-model"))
        env = {}
        while argv and "=" in argv[0]:
            name, value = argv.pop(0).split("=", 1)
            env[name] = value
        if env:
            assert env.pop("KVPROOF_MANAGER") == "kvproof"
            serving_options.parse(env.pop(serving_options.ENV, ""))  # raises on a bad value
            assert not env, env
        assert argv[:2] == ["vllm", "serve"]
        ns = parser.parse_args(argv[1:])
        ns.model = ns.model_tag
        return AsyncEngineArgs.from_cli_args(ns)

    return run


HYBRID = LayoutConfig(groups=(CacheGroup(GroupKind.MLA, 256), CacheGroup(GroupKind.MAMBA, 256)), max_model_len=262_144)


@pytest.mark.parametrize("config, dcp, tp", [
    (HYBRID, 1, 8),
    (dataclasses.replace(HYBRID, hash_block_size=64, retention_interval=None, shared_prefix_checkpoint=True,
                         interleave=16), 4, 8),
    (dataclasses.replace(HYBRID, retention_interval=512), 8, 8),
    (LayoutConfig(groups=(CacheGroup(GroupKind.FULL_ATTENTION, 16),
                          CacheGroup(GroupKind.MAMBA, 16, mamba_cache_mode=MambaCacheMode.NONE))), 1, 1),
])
def test_vllm_reads_every_setting_back(parse, config, dcp, tp):
    command = serve_command(config, dcp, tp, 42_949_672_960, 8192, 256)
    args = parse(command.text())
    assert args.model == "some-model"
    assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (tp, dcp)
    assert args.dcp_kv_cache_interleave_size == (config.interleave if dcp > 1 else 1)
    assert args.kv_cache_memory_bytes == 42_949_672_960
    assert (args.max_num_batched_tokens, args.max_num_seqs) == (8192, 256)
    assert args.block_size == config.groups[0].block_size
    mode_none = config.groups[1].mamba_cache_mode is MambaCacheMode.NONE
    assert args.enable_prefix_caching is (False if mode_none else None)  # None: vLLM's default, on
    assert args.prefix_match_unit == config.hash_block_size
    assert args.prefix_cache_retention_interval == config.retention_interval
    assert args.enable_mamba_shared_prefix_checkpoint is config.shared_prefix_checkpoint


def test_a_model_folder_keeps_vllms_own_block_choice(parse, tmp_path):
    command = serve_command(HYBRID, 2, 8, None, 4096, 64, model=str(tmp_path), block_size_from_model=True)
    args = parse(command.text())
    assert args.model == str(tmp_path) and args.block_size is None and args.kv_cache_memory_bytes is None


def test_a_model_folder_with_a_requested_block_passes_that_block(parse, tmp_path):
    """``--model DIR --block-size 16``: the layout holds vLLM's raised block; the command asks for
    16, and vLLM raises it the same way."""
    raised = dataclasses.replace(HYBRID, groups=tuple(dataclasses.replace(g, block_size=144) for g in HYBRID.groups))
    command = serve_command(raised, 1, 8, None, 4096, 64, model=str(tmp_path), block_size_from_model=True,
                            requested_block_size=16)
    assert parse(command.text()).block_size == 16
