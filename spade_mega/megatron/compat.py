"""CPU compatibility for megatron-core: the few patches that let it train on a CPU-only torch over gloo (and the
fixes of upstream bugs that it needs on every device, ``FIXES``).

Megatron-Core is written for CUDA: it hard-codes ``device="cuda"``, CUDA streams and RNG states, CUDA tensor type
names, and collectives that NCCL supports but gloo does not. On a machine without CUDA (laptops, CI) these patches
make the *same* Megatron code paths run on the host, so the CPU tests exercise real TP/SP/EP/PP numerics.

Rules:

- No shim is applied when CUDA is available: GPU runs use megatron-core's device code untouched. The exception is
  ``FIXES``: upstream bugs that are not about the device (a NaN load-balancing loss), patched everywhere.
- Each shim probes for the upstream condition it works around and is applied only when that condition is present;
  the probe's evidence is kept (:func:`installed`). A version of megatron-core that no longer has the condition
  simply skips the shim, so version-specific code stays here and nowhere else (0.16.1, what a plain install on
  Python 3.11 resolves to, lacks some conditions; 0.19.2, what we pin, has them all).
- ``tests/megatron/test_megatron_compat.py`` asserts that every shim is still needed by the pinned version and that each
  patched behaviour is right; the multi-process tests check the numerics end to end. docs/megatron.md says how to
  read a failure after an upgrade.

:func:`install` also silences the notices megatron-core prints for its authors, not our users (``_UPSTREAM_WARNINGS``,
``_UPSTREAM_LOG_NOTICES``): deprecations its own calls raise (a run printed them at every optimizer step) and
import-time notes; `make demo` printed seven of them between its progress lines.

:func:`install` must run before ``megatron.core.pipeline_parallel`` is first imported (see ``paged_stash``): every
function of :mod:`spade_mega.megatron` that imports megatron-core calls it first (importing the package does not).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import types
import warnings
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class Shim:
    """One patch: ``probe()`` returns evidence that the upstream condition holds (or None), ``apply()`` patches."""

    name: str
    upstream: str  # what megatron-core (or torch) does that fails without CUDA
    probe: Callable[[], Optional[str]]
    apply: Callable[[], None]


_installed: Optional[dict[str, str]] = None


def _megatron_core_dir() -> Optional[Path]:
    """Where ``megatron.core`` would be imported from, found without importing it (``megatron`` is a namespace)."""
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "core" / "__init__.py").is_file():
            return Path(location) / "core"
    return None


def _source(module_name: str) -> Optional[str]:
    """The source of a ``megatron.core`` module, read without importing it (None if that version lacks it)."""
    root = _megatron_core_dir()
    if root is None:
        return None
    relative = Path(*module_name.split(".")[2:])
    for path in (root / relative.with_suffix(".py"), root / relative / "__init__.py"):
        if path.is_file():
            return path.read_text()
    return None


def _raises(fn: Callable[[], Any]) -> Optional[str]:
    """The error ``fn`` raises, as evidence, or None when it runs."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - any failure is the evidence we are looking for
        return f"{type(exc).__name__}: {exc}".strip()
    return None


# --- 1. CUDA runtime calls ------------------------------------------------------------------------------------------
# Upstream: ~60 call sites pass device=torch.cuda.current_device() (rotary inv_freq, router aux-loss buffers, p2p
# receive buffers, DDP grad buffers); DDP's grad sync and the MoE all-to-all dispatcher order work with
# torch.cuda.current_stream()/Stream()/stream()/Event(); dist_checkpointing calls torch.cuda.synchronize() (its
# asynchronous save also puts its ranks' write-done flags on torch.cuda.current_device()). A CPU-only torch raises
# "Torch not compiled with CUDA enabled" on each. On the host all work is synchronous, so the device is the CPU, a
# stream is a no-op and an event is always complete.

