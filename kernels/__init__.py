"""Triton kernels, each beside a pure-torch reference (one op per file).

Every op exposes `<op>(...)`, which runs the Triton kernel on CUDA tensors and the
reference elsewhere, plus `<op>_reference(...)` for tests.
"""
