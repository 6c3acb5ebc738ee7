"""kvproof inside vLLM (``kvproof.integrations.vllm``).

Importing this package imports nothing of vLLM: the ``vllm.general_plugins`` entry point
(``plugin.register``) is loaded in every vLLM process and must stay inert and cheap unless
``KVPROOF_CONTRACTS`` is set. The modules that need vLLM import it themselves.
"""

#: vLLM releases whose internals the checks were written and tested against. The checks read
#: private state of vLLM's KV-cache manager, so any other version is refused (docs/vllm.md).
TESTED_VLLM_VERSIONS = ("0.33.0",)
