"""A model folder's ``config.json`` -> the cache layout and per-GPU bytes vLLM 0.33.0 would use
(``kvproof plan --model DIR --tensor-parallel-size N``; docs/plan.md, "From a model's config.json").

What vLLM does, restated for the architectures in :data:`ARCHITECTURES`:

* **Layers.** Each layer is full attention (or MLA) or a recurrent state layer (Mamba, gated
  DeltaNet, KDA); the config says which (``layer_types``, ``full_attention_interval``,
  ``attn_layer_period``/``attn_layer_offset``, ``linear_attn_config["kda_layers"]``).
* **Bytes per token**, one attention layer on one GPU: K and V of ``max(1, kv_heads // tp)``
  heads (``ModelConfig.get_num_kv_heads``), or MLA's latent ``kv_lora_rank + qk_rope_head_dim``
  (one head, never split), in the model dtype (``cache_dtype=auto``).
* **Bytes per state**, one state layer on one GPU: the shapes of
  ``MambaStateShapeCalculator`` for the layer kind, split over TP, in the dtypes of
  ``MambaStateDtypeCalculator`` (``mamba_ssm_cache_dtype=auto``: the model dtype, except
  KDA's recurrent state, which is float32).
* **Block sizes.** Prefix caching is on by default for generative models, so a hybrid model's
  Mamba layers run in ``align`` mode: the attention block grows from the requested size until
  its page holds a state page, and the Mamba block equals it
  (:func:`kvproof.planner.memory.vllm_attention_block_size`). A model without state layers
  keeps the requested block (vLLM's default 16).

Not modelled (named in docs/plan.md): quantized KV caches (``--kv-cache-dtype``), GPU backends'
own block preferences, and FlashInfer's GDN prefill-checkpoint alignment.
tests/plan/test_model_config.py checks every figure against vLLM's own model classes and KV
specs when vLLM is installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from typing import Callable

from kvproof.planner.memory import ModelMemory, vllm_attention_block_size
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode

#: vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE``: the block asked for when ``--block-size`` is not.
DEFAULT_BLOCK_SIZE = 16
#: Bytes of the model dtypes a config names (``torch_dtype`` or ``dtype``).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
FLOAT32_BYTES = 4
#: The longest context kvproof plans for when the config names none (vLLM's own fallback).
FALLBACK_MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class LayerFigures:
    """What one architecture reader finds: how many layers of each kind, and their bytes on
    one GPU (``bytes_per_state`` 0 when the model has no state layers)."""

    attention_kind: GroupKind
    attention_layers: int
    state_layers: int
    bytes_per_token: int
    bytes_per_state: int
    state_kind: str  # the state layer's name in words, for the report ("" if none)


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """The layout ``kvproof plan`` runs for a model folder."""

    architecture: str
    tensor_parallel_size: int
    groups: tuple[CacheGroup, ...]
    memory: ModelMemory
    max_model_len: int
    requested_block_size: int
    figures: LayerFigures

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    def describe(self) -> tuple[str, str]:
        """Two short lines: the architecture and its layers; the bytes and what vLLM's block rule
        made of them."""
        f = self.figures
        kinds = f"{f.attention_layers} {f.attention_kind.value}"
        if f.state_layers:
            kinds += f" + {f.state_layers} {f.state_kind}"
        # vLLM grows the attention block until one attention page holds a state page.
        raised = f" (vLLM raised it from {self.requested_block_size})" if self.block_size != self.requested_block_size else ""
        state = f", {f.bytes_per_state:,} B/state" if f.state_layers else ""
        return (
            f"{self.architecture} at TP {self.tensor_parallel_size}, {kinds} layers",
            f"per GPU and layer: {f.bytes_per_token:,} B/token{state}; block {self.block_size}{raised}",
        )

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "tensor_parallel_size": self.tensor_parallel_size,
            "layers": list(self.memory.layers),
            "bytes_per_token": self.memory.bytes_per_token,
            "bytes_per_state": self.memory.bytes_per_state,
            "block_size": self.block_size,
            "requested_block_size": self.requested_block_size,
        }


class _Config:
    """Field access on a config dict whose errors name the field, the folder and what was expected."""

    def __init__(self, values: dict, where: str) -> None:
        self.values, self.where = values, where

    def get(self, name: str, default=None):
        return self.values.get(name, default)

    def int(self, name: str, default: int | None = None, low: int = 1) -> int:
        value = self.values.get(name, default)
        if value is None:
            raise ValueError(f"{self.where}: {name!r} is missing; expected a positive integer")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{self.where}: {name} {value!r} must be an integer >= {low}")
        return value

    def sub(self, name: str) -> "_Config":
        value = self.values.get(name)
        if not isinstance(value, dict):
            raise ValueError(f"{self.where}: {name!r} must be an object, got {value!r}")
        return _Config(value, f"{self.where} ({name})")

    def dtype_bytes(self) -> int:
        name = self.values.get("torch_dtype", self.values.get("dtype", "bfloat16"))
        if name not in DTYPE_BYTES:
            raise ValueError(f"{self.where}: dtype {name!r} must be one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[name]


def _split(value: int, tp: int, what: str, where: str) -> int:
    """``value`` over ``tp`` ranks, as vLLM's ``divide``: it must divide evenly."""
    if value % tp:
        raise ValueError(f"{where}: {what} {value} is not divisible by --tensor-parallel-size {tp}")
    return value // tp