_CUDA_RUNTIME_CALL = re.compile(r"torch\.cuda\.(current_device|current_stream|Stream|stream|Event|synchronize)\(")
_MEGATRON_PACKAGES = ("transformer", "models/gpt", "models/common", "tensor_parallel", "pipeline_parallel",
                      "distributed", "optimizer", "dist_checkpointing")


class _HostEvent:
    """A CUDA event stand-in: host work is complete when it is recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream stand-in: the host runs everything in order, so ordering calls are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = _HostStream()


def _probe_cuda_runtime() -> Optional[str]:
    if _raises(torch.cuda.current_stream) is None:
        return None
    root = _megatron_core_dir()
    if root is None:
        return None
    sites = sum(len(_CUDA_RUNTIME_CALL.findall(path.read_text()))
                for package in _MEGATRON_PACKAGES for path in (root / package).rglob("*.py"))
    return f"megatron-core makes {sites} torch.cuda runtime calls; this torch has no CUDA" if sites else None


def _apply_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _HOST_STREAM
    cuda.Stream = _HostStream
    cuda.Event = _HostEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()


# --- 2. Model-parallel RNG tracker ----------------------------------------------------------------------------------
# Upstream: tensor_parallel.random.CudaRNGStatesTracker (used by model_parallel_cuda_manual_seed and by every fork()
# around dropout and weight init) saves and restores torch.cuda RNG states; a CPU-only torch raises. On the host the
# "device" generator is the CPU default generator, so the tracker keeps CPU generator states instead.

def _probe_rng_tracker() -> Optional[str]:
    from megatron.core.tensor_parallel import random as mp_random

    return _raises(lambda: mp_random.CudaRNGStatesTracker().add("spade-compat-probe", 0))


def _apply_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    mp_random.CudaRNGStatesTracker.add = add


# --- 3. Hard-coded device="cuda" tensor literals --------------------------------------------------------------------
# Upstream: these modules create small tensors with a literal device="cuda" (the schedules' token counter, the
# optimizers' found-inf / overflow / loss-scale buffers, grad-norm accumulators, the local multi_tensor_l2norm). Each
# module gets a view of ``torch`` whose tensor factories map the "cuda" device to the CPU; nothing else changes.

_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _has_cuda_device_literal(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "device" and isinstance(node.value, ast.Constant) \
                and node.value.value == "cuda":
            return True
    return False


def _modules_with_device_literals() -> list[str]:
    return [name for name in _DEVICE_LITERAL_MODULES if (src := _source(name)) and _has_cuda_device_literal(src)]


def _probe_device_literals() -> Optional[str]:
    found = _modules_with_device_literals()
    return f"device='cuda' literals in {', '.join(found)}" if found else None


class _HostTorch(types.ModuleType):
    """``torch`` as one module sees it: tensor factories put device="cuda" tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
                device = "cpu"
            return fn(*args, device=device, **kwargs)

        return make

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _apply_device_literals() -> None:
    host_torch = _HostTorch()
    for name in _modules_with_device_literals():
        importlib.import_module(name).torch = host_torch


# --- 4. CUDA tensor type names --------------------------------------------------------------------------------------
# Upstream: DistributedOptimizer sorts parameters into fp32 / fp16 groups by ``param.type()`` compared with
# 'torch.cuda.FloatTensor' etc. (raising TypeError otherwise), and clip_grad_by_total_norm_fp32 asserts
# ``grad.type() == 'torch.cuda.FloatTensor'``. While those two run, Tensor.type() reports the CUDA name of a host
# tensor's type ('torch.FloatTensor' -> 'torch.cuda.FloatTensor'); with arguments it is untouched.

_plain_tensor_type = torch.Tensor.type


def _cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _plain_tensor_type(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
        return name
    return "torch.cuda." + name[len("torch."):]


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    torch.Tensor.type = _cuda_named_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = _plain_tensor_type  # type: ignore[method-assign]


def _probe_type_names() -> Optional[str]:
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    clip_error = _raises(lambda: clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=2.0))
    src = _source("megatron.core.optimizer.distrib_optimizer") or ""
    distopt = "'torch.cuda.FloatTensor'" in src
    if not clip_error and not distopt:
        return None
    parts = [f"clip_grad_by_total_norm_fp32 on a host grad: {clip_error}"] if clip_error else []
    parts += ["DistributedOptimizer compares param.type() with 'torch.cuda.FloatTensor'"] if distopt else []
    return "; ".join(parts)


