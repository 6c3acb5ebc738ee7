"""planner/model_config.py without vLLM: the shipped config folders give the presets' figures
(worked out by hand in cli/presets.py), and a bad folder or flag is one clear ValueError.
tests/vllm/test_model_config_vllm.py checks every figure against vLLM's own code."""

from __future__ import annotations

import json

import pytest

from kvproof.cli.presets import PRESETS
from kvproof.planner.model_config import SHIPPED_MODELS, model_layout
from kvproof.spec.groups import GroupKind, MambaCacheMode


@pytest.mark.parametrize("model, tp, preset", [("kimi-k3", 8, "kimi-k3"), ("qwen3-next", 1, "qwen3-next")])
def test_a_shipped_model_gives_its_presets_layout_and_bytes(model, tp, preset):
    layout = model_layout(model, tp)
    want = PRESETS[preset]
    assert [(g.kind, g.block_size) for g in layout.groups] == [(g.kind, g.block_size) for g in want.groups]
    assert layout.groups[1].mamba_cache_mode is MambaCacheMode.ALIGN
    assert (layout.memory.layers, layout.memory.bytes_per_token, layout.memory.bytes_per_state) == (
        want.memory.layers, want.memory.bytes_per_token, want.memory.bytes_per_state)
    assert layout.max_model_len == want.max_model_len


def test_the_block_is_raised_only_for_a_hybrid_model_and_said_so():
    llama = model_layout("llama", 8)
    assert [(g.kind, g.block_size) for g in llama.groups] == [(GroupKind.FULL_ATTENTION, 16)]
    assert llama.memory.bytes_per_token == 2 * 1 * 128 * 2  # 8 KV heads over TP 8, bf16
    assert "raised" not in " ".join(llama.describe())
    qwen = model_layout("qwen3-next", 1)
    assert "block 544 (vLLM raised it from 16)" in qwen.describe()[1]
    # Asking for a block already past the raise keeps it.
    assert model_layout("qwen3-next", 1, block_size=1088).block_size == 1088


def test_tensor_parallelism_splits_state_and_kv_heads_but_not_the_mla_latent():
    one, eight = model_layout("kimi-k3", 1), model_layout("kimi-k3", 8)
    assert one.memory.bytes_per_token == eight.memory.bytes_per_token == (512 + 64) * 2
    assert one.memory.bytes_per_state == 8 * eight.memory.bytes_per_state
    q1, q8 = model_layout("qwen3-next", 1), model_layout("qwen3-next", 8)
    assert q1.memory.bytes_per_token == 2 * q8.memory.bytes_per_token  # 2 KV heads, then 1 (replicated)


def _folder(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _shipped(name):
    from importlib import resources

    return json.loads((resources.files("kvproof.planner") / "data" / "models" / name / "config.json").read_text())


def test_every_shipped_model_reads():
    for name in SHIPPED_MODELS:
        assert model_layout(name, 1).memory.bytes_per_token > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not one kvproof can plan"),
        ({"architectures": []}, "architecture None is not one"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
        ({"num_hidden_layers": True}, "num_hidden_layers True must be an integer >= 1"),
        ({"torch_dtype": "int4"}, "dtype 'int4' must be one of"),
        ({"layer_types": ["full_attention"]}, "layer_types must list 48 entries"),
    ],
)
def test_a_bad_config_names_the_field(tmp_path, change, message):
    config = {**_shipped("qwen3-next"), **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model_layout(_folder(tmp_path, **config), 1)


def test_a_bad_folder_or_flag_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        model_layout(str(tmp_path), 1)
    with pytest.raises(ValueError, match="neither a folder nor a shipped model"):
        model_layout(str(tmp_path / "missing"), 1)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_layout(str(tmp_path), 1)
    with pytest.raises(ValueError, match="not divisible by --tensor-parallel-size 3"):
        model_layout("qwen3-next", 3)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="--tensor-parallel-size"):
            model_layout("qwen3-next", bad)
    with pytest.raises(ValueError, match="kda_layers must list"):
        config = _shipped("kimi-k3")
        config["linear_attn_config"]["kda_layers"] = [0]
        model_layout(_folder(tmp_path, **config), 1)


def test_plan_reads_a_model_folder_and_reports_what_it_read(tmp_path):
    from .conftest import plan_cli, plan_json

    folder = _folder(tmp_path, **_shipped("qwen3-next"))
    out = plan_json("--model", folder, "--tensor-parallel-size", "8", "--limit", "30", "--dcp", "1")
    assert out["model"] == {
        "architecture": "Qwen3NextForCausalLM", "tensor_parallel_size": 8, "layers": [12, 36],
        "bytes_per_token": 1024, "bytes_per_state": 137216, "block_size": 144, "requested_block_size": 16,
    }
    assert out["layout"]["groups"] == ["full_attention:144", "mamba:144"]
    text = plan_cli("--model", folder, "--tensor-parallel-size", "8", "--limit", "30", "--dcp", "1", "--no-progress")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == "model: Qwen3NextForCausalLM at TP 8, 12 full_attention + 36 gated DeltaNet layers"


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama", "--preset", "jamba"], "--model gives the layout and the bytes per GPU; drop --preset"),
    (["--model", "llama", "--bytes-per-token", "10"], "drop --bytes-per-token"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size sizes a model's layers; it needs --model DIR"),
    (["--model", "qwen3-next", "--tensor-parallel-size", "3"], "not divisible by --tensor-parallel-size 3"),
])
def test_plan_refuses_a_model_with_a_conflicting_flag(argv, message):
    from .conftest import plan_cli

    done = plan_cli(*argv, "--no-progress")
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""
