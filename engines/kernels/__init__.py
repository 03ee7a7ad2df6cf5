"""Triton kernels of the CUDA path, and the CPU decode kernel (cpu_attention.c, built with the C compiler
and loaded by cpu_attention.py). The Triton ones are imported only when a backend or op selects them (triton is an
optional dependency). Each has a PyTorch twin that is its oracle in tests, where the kernels run on
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)."""