def _within(context: Callable[[], contextlib.AbstractContextManager], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``context()`` (a patch that holds only while the upstream function runs)."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapped


def _apply_type_names() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    clip = _within(_cuda_type_names, clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _within(_cuda_type_names, cls.__init__)


# --- 5. Torch norms under sequence parallelism ----------------------------------------------------------------------
# Upstream: the local (non-Transformer-Engine) layer spec builds norms with WrappedTorchNorm, which asserts
# ``not config.sequence_parallel``; yet MoELayer refuses TP > 1 without sequence parallelism. Build the torch norm as
# usual and tag its parameters ``sequence_parallel = True``, exactly what TENorm does, so finalize_model_grads sums
# their gradients over the tensor-parallel group (each rank saw only its slice of the tokens).

def _probe_torch_norm() -> Optional[str]:
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                               sequence_parallel=True, normalization="RMSNorm")
    return _raises(lambda: torch_norm.WrappedTorchNorm(config=config, hidden_size=8))


def _apply_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, *args, **kwargs)
        unsharded = copy.copy(config)
        unsharded.sequence_parallel = False
        norm = build(cls, unsharded, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


# --- 6. Uneven tensor-parallel collectives over gloo ----------------------------------------------------------------
# Upstream: with TP x EP the all-to-all dispatcher gathers and reduce-scatters tokens across the TP group with uneven
# split sizes (tensor_parallel.mappings._gather_along_first_dim(output_split_sizes=...) and
# _reduce_scatter_along_first_dim(input_split_sizes=...)). Gloo rejects an all_gather of unequal tensors ("invalid
# tensor size") and has no list reduce_scatter. Emulate both: pad to the largest split and all_gather, then trim;
# all_reduce and keep this rank's slice. The even (common) paths are untouched.

def _probe_uneven_collectives() -> Optional[str]:
    from megatron.core.tensor_parallel import mappings

    gather = inspect.signature(mappings._gather_along_first_dim).parameters
    scatter = inspect.signature(mappings._reduce_scatter_along_first_dim).parameters
    if "output_split_sizes" in gather and "input_split_sizes" in scatter:
        return "tensor_parallel.mappings gathers/reduce-scatters with uneven split sizes (gloo rejects them)"
    return None


def _apply_uneven_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    even_gather = mappings._gather_along_first_dim
    even_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
               use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)], 0)

    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                       use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return even_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes), 0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


# --- 7. MoE all-to-all split sizes on the host ----------------------------------------------------------------------
# Upstream: MoEAlltoAllTokenDispatcher moves its split sizes to the host with
# moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA tensors. Host tensors stay
# tensors, and ProcessGroup.all_to_all_single then rejects them as split sizes (TypeError: incompatible function
# arguments). Give the dispatcher a version that turns host tensors into numpy arrays as well, as it does for CUDA.

def _probe_alltoall_splits() -> Optional[str]:
    from megatron.core.transformer.moe import token_dispatcher

    move = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if move is None:
        return None
    moved = move(torch.zeros(2, dtype=torch.long), as_numpy=True)
    return "maybe_move_tensor_to_cpu(host tensor, as_numpy=True) returns a tensor, not the split sizes the " \
           "all-to-all needs" if torch.is_tensor(moved) else None


def _apply_alltoall_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


