"""Loaded at start-up by every Python process of tools/peer_suite.py's test run (this folder is
on its PYTHONPATH: pytest, and the subprocess in which vLLM inspects a model class).

vLLM's llava module imports transformers' image processors, which import torchvision. The only
torchvision on the package registries for torch 2.13 is the CUDA build, whose compiled operators
cannot load next to the CPU build of torch; its Python side works, except that importing it
registers fake kernels for two of those operators (``nms``, ``qnms``) without checking that they
exist. Before torchvision is first imported, and only in that situation (torchvision's
``torchvision/version.py`` says ``+cu...``, torch has no CUDA), declare the two operators' schemas so that
the import succeeds; calling them still fails, as it would. The scheduler tests never call them: they only size encoder inputs.
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)  # once; then let the ordinary finders import it
            _declare_if_unloadable()
        return None


def _declare_if_unloadable() -> None:
    import importlib.machinery
    import os
    import re

    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), encoding="utf-8") as f:
            cuda_build = re.search(r"__version__ = '[^']*\+cu\d+'", f.read()) is not None
    except OSError:
        return
    import torch

    if cuda_build and torch.version.cuda is None:
        for op in ("nms", "qnms"):
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


sys.meta_path.insert(0, _DeclareTorchvisionOps())
