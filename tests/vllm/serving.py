"""A real ``vllm serve`` subprocess on 127.0.0.1 with the model-free CPU staging executor and
kvproof's plugin (no ``--scheduler-cls``), for the tests that serve over HTTP. Each start costs
tens of seconds: tests reuse one server across checks where they can."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from typing import Optional

import psutil

from kvproof.integrations.vllm.tiny_model import write_tiny_model

BLOCK, NUM_BLOCKS, BUDGET, MAX_SEQS, MAX_LEN = 16, 1024, 512, 16, 4096
EXECUTOR = "kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_command() -> list[str]:
    script = shutil.which("vllm") or os.path.join(os.path.dirname(sys.executable), "vllm")
    return [script]


#: Faults seeded into vLLM's own code in the server's processes, through a second general plugin
#: (``KVPROOF_TEST_FAULTS``, comma-separated): ``pre-fix-width`` puts back vLLM's old block-table
#: width (every group divided by DCP: the seed bug); ``leak`` keeps one attention block of the
#: first request freed referenced (a leak).
_FAULTS = textwrap.dedent("""
    import os

    def register():
        faults = set(filter(None, os.environ.get("KVPROOF_TEST_FAULTS", "").split(",")))
        if "pre-fix-width" in faults:
            from vllm.utils.math_utils import cdiv
            from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

            def pre_fix_width(self, vllm_config, max_model_len):
                return cdiv(max_model_len, self.block_size * vllm_config.parallel_config.decode_context_parallel_size)

            MambaSpec.max_num_blocks_per_req = AttentionSpec.max_num_blocks_per_req = pre_fix_width
        if "leak" in faults:
            from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

            pop, leaked = FullAttentionManager.pop_blocks_for_free, []

            def pop_blocks_for_free(self, request_id):
                blocks = pop(self, request_id)
                real = [b for b in blocks if not b.is_null]
                if real and not leaked:
                    leaked.append(real[0])
                    return [b for b in blocks if b is not real[0]]
                return blocks

            FullAttentionManager.pop_blocks_for_free = pop_blocks_for_free
""")


def fault_plugin_dir(folder: str) -> str:
    """A folder for PYTHONPATH holding the fault plugin and the metadata that makes it a
    ``vllm.general_plugins`` entry point."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kvproof_test_faults.py"), "w") as f:
        f.write(_FAULTS)
    meta = os.path.join(folder, "kvproof_test_faults-0.dist-info")
    os.makedirs(meta, exist_ok=True)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvproof-test-faults\nVersion: 0\n")
    with open(os.path.join(meta, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nkvproof_test_faults = kvproof_test_faults:register\n")
    return folder


class Server:
    """``vllm serve`` of the tiny hybrid model, TP = DCP = ``dcp``, checks logged and counted
    (``KVPROOF_ON_VIOLATION=log``) unless ``env`` says otherwise. ``metrics_dir``: a
    PROMETHEUS_MULTIPROC_DIR (None: a fresh one; False: none). ``num_blocks`` None: no
    --num-gpu-blocks-override. ``faults``: see :data:`_FAULTS`. ``args``: more ``vllm serve``
    arguments; ``model``: overrides of the tiny model's ``config.json``."""

    def __init__(self, dcp: int, env: Optional[dict] = None, metrics_dir=None, num_blocks: Optional[int] = NUM_BLOCKS,
                 faults: str = "", max_model_len: int = MAX_LEN, args: tuple = (), model: Optional[dict] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvproof-serve-")
        self.model = write_tiny_model(os.path.join(self.dir, "model"), model)
        if metrics_dir is None:
            metrics_dir = os.path.join(self.dir, "prometheus")
            os.mkdir(metrics_dir)
        self.port = _free_port()
        environment = {k: v for k, v in os.environ.items()
                       if k not in ("VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING", "PROMETHEUS_MULTIPROC_DIR",
                                    "KVPROOF_STOP_REPORT")}
        # The tests read kvproof's info lines: a VLLM_LOGGING_LEVEL an in-process command of an
        # earlier test left in this worker's environment (`--engine vllm` sets ERROR) must not hide them.
        environment.update(VLLM_TARGET_DEVICE="cpu", KVPROOF_CONTRACTS="cheap", KVPROOF_ON_VIOLATION="log",
                           VLLM_LOGGING_LEVEL="INFO")
        if metrics_dir:
            environment["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        if faults:
            plugins = fault_plugin_dir(os.path.join(self.dir, "plugins"))
            environment.update(KVPROOF_TEST_FAULTS=faults,
                               PYTHONPATH=os.pathsep.join(filter(None, [plugins, environment.get("PYTHONPATH")])))
        environment.update(env or {})
        self.log = open(os.path.join(self.dir, "serve.log"), "w")
        pool = ["--num-gpu-blocks-override", str(num_blocks)] if num_blocks is not None else []
        self.proc = subprocess.Popen(
            _vllm_command() + [
                "serve", self.model, "--skip-tokenizer-init", "--block-size", str(BLOCK), *pool,
                "--tensor-parallel-size", str(dcp), "--decode-context-parallel-size", str(dcp),
                "--distributed-executor-backend", EXECUTOR,
                "--enable-prefix-caching", "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_SEQS),
                "--max-num-batched-tokens", str(BUDGET), "--enable-prompt-tokens-details",
                "--host", "127.0.0.1", "--port", str(self.port), *args,
            ],
            env=environment, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_until_up(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(2)
        raise AssertionError(f"vllm serve did not come up in {timeout} s:\n{self.tail()}")

    def complete(self, prompt, max_tokens: int) -> dict:
        body = json.dumps({"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(self.url("/v1/completions"), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            return r.read().decode()

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def tail(self) -> str:
        return self.output()[-4000:]

    def wait(self, timeout: float = 300) -> int:
        """The exit status of a server that stops on its own."""
        return self.proc.wait(timeout=timeout)

    def stop(self) -> tuple[int, list]:
        """SIGTERM, as an operator would (if still running); returns the exit status and any
        process left, and removes the server's folder (its whole output stays in
        ``final_output``)."""
        family = [self.proc.pid]
        if self.proc.poll() is None:
            family += [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        finally:
            self.log.close()
        deadline = time.monotonic() + 30
        alive = [p for p in family if psutil.pid_exists(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(1)
            alive = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for pid in alive:  # do not leak into the rest of the test run
            os.kill(pid, signal.SIGKILL)
        with open(self.log.name) as f:
            self.final_output = f.read()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code, alive


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