# --- 8. DistributedOptimizer state with torch's Adam ----------------------------------------------------------------
# Upstream: without Apex or Transformer Engine (no fused Adam: the CPU case) DistributedOptimizer wraps
# torch.optim.Adam, whose per-parameter state also holds a ``step`` tensor. Two code paths assume fused Adam:
# (a) state_dict() reads ``step`` from the per-parameter state and asserts ``len(steps) == 1``, so building the state
#     dict to *load* a checkpoint into a trainer that has not stepped yet fails (empty state). Megatron's own remedy,
#     used for its FSDP format, is to give the state placeholder values first (a zero-gradient step), which the load
#     then overwrites together with the parameters;
# (b) the fully-reshardable loader skips ``step`` in the saved tensors (it restores it separately) but then copies
#     every state tensor of the destination, ``step`` included: KeyError 'step'. Copy only what was loaded;
# (c) load_state_dict() restores that step as ONE tensor shared by every parameter's state, and torch's Adam
#     increments each parameter's step in place: after a resume one update advances the shared step once per
#     parameter, corrupting Adam's bias correction. Give every parameter its own copy.

def _probe_torch_adam() -> Optional[str]:
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return None
    found = []
    if hasattr(cls, "_init_optimizer_states_with_dummy_values") and \
            "assert len(steps) == 1" in inspect.getsource(cls.state_dict):
        found.append("state_dict() asserts on the step of an empty torch Adam state")
    loader = getattr(cls, "load_parameter_state_from_fully_reshardable", None)
    if loader is not None and 'if k == "step"' in inspect.getsource(loader) and \
            "tensors[key]" in inspect.getsource(cls._set_main_param_and_optimizer_states):
        found.append("the fully-reshardable loader drops 'step' but copies every destination state key")
    if 's["step"] = step' in inspect.getsource(cls.load_state_dict):
        found.append("load_state_dict() shares one step tensor between all parameters")
    return "; ".join(found) or None


def _apply_torch_adam() -> None:
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    sharded_state_dict = cls.sharded_state_dict
    set_states = cls._set_main_param_and_optimizer_states

    def sharded_state_dict_for_loading(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                                       *args: Any, **kwargs: Any) -> Any:
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    def set_loaded_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        missing = {key: None for key in self.optimizer.state.get(main_param, {}) if key not in tensors}
        set_states(self, model_param, {**tensors, **missing})  # None entries are skipped upstream

    load_state_dict = cls.load_state_dict

    def load_unshared_steps(self: Any, state_dict: Any) -> None:
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    cls.sharded_state_dict = sharded_state_dict_for_loading
    cls._set_main_param_and_optimizer_states = set_loaded_states
    cls.load_state_dict = load_unshared_steps


# --- 9. MoE paged-stash kernels without triton ----------------------------------------------------------------------
# Upstream (megatron-core >= 0.18): pipeline_parallel.schedules imports transformer.moe.paged_stash, which imports
# transformer.moe.ops.paged_stash, whose first line is ``import triton`` (kernels of the GPU-only moe_paged_stash
# feature). CPU machines without triton (macOS, minimal CI) could not import the schedules at all. Register a
# stand-in for that one module whose kernels raise if ever called; triton itself is not faked.

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _probe_paged_stash() -> Optional[str]:
    if _PAGED_STASH in sys.modules or _triton_importable():
        return None
    src = _source(_PAGED_STASH)
    if src is None:
        return None
    imports_triton = any(isinstance(node, ast.Import) and any(a.name == "triton" for a in node.names)
                         for node in ast.parse(src).body)
    return f"{_PAGED_STASH} imports triton at module level; triton is not installed" if imports_triton else None


def _apply_paged_stash() -> None:
    stand_in = types.ModuleType(_PAGED_STASH, "Stand-in: the paged-stash triton kernels need triton and a GPU.")
    stand_in.GLOBAL_BLOCK_SIZE = 1024

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("moe_paged_stash needs triton and a CUDA GPU; it is unavailable on this machine")

    stand_in.paged_stash_copy_kernel = unavailable
    stand_in.paged_stash_pop_kernel = unavailable
    stand_in.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = stand_in