def _kv_bytes(c: _Config, tp: int) -> int:
    """K and V of one token of one attention layer on one GPU."""
    heads = c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads)
    head_dim = c.int("head_dim", c.int("hidden_size") // heads)
    return 2 * max(1, kv_heads // tp) * head_dim * c.dtype_bytes()


def _mla_bytes(c: _Config) -> int:
    """MLA's latent of one token of one layer: one head, never split over TP."""
    return (c.int("kv_lora_rank") + c.int("qk_rope_head_dim")) * c.dtype_bytes()


def _conv_bytes(c: _Config, conv_dim: int, kernel: int, tp: int) -> int:
    return _split(conv_dim, tp, "convolution width", c.where) * (kernel - 1) * c.dtype_bytes()


def _llama(c: _Config, tp: int) -> LayerFigures:
    return LayerFigures(GroupKind.FULL_ATTENTION, c.int("num_hidden_layers"), 0, _kv_bytes(c, tp), 0, "")


def _qwen3_next(c: _Config, tp: int) -> LayerFigures:
    layers = c.int("num_hidden_layers")
    types = c.get("layer_types")
    if types is None:
        interval = c.int("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(
            f"{c.where}: layer_types must list {layers} entries of 'full_attention' / 'linear_attention'"
        )
    nk, nv = c.int("linear_num_key_heads"), c.int("linear_num_value_heads")
    dk, dv = c.int("linear_key_head_dim"), c.int("linear_value_head_dim")
    conv = _conv_bytes(c, 2 * nk * dk + nv * dv, c.int("linear_conv_kernel_dim"), tp)
    recurrent = _split(nv, tp, "linear_num_value_heads", c.where) * dv * dk * c.dtype_bytes()
    full = types.count("full_attention")
    return LayerFigures(GroupKind.FULL_ATTENTION, full, layers - full, _kv_bytes(c, tp), conv + recurrent, "gated DeltaNet")


def _jamba(c: _Config, tp: int) -> LayerFigures:
    layers = c.int("num_hidden_layers")
    period, offset = c.int("attn_layer_period", 8), c.int("attn_layer_offset", 4, low=0)
    full = sum(1 for i in range(layers) if i % period == offset)
    inner = _split(c.int("mamba_expand", 2) * c.int("hidden_size"), tp, "mamba_expand * hidden_size", c.where)
    conv = inner * (c.int("mamba_d_conv", 4) - 1) * c.dtype_bytes()
    recurrent = inner * c.int("mamba_d_state", 16) * c.dtype_bytes()
    return LayerFigures(GroupKind.FULL_ATTENTION, full, layers - full, _kv_bytes(c, tp), conv + recurrent, "Mamba")


def _kimi_linear(c: _Config, tp: int) -> LayerFigures:
    layers = c.int("num_hidden_layers")
    linear = c.sub("linear_attn_config")
    kda = linear.get("kda_layers")
    if not isinstance(kda, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= layers for i in kda):
        raise ValueError(f"{linear.where}: kda_layers must list 1-based layer numbers in [1, {layers}]")
    heads, head_dim = linear.int("num_heads"), linear.int("head_dim")
    conv = _conv_bytes(c, 3 * heads * head_dim, linear.int("short_conv_kernel_size", 4), tp)
    recurrent = _split(heads, tp, "linear_attn_config num_heads", c.where) * head_dim * head_dim * FLOAT32_BYTES
    mla = c.get("kv_lora_rank") is not None
    per_token = _mla_bytes(c) if mla else _kv_bytes(c, tp)
    kind = GroupKind.MLA if mla else GroupKind.FULL_ATTENTION
    num_kda = len(set(kda))
    return LayerFigures(kind, layers - num_kda, num_kda, per_token, conv + recurrent, "KDA")


#: Architectures (``config.json``'s ``architectures[0]``) kvproof can plan, and their reader.
ARCHITECTURES: dict[str, Callable[[_Config, int], LayerFigures]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
    "Qwen3ForCausalLM": _llama,
    "Qwen3NextForCausalLM": _qwen3_next,
    "JambaForCausalLM": _jamba,
    "KimiLinearForCausalLM": _kimi_linear,
}

#: Config folders shipped with kvproof (``--model NAME``), in planner/data/models/.
SHIPPED_MODELS = ("jamba", "kimi-k3", "llama", "qwen3-next")


def read_config(model: str) -> tuple[dict, str]:
    """The config dict of a folder (or a shipped model's name) and where it came from."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model {model!r} has no config.json; expected a Hugging Face model folder")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    elif model in SHIPPED_MODELS:
        path = f"shipped model {model}"
        text = (resources.files("kvproof.planner") / "data" / "models" / model / "config.json").read_text("utf-8")
    else:
        raise ValueError(
            f"--model {model!r} is neither a folder nor a shipped model; expected a folder with a config.json "
            f"or one of {', '.join(SHIPPED_MODELS)}"
        )
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return values, path


def model_layout(model: str, tensor_parallel_size: int = 1, block_size: int = DEFAULT_BLOCK_SIZE) -> ModelLayout:
    """The layout vLLM 0.33.0 would serve ``model`` with at ``tensor_parallel_size``, asking for
    ``block_size`` tokens per attention block. ValueError naming what does not fit."""
    for name, value in (("--tensor-parallel-size", tensor_parallel_size), ("--block-size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} {value!r} must be a positive integer")
    values, where = read_config(model)
    archs = values.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture {arch!r} is not one kvproof can plan; expected one of {', '.join(ARCHITECTURES)} "
            "(or give the layout with --group and the bytes with --bytes-per-token / --bytes-per-state / --layers)"
        )
    config = _Config(values, where)
    figures = ARCHITECTURES[arch](config, tensor_parallel_size)
    max_len = config.int("max_position_embeddings", FALLBACK_MAX_MODEL_LEN)
    attention = CacheGroup(figures.attention_kind, block_size)
    if not figures.state_layers:
        memory = ModelMemory((figures.attention_layers,), figures.bytes_per_token, 0)
        return ModelLayout(arch, tensor_parallel_size, (attention,), memory, max_len, block_size, figures)
    if not figures.attention_layers:
        raise ValueError(f"{where}: every layer is a state layer; kvproof plans hybrid and attention models")
    memory = ModelMemory((figures.attention_layers, figures.state_layers), figures.bytes_per_token, figures.bytes_per_state)
    raised = vllm_attention_block_size(attention, memory, figures.bytes_per_state)
    groups = (
        CacheGroup(figures.attention_kind, raised),
        CacheGroup(GroupKind.MAMBA, raised, mamba_cache_mode=MambaCacheMode.ALIGN),
    )
    return ModelLayout(arch, tensor_parallel_size, groups, memory, max_len, block_size, figures)

