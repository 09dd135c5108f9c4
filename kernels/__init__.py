"""Triton kernels for the GRPO hot spots, installed as ``spade_mega.kernels`` (never as a top-level ``kernels``).

One op per file: its Triton kernels beside its plain-torch reference. Triton is optional: an op module defines its
kernels only where Triton imports, so that with ``kernels.enabled: false`` nothing needs it (``dispatch.kernel_for``
refuses ``kernels.enabled`` without it). Under the Triton interpreter (``TRITON_INTERPRET=1``, set by the test
harness when no GPU is present) the kernels run on CPU; that variable must be set before a kernel is defined, that
is before an op module is first imported.
"""
