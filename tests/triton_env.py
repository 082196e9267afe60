"""The Triton kernel tests' shared preamble: the module is skipped where triton is not
installed; kernels run compiled on CUDA when there is a GPU, else in Triton's CPU
interpreter (conftest.py sets TRITON_INTERPRET=1 before any test module loads: triton reads
it when first imported). Import it before any specscope module that imports triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
