"""Tiny stand-ins for the Hugging Face models vLLM's scheduler tests name, laid out as a Hugging
Face hub cache, so that ``ModelConfig(model="facebook/opt-125m")`` resolves offline
(``HF_HUB_OFFLINE=1``, ``HF_HOME`` pointing at the cache) without editing the tests and without
changing the model name they see.

The tests need a model's *configuration*, never its weights: the architecture (which vLLM
inspects), the context length, the token ids the scheduler compares against (EOS, image
placeholder) and, for the multimodal model, what vLLM's processor needs to size an image's
encoder tokens. Those fields keep the real model's values; layer counts and widths are shrunk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from kvproof.integrations.vllm.tiny_model import TINY_QWEN3_NEXT

OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "vocab_size": 50272,
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "ffn_dim": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,  # the real model's: tests rely on the default max_model_len
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}

# llava-1.5-7b-hf's real geometry where the scheduler sees it: a 336-pixel CLIP tower with patch
# 14 (576 encoder tokens per image), image token 32000, 4,096-token context.
LLAVA_IMAGE_TOKEN_ID = 32000
LLAVA_VOCAB_SIZE = 32064
LLAVA_1_5 = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": LLAVA_IMAGE_TOKEN_ID,
    "pad_token_id": LLAVA_IMAGE_TOKEN_ID + 1,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "image_seq_length": 576,
    "vocab_size": LLAVA_VOCAB_SIZE,
    "torch_dtype": "float16",
    "text_config": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "vocab_size": LLAVA_VOCAB_SIZE,
        "torch_dtype": "float16",
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 336,
        "patch_size": 14,
        "projection_dim": 64,
        "vocab_size": 32000,
    },
}
LLAVA_IMAGE_PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "crop_size": {"height": 336, "width": 336},
    "size": {"shortest_edge": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
}
LLAVA_PROCESSOR = {
    "processor_class": "LlavaProcessor",
    "image_token": "<image>",
    "patch_size": 14,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}


def _llava_tokenizer_json() -> str:
    """A word-level tokenizer over the real vocabulary size, with llava's special tokens at their
    real ids (vLLM's multimodal processor needs a tokenizer that knows ``<image>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {0: "<unk>", 1: "<s>", 2: "</s>", LLAVA_IMAGE_TOKEN_ID: "<image>", LLAVA_IMAGE_TOKEN_ID + 1: "<pad>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(LLAVA_VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(special.values()))
    return tokenizer.to_str()


def _files() -> dict[str, dict[str, str]]:
    """Every model id the tests name -> its files (name -> text)."""
    qwen3_next = dict(TINY_QWEN3_NEXT, mtp_num_hidden_layers=1)  # the MTP drafter a test builds
    return {
        "facebook/opt-125m": {"config.json": json.dumps(OPT_125M)},
        "Qwen/Qwen3-Next-80B-A3B-Instruct": {"config.json": json.dumps(qwen3_next)},
        "llava-hf/llava-1.5-7b-hf": {
            "config.json": json.dumps(LLAVA_1_5),
            "tokenizer.json": _llava_tokenizer_json(),
            "tokenizer_config.json": json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 4096,
            }),
            "preprocessor_config.json": json.dumps(LLAVA_IMAGE_PROCESSOR),
            "processor_config.json": json.dumps(LLAVA_PROCESSOR),
        },
    }


MODEL_IDS = ("facebook/opt-125m", "Qwen/Qwen3-Next-80B-A3B-Instruct", "llava-hf/llava-1.5-7b-hf")


def write_hub_cache(hf_home: str) -> None:
    """Mutates the file system: lays out ``hf_home/hub`` as the Hugging Face hub's cache holds a
    downloaded model (``models--org--name/refs/main`` naming a snapshot folder). The snapshot's
    name is a hash of its files, so a changed stand-in gets a new snapshot."""
    for model_id, files in _files().items():
        repo = os.path.join(hf_home, "hub", "models--" + model_id.replace("/", "--"))
        revision = hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()
        snapshot = os.path.join(repo, "snapshots", revision)
        os.makedirs(snapshot, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(snapshot, name), "w", encoding="utf-8") as f:
                f.write(text)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w", encoding="utf-8") as f:
            f.write(revision)


_HUB_ID = re.compile(r"""["']([A-Za-z0-9][\w.-]*/[\w.-]+)["']""")


def unknown_model_ids(paths: list[str]) -> list[tuple[str, str]]:
    """``(model id, file)`` for every string literal in ``paths`` that looks like a hub model id
    and has no stand-in here: its tests would fail to build a ``ModelConfig`` offline."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for model_id in sorted(set(_HUB_ID.findall(text))):
            if model_id not in MODEL_IDS and "." not in model_id.split("/")[0]:
                out.append((model_id, path))
    return out
