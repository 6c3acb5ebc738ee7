"""vLLM picks its platform once, from the environment, when something first asks for it: the
CPU platform must be chosen before any vLLM module is imported (the engine harness, the checked
scheduler and the CPU executor run on it)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# In-process tests choose their checks explicitly (--scheduler-cls, or a subprocess that loads the
# plugin): an empty allow-list keeps vLLM from loading kvproof's general plugin, which would
# otherwise patch vLLM's classes for the rest of the test process whenever KVPROOF_CONTRACTS
# happens to be set when an engine config is first built.
os.environ.setdefault("VLLM_PLUGINS", "")
