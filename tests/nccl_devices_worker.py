"""What tests/test_nccl_devices.py runs in a process of its own (under torchrun for several ranks): every
torch.distributed collective of a real Megatron trainer's work, recorded with the devices of its tensors and the
backend map of its group. Nothing is asserted here; the records go to ``--out`` as JSON.

The recorder replaces torch.distributed's collective functions before Megatron or spade_mega is imported (Megatron
keeps some of them in module globals at import), under both names torch has for them: ``torch.distributed.X`` and
``distributed_c10d.X``, whose object collectives and barrier call the latter. Phases (what the trainer was doing):
``setup`` (process groups, model, optimizer), ``logprobs``, ``train_step``, ``loop`` (the self-play loop's rank-0
broadcast and stop agreement), ``save`` (a checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
                      "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
                      "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier")
HERE = os.path.dirname(os.path.abspath(__file__))
records: list[dict[str, Any]] = []
phase = "setup"


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _caller() -> str:
    """The first frame outside torch and the recorder: the code that asked for the collective."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and not (path == __file__ and frame.f_code.co_name == "wrapper"):
            for root in ("spade_mega", "megatron", "tests", "tools"):
                at = path.rfind(f"{os.sep}{root}{os.sep}")
                if at >= 0:
                    path = path[at + 1:]
                    break
            return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _record(name: str, group: Any, tensors: list[torch.Tensor]) -> None:
    group = group if group is not None else c10d._get_default_group()
    if c10d._rank_not_in_group(group):
        return
    records.append({
        "phase": phase, "op": name, "caller": _caller(),
        # barrier has no tensor: it runs on the device torch picks for the group's object collectives
        "devices": sorted({t.device.type for t in tensors}) or [c10d._get_object_coll_device(group)],
        "numel": sum(t.numel() for t in tensors),
        "config": dist.get_backend_config(group),
        # built without a backend of its own: the default group's map (Megatron's groups but its explicit gloo ones)
        "inherits": dist.get_backend(group) == dist.get_backend(),
        "default": group is c10d._get_default_group()})


def _recording(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        tensors = [t for key, value in bound.items() if key != "group" for t in _tensors(value)]
        _record(name, bound.get("group"), tensors)
        return fn(*args, **kwargs)

    return wrapper


def _recording_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
        for op in p2p_op_list:
            _record("batch_isend_irecv", op.group, [op.tensor])
        return fn(p2p_op_list, *args, **kwargs)

    return wrapper


def install() -> None:
    for name in TENSOR_COLLECTIVES:
        original = getattr(c10d, name)
        wrapped = _recording(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    wrapped = _recording_batch(c10d.batch_isend_irecv)
    c10d.batch_isend_irecv = dist.batch_isend_irecv = wrapped


def batch() -> list:
    sys.path.insert(0, os.path.join(HERE, "megatron"))
    import samples

    return samples.make_batch(0, (16, 12, 10, 14), ((3, 6), (8, -1)))


def main() -> None:
    global phase
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    install()

    from spade_mega.config.loader import apply_overrides, build, to_dict
    from spade_mega.config.schema import SpadeConfig
    from spade_mega.megatron import Trainer
    from spade_mega.megatron.parallel import backend_for, shutdown
    from spade_mega.selfplay.loop import _from_rank0, _StopSignal

    data = to_dict(SpadeConfig())
    data["optimizer"].update(lr=1e-4, clip_grad=1.0)
    data["parallel"]["max_tokens_per_gpu"] = 32
    overrides = ["rl.kl_coef=0.1", "rl.routing_replay=true", "rl.policy_loss=gspo",
                 "rl.loss_aggregation=seq-mean-token-mean", "rl.eps_clip_low=3e-4", "rl.eps_clip_high=4e-4",
                 *args.overrides]
    if torch.cuda.is_available():
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError:  # Megatron's own torch layers on the GPU
            overrides.append("model.transformer_impl=local")
    cfg = build(SpadeConfig, apply_overrides(data, overrides))
    cfg.check()
    trainer = Trainer(cfg)
    samples = batch()
    phase = "logprobs"  # the old policy as the loop takes it: log-probs and, for routing replay, the experts chosen
    values = trainer.old_policy(samples)
    for sample, value in zip(samples, values):
        sample.old_logprobs = value
    phase = "train_step"
    result = trainer.train_step(samples)
    phase = "loop"
    shared = _from_rank0(lambda: {"samples": len(samples)}, share=True)
    with _StopSignal() as stop:
        stopped = stop.agreed(trainer.backend.device)
    phase = "save"
    with tempfile.TemporaryDirectory() as folder:
        if dist.get_world_size() > 1:
            box = [folder]
            dist.broadcast_object_list(box, src=0)  # one folder for all ranks (recorded: a loop-like broadcast)
            folder = box[0]
        trainer.save(folder)
        dist.barrier()
    phase = "done"
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({
            "records": records, "world_size": dist.get_world_size(), "cuda": torch.cuda.is_available(),
            "device": str(trainer.backend.device), "default_config": dist.get_backend_config(),
            "backend_for_here": str(c10d.BackendConfig(backend_for(torch.cuda.is_available()))),
            "finite": all(bool(torch.isfinite(v).all()) for v in values) and
            all(torch.isfinite(torch.tensor(v)) for k, v in result.metrics.items() if k != "grad_norm"),
            "metrics": result.metrics, "shared": shared, "stopped": stopped}))
    trainer.close()
    shutdown()  # as every command on its way out: not an NCCL group left to the interpreter's exit (torch warns of it)


if __name__ == "__main__":
    main()