# --- 10. Tied embeddings across pipeline stages ---------------------------------------------------------------------
# Upstream: with tied embeddings (model.tie_embeddings) and pipeline > 1 the last stage keeps a copy of the word
# embeddings as its output layer. LanguageModule.setup_embeddings_and_output_layer zeroes that copy and all-reduces
# it with the first stage's embedding over the embedding group so both start equal, after ``weight.data.cuda()``,
# which raises on a CPU-only torch. While that method runs, Tensor.cuda() leaves a host tensor where it is (the
# all-reduce then runs over gloo). The gradients of the two copies are summed by finalize_model_grads, which needs
# no shim.

_plain_tensor_cuda = torch.Tensor.cuda


def _stay_on_host(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@contextlib.contextmanager
def _host_cuda_moves() -> Iterator[None]:
    torch.Tensor.cuda = _stay_on_host  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = _plain_tensor_cuda  # type: ignore[method-assign]


def _probe_tied_embeddings() -> Optional[str]:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    moved = ".cuda()" in inspect.getsource(LanguageModule.setup_embeddings_and_output_layer)
    error = _raises(lambda: torch.zeros(1).cuda())
    if moved and error:
        return f"LanguageModule.setup_embeddings_and_output_layer moves the tied output weight with .cuda(): {error}"
    return None


def _apply_tied_embeddings() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _within(
        _host_cuda_moves, LanguageModule.setup_embeddings_and_output_layer)


# --- Upstream fixes (every device) ---------------------------------------------------------------------------------
# Not CPU shims: bugs of megatron-core itself, patched with CUDA too, with the same probe pattern.
#
# aux_loss_all_padding. Upstream: with a padding_mask the routers count a micro-batch's tokens as the routed real
# tokens (moe_utils.get_tokens_per_expert_and_token_count: routing-map sum / topk) and divide the load-balancing loss
# by that count squared. A micro-batch that is all padding (the trainer's empty micro-batches, which keep
# data-parallel ranks in step) has 0 tokens: the loss is 0 * inf = NaN, and so are the router gradients (the
# optimizer then skips the step). The z-loss of the same function family clamps its count to >= 1; clamp this one the
# same way, so that a micro-batch without real tokens adds a zero loss and zero gradients.

def _probe_aux_loss_all_padding() -> Optional[str]:
    from megatron.core.transformer.moe import moe_utils

    count = getattr(moe_utils, "get_tokens_per_expert_and_token_count", None)
    if count is None:  # a version without padding_mask support: nothing to fix
        return None
    counts_routed = "global_tokens_per_expert.sum() / topk" in inspect.getsource(count)
    empty = torch.zeros(2, 4)
    loss = moe_utils.switch_load_balancing_loss_func(empty, empty.sum(0), torch.tensor(0.0), topk=1, num_experts=4,
                                                     moe_aux_loss_coeff=1.0)
    if counts_routed and not bool(torch.isfinite(loss)):
        return "get_tokens_per_expert_and_token_count counts an all-padding micro-batch as 0 tokens, and the " \
               f"load-balancing loss of 0 tokens is {float(loss)}"
    return None


def _apply_aux_loss_all_padding() -> None:
    from megatron.core.transformer.moe import moe_utils, router

    count = moe_utils.get_tokens_per_expert_and_token_count

    def clamped_count(routing_map: torch.Tensor, reduce_group: Any, topk: Optional[int] = None,
                      with_padding_mask: bool = False) -> Any:
        per_expert, local, total = count(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        if with_padding_mask:
            total = torch.clamp(total, min=1.0)
        return per_expert, local, total

    moe_utils.get_tokens_per_expert_and_token_count = clamped_count
    router.get_tokens_per_expert_and_token_count = clamped_count  # imported by name there


FIXES: tuple[Shim, ...] = (
    Shim("aux_loss_all_padding", "load-balancing loss of an all-padding micro-batch is NaN",
         _probe_aux_loss_all_padding, _apply_aux_loss_all_padding),
)


SHIMS: tuple[Shim, ...] = (
    Shim("paged_stash", "schedules import a triton-only MoE kernel module", _probe_paged_stash, _apply_paged_stash),
    Shim("cuda_runtime", "torch.cuda device/stream/event/synchronize calls", _probe_cuda_runtime,
         _apply_cuda_runtime),
    Shim("rng_tracker", "model-parallel RNG tracker keeps torch.cuda RNG states", _probe_rng_tracker,
         _apply_rng_tracker),
    Shim("device_literals", "tensors created with a literal device='cuda'", _probe_device_literals,
         _apply_device_literals),
    Shim("type_names", "parameters classified by 'torch.cuda.*Tensor' type names", _probe_type_names,
         _apply_type_names),
    Shim("torch_norm_sp", "local-spec norms refuse sequence parallelism", _probe_torch_norm, _apply_torch_norm),
    Shim("uneven_collectives", "uneven TP all_gather / reduce_scatter (TP x EP dispatch) over gloo",
         _probe_uneven_collectives, _apply_uneven_collectives),
    Shim("alltoall_splits", "MoE all-to-all split sizes left as host tensors", _probe_alltoall_splits,
         _apply_alltoall_splits),
    Shim("torch_adam", "distributed-optimizer checkpoints with torch Adam (no fused Adam)", _probe_torch_adam,
         _apply_torch_adam),
    Shim("tied_embeddings", "tied output layer moved with .cuda() to sync across pipeline stages",
         _probe_tied_embeddings, _apply_tied_embeddings),
)


def install() -> dict[str, str]:
    """Apply the shims (without CUDA) and fixes whose upstream condition is present, once. Returns name -> evidence."""
    global _installed
    if _installed is not None:
        return dict(_installed)
    _quiet_upstream_notices()  # first: the shims' probes import megatron-core modules that warn at import
    applied: dict[str, str] = {}
    for shim in (SHIMS if not torch.cuda.is_available() else ()) + FIXES:
        evidence = shim.probe()
        if evidence:
            shim.apply()
            applied[shim.name] = evidence
    _installed = applied
    return dict(applied)


# Notices megatron-core prints that ask its authors, not our users, to act: deprecations its own calls raise (a run
# printed them at every optimizer step and at the first save; its own default cuda_graph_modules "full" warns that
# "full" is deprecated), import-time notes on parts we do not use (Apex and Transformer Engine fallbacks: the local
# spec, torch's norm and optimizers are the CPU path by design, and model.transformer_impl decides TE on GPUs; the
# experimental MIMO model), torch's warning about the non-leaf .grad its optimizer probes, GPTModel's deprecation in
# favour of HybridModel, DDP computing the parameter layout itself (megatron-core < 0.19 takes none), and torch's
# distributed checkpoint on megatron-core's calls at every resume. Each is
# matched by its text and, where it can be, its module, so the same text raised by our code still shows.
_UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning, ""),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
    (r"Transformer Engine and Apex are not installed\. Falling back", UserWarning, r"(megatron\.core\.|megatron_fsdp)"),
    (r"full scope is deprecated", UserWarning, r"megatron\.core\.transformer\.transformer_config"),
    (r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\."),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor", UserWarning, r"megatron\.core\.optimizer\."),
    # torch's distributed checkpoint, as megatron-core's loader calls it at every resume: no_dist=True (each rank
    # reads its own shards, by design), the reader passed by position, ShardedTensor-based plans
    (r"torch\.distributed is disabled, unavailable or uninitialized", UserWarning, r"torch\.distributed\.checkpoint\."),
    (r"The argument order of load has been changed", UserWarning, r"torch\.distributed\.checkpoint\."),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint\."),
)
_UPSTREAM_LOG_NOTICES = {
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.distributed.distributed_data_parallel": "DistributedDataParallel: full_param_layout not provided",
}


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_upstream_notices() -> None:
    for message, category, module in _UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in _UPSTREAM_LOG_NOTICES.items():
        logging.getLogger(name).addFilter(_DropNotice(prefix))


