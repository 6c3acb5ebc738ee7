"""vLLM runs on its CPU platform here (tests/conftest.py chooses it before any vLLM import)."""

import os

# In-process tests choose their checks explicitly (--scheduler-cls, or a subprocess that loads the
# plugin): an empty allow-list keeps vLLM from loading kvproof's general plugin, which would
# otherwise patch vLLM's classes for the rest of the test process whenever KVPROOF_CONTRACTS
# happens to be set when an engine config is first built.
os.environ.setdefault("VLLM_PLUGINS", "")
