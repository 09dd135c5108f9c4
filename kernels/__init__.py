"""Triton kernels for the GRPO hot spots, installed as ``spade_mega.kernels`` (never as a top-level ``kernels``).

One op per file, each beside its plain-torch reference; its Triton kernels in ``<op>_triton.py``, imported (with
Triton) only when a kernel runs (``dispatch.kernel_for``), so that with ``kernels.enabled: false`` nothing needs
Triton. Under the Triton interpreter (``TRITON_INTERPRET=1``, set by the test harness when no GPU is present) the
kernels run on CPU; that variable must be set before a kernel is defined.
"""