def installed() -> dict[str, str]:
    """The shims and fixes applied by :func:`install` (empty before it ran), with the evidence for each."""
    return dict(_installed or {})


# --- Version adapters (not CPU shims): APIs that moved between supported megatron-core versions ---------------------

def reset_moe_metrics() -> None:
    """Empty megatron-core's MoE metrics tracker. It is process-global and sizes each metric by the layer count of the
    first model that records it: a later model with more layers in the same process (a second Trainer) indexed past
    it (IndexError in the router). The trainer starts every step from an empty tracker, sized by its own model.

    megatron-core >= 0.17: ``moe_logging``'s tracker object; 0.16: the dict of ``moe_utils``."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


@contextlib.contextmanager
def moe_aux_loss_scaled(config: Any, factor: float) -> Iterator[None]:
    """Within it, the schedule scales the gradient of the MoE load-balancing loss by ``factor`` on top of its own
    ``grad_scale_func / num_microbatches`` (``config.moe_grad_scale_func``, the schedule's hook for that scale; set
    back to unset after). A factor of 1 sets nothing. megatron-core without the hook (< 0.19) keeps its own scale,
    with a warning."""
    if factor == 1.0:
        yield
        return
    if not any(f.name == "moe_grad_scale_func" for f in dataclasses.fields(config)):
        warnings.warn("this megatron-core has no moe_grad_scale_func: the MoE load-balancing loss's gradient is "
                      "averaged over the all-padding micro-batches too", RuntimeWarning)
        yield
        return

    def scale() -> torch.Tensor:
        # on the trainer's device, as the schedule's own call: the optimizer's loss scale is a tensor there
        # (torch.cuda.current_device() is the CPU under the compatibility layer)
        one = torch.ones(1, device=torch.cuda.current_device())
        return (config.grad_scale_func(one) if config.grad_scale_func is not None else one) * factor

    config.moe_grad_scale_func = scale
    try:
        yield
    finally:
        config.moe_grad_scale_func = None


def moe_load_balancing_loss(num_layers: int, num_micro_batches: float) -> Optional[float]:
    """The router load-balancing loss (without its coefficient) recorded since the last call, averaged over layers
    and ``num_micro_batches`` (each rank's values are divided by it before the data-parallel average; a fraction
    where ranks hold different numbers of real micro-batches) and reduced across ranks; the tracker is cleared.
    Collective: every rank must call it.

    megatron-core >= 0.17 keeps MoE metrics in ``moe_logging.get_moe_metrics_tracker()``; 0.16 in
    ``moe_utils.track_moe_metrics``."""
    totals: dict[str, torch.Tensor] = {}
    kwargs = dict(loss_scale=1.0 / num_micro_batches, iteration=0, total_loss_dict=totals, force_initialize=True,
                  track_names=["load_balancing_loss"], num_layers=num_layers)
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        track_moe_metrics(**kwargs)
    else:
        get_moe_metrics_tracker().report(**kwargs)
    value = totals.get("load_balancing_loss")
    return None if value is None else float(value)


def norm_overflow_skip() -> dict[str, float]:
    """``OptimizerConfig`` arguments under which Megatron's own step skips an update whose global gradient norm is
    inf (finite gradients overflow a float32 norm from ~1.8e19), judged on the norm its step computes anyway: one
    prepare_grads (the main-gradient copy) and one norm pass per step, none asked again beforehand.

    megatron-core 0.19 (pinned) has ``grad_norm_skip_threshold``: ChainedOptimizer.step (what get_megatron_optimizer
    always builds) compares its norm with it after prepare_grads and get_grad_norm and then skips
    step_with_ready_grads; only inf exceeds the largest finite float32. 0.16 lacks it: {} (the trainer then asks the
    norm itself before the step, one more pass)."""
    from megatron.core.optimizer import OptimizerConfig

    if "grad_norm_skip_threshold" not in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        return {}
    return {"grad_norm_skip_threshold": float(torch.finfo(torch.float32).max)}
