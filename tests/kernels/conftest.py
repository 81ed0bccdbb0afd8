"""Kernel tests run the Triton kernels on the GPU when there is one, else on the CPU through
the Triton interpreter. TRITON_INTERPRET must be set before any kernel module is imported
(triton reads it when a kernel is decorated), so it is set here, at conftest import."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
