"""vLLM picks its platform once, from the environment, when something first asks for it: the
CPU platform must be chosen before any vLLM module is imported (the engine harness, the checked
scheduler and the CPU executor run on it)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
