"""Distributed checkpoints of the trainer: model, optimizer state and learning-rate schedule, in Megatron's
``torch_dist`` format, loadable by any other parallel layout (TP / PP / EP / DP reshard on load).

Atomic: every rank writes into ``root/.step_<N>.partial-<id>``; once all ranks are done, rank 0 adds the manifest
``spade_checkpoint.json``, fsyncs the files and renames the folder to ``root/step_<N>``. A folder is a checkpoint only
if it has that name *and* the manifest, so a save killed at any point leaves either nothing new or a hidden partial
folder that loading refuses and the next save removes (a same-step checkpoint being replaced is set aside, not
deleted, until its replacement is in place; a step folder without a manifest, which no save wrote, is never
replaced). The newest checkpoint is found by scanning (no ``latest`` pointer that could disagree with the folders).

A save that fails (a full disk, a read-only folder, a writer killed) fails on every rank alike, naming the failing
rank and its error: each step that one rank runs alone (rank 0's folder operations and the completion: torch's
``.metadata``, Megatron's ``metadata.json``, the manifest, the rename, pruning) and each rank's own write end in one
agreement over all ranks (a gather or broadcast that every rank reaches, failed or not). Megatron completes a save
itself with collectives *around* its coordinator's writes, so a failure there on rank 0 left the other ranks in a
broadcast or barrier until the collective timeout; :class:`_SaveFiles` completes it instead. A failed save's partial
folder is removed (it can never be completed: its space is what a full disk needs back), the earlier checkpoints stay.

The optimizer state is saved ``fully_reshardable`` (per parameter, not as Megatron's internal flat buffers), which is
what lets a different layout load it; before the first update there is no optimizer state and only the model is saved.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import queue
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

from spade_mega.errors import SpadeError
from spade_mega.files import fsync_path
from spade_mega.tokenizer import describe_tokenizer, same_tokenizer, tokenizer_identity

if TYPE_CHECKING:
    from spade_mega.megatron.train import Trainer

MANIFEST = "spade_checkpoint.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Optimizer state per parameter (any layout can load it), gathered over gloo on each data-parallel group's first rank
# rather than all-gathered on every rank, and keyed by parameter name only: a layout with separate dense and expert
# optimizers (EP, or a different expert-data-parallel group) and one with a single optimizer use the same keys.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                       "distrib_optim_fully_reshardable_mem_efficient": True,
                       "chained_optim_avoid_prefix": True}


T = TypeVar("T")
log = logging.getLogger("spade_mega.megatron")


class CheckpointError(SpadeError):
    """A checkpoint that cannot be used (missing, incomplete, or from an incompatible model)."""


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and (path / MANIFEST).is_file()


def find_latest(root: str | Path) -> Optional[Path]:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return max(complete, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)  # type: ignore[union-attr]


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: is a file, not a checkpoint folder: give a step_<N> folder or the folder "
                              "holding them")
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST} in a step_<N> folder): "
                              "its save was interrupted; load an earlier one")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path / MANIFEST}: invalid JSON ({exc.msg})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path / MANIFEST}: must hold a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, this version reads "
                              f"{FORMAT_VERSION}")
    step = manifest.get("step")
    if type(step) is not int or step != int(_STEP_DIR.match(path.name).group(1)):  # type: ignore[union-attr]
        raise CheckpointError(f"{path / MANIFEST}: step {step!r} does not match the folder name {path.name} "
                              "(resuming orders checkpoints by it): a renamed copy? give it its step's name")
    if not isinstance(manifest.get("architecture"), dict):
        raise CheckpointError(f"{path / MANIFEST}: no model architecture recorded (an object of model fields), got "
                              f"{manifest.get('architecture')!r}: not a manifest that save_checkpoint wrote")
    return manifest


def _failure(exc: BaseException) -> str:
    """One line naming what went wrong; torch's CheckpointException carries each failing rank's own error."""
    failures = getattr(exc, "failures", None)
    where = ""
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = next(iter(failures.items()))
        where = f"rank {rank}: "
    lines = str(exc).strip().splitlines()
    return f"{where}{type(exc).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _storage_errors(message: Callable[[str], str]) -> Iterator[None]:
    """Failures of the storage layer as a CheckpointError (``message`` of the one-line failure). torch's
    CheckpointException derives from BaseException, so without this it would escape every ``except Exception`` of a
    caller and end the run with a page of traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(message(_failure(exc))) from exc


def _reading(path: Path) -> contextlib.AbstractContextManager[None]:
    """A file of a checkpoint with a manifest missing, truncated or overwritten: an error naming the folder."""
    return _storage_errors(lambda failure: f"{path}: cannot be loaded ({failure}): its files are damaged or do not "
                                           "match this model; load another checkpoint")


def _cannot_write(path: Path) -> Callable[[str], str]:
    return lambda failure: f"{path}: cannot save a checkpoint there ({failure}); no earlier checkpoint was removed"


def _writing(path: Path) -> contextlib.AbstractContextManager[None]:
    return _storage_errors(_cannot_write(path))


def _on_rank0(action: Callable[[], T], message: Callable[[str], str]) -> T:
    """``action``'s result on every rank, run by rank 0 alone (the folder operations of a save); if it fails, every
    rank raises the same CheckpointError (``message`` of the failure, or the CheckpointError ``action`` raised), where
    a failure on rank 0 alone would leave the others waiting in the next collective."""
    outcome: list[Any] = [None, None]
    error: Optional[CheckpointError] = None
    if dist.get_rank() == 0:
        try:
            with _storage_errors(message):
                outcome = [action(), None]
        except CheckpointError as exc:
            error, outcome = exc, [None, str(exc)]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


def _model_state(trainer: "Trainer") -> dict[str, Any]:
    chunks = [chunk.module for chunk in trainer.model]  # unwrap DDP
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _optimizer_has_state(trainer: "Trainer") -> bool:
    """False until the first update: Adam has no moments yet, and Megatron cannot describe an empty state."""
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return any(len(opt.optimizer.state) for opt in optimizers)


def _sharded_state(trainer: "Trainer", is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
    state = _model_state(trainer)
    if with_optimizer:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                                  metadata=_OPTIMIZER_METADATA)
    state["scheduler"] = trainer.scheduler.state_dict()
    state["step"] = trainer.step
    return state


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# Hyper-parameters the learning-rate scheduler owns: not part of a param group's identity across a resume.
_SCHEDULED = ("max_lr", "min_lr", "start_wd", "end_wd")


def _matching_group(current: dict[str, Any], saved_groups: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """The saved param group (hyper-parameters and Adam's step) with the same identity as ``current``: Megatron's
    identifier keys, except the scheduled values and whether the group belongs to an expert optimizer (a property of
    the layout). The result carries ``current``'s identifiers, which is how Megatron pairs them up when loading."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    keys = [k for k in param_group_identifier_keys if k != "is_expert_parallel" and k not in _SCHEDULED]
    same = [g for g in saved_groups if all(g.get(k) == current.get(k) for k in keys)]
    if not same:
        raise CheckpointError(f"{path}: no saved optimizer parameter group matches "
                              f"{ {k: current.get(k) for k in keys} }")
    chosen = next((g for g in same if g.get("is_expert_parallel") == current.get("is_expert_parallel")), same[0])
    return {**chosen, **{k: current[k] for k in param_group_identifier_keys if k in current}}


def _restructure_optimizer_state(trainer: "Trainer", loaded: Any, path: Path) -> Any:
    """The loaded optimizer state in the structure of this trainer's optimizer.

    Megatron chains one optimizer per gradient-reduction domain: dense parameters, and experts when they reduce over
    their own expert-data-parallel group (EP > 1, or expert TP != TP). So an EP layout saves two entries and a TP1
    layout expects one, though the content is the same: the per-parameter tensors (keyed by parameter name) load
    either way, and the parameter groups (hyper-parameters and Adam's step) are matched by identity."""
    from megatron.core import dist_checkpointing

    optimizers = _chained(trainer.optimizer)
    saved = dist_checkpointing.load_common_state_dict(str(path))["optimizer"]
    saved_entries = [saved[k] for k in sorted(saved)] if all(isinstance(k, int) for k in saved) else [saved]
    param_states = [loaded[i]["param_state"] for i in range(len(optimizers))] if len(optimizers) > 1 \
        else [loaded["param_state"]]
    groups = [g for entry in saved_entries for g in entry["optimizer"]["param_groups"]]
    adapted = [{**saved_entries[0], "param_state": param_state,
                "optimizer": {"param_groups": [_matching_group(g, groups, path) for g in opt.optimizer.param_groups]}}
               for opt, param_state in zip(optimizers, param_states)]
    return adapted[0] if len(adapted) == 1 else dict(enumerate(adapted))


def _reidentify_param_groups(trainer: "Trainer", loaded: Any, path: Path) -> Any:
    """The non-distributed optimizer's loaded state with each parameter group given this run's identifiers (matched
    as :func:`_matching_group` does). Megatron pairs saved and current groups by identifiers that include the
    learning rate and weight decay, so a resume with another optimizer.lr or weight_decay found no group and failed;
    the config wins for those (see :func:`_apply_configured_hyperparameters`). The same layout saved it (checked),
    so the groups are in the same order and each keeps its position's parameters."""
    optimizers = _chained(trainer.optimizer)
    entries = [loaded] if len(optimizers) == 1 else [loaded[i] for i in range(len(optimizers))]
    for opt, entry in zip(optimizers, entries):
        torch_state = entry["optimizer"] if "optimizer" in entry else entry  # mixed precision nests torch's state
        saved = torch_state["param_groups"]
        torch_state["param_groups"] = [{**_matching_group(current, saved, path), "params": group["params"]}
                                       for current, group in zip(opt.optimizer.param_groups, saved)]
    return loaded


def _architecture(trainer: "Trainer") -> dict[str, Any]:
    m = trainer.model_cfg
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "ffn_hidden_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "vocab_size",
            "tie_embeddings", "qk_layernorm")  # every field that changes the set or shapes of the parameters
    return {k: getattr(m, k) for k in keys}


def _recover(root: Path) -> None:
    """Tidy what a killed save left: partial folders and checkpoints half-deleted by ``keep`` go; a complete
    checkpoint set aside to be replaced by a save of the same step comes back if its replacement never arrived."""
    for stale in [*root.glob(".step_*.partial-*"), *root.glob(".step_*.pruned-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    for replaced in root.glob(".step_*.replaced-*"):
        original = root / replaced.name[1:].split(".replaced-")[0]
        if original.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(replaced, original)


def _prune(root: Path, keep: int, saved: Path) -> None:
    """Delete all but the ``keep`` highest-step complete checkpoints, never ``saved`` (the one just written: a run
    continued from an earlier step writes below the steps of the run it replaced). Each is renamed out of the
    checkpoints first, so a save killed while deleting one leaves no step folder with its manifest but not its data."""
    complete = sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)),
                      key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]
    for old in complete[:-keep] if keep > 0 else []:
        if old != saved:
            doomed = root / f".{old.name}.pruned-{uuid.uuid4().hex[:12]}"
            try:  # best effort, like the deletion: the new checkpoint is already in place
                os.rename(old, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)


class _ResultsFile:
    """Megatron's write-results queue for a write in a forked process (``put`` there, ``get_nowait`` here): a file in
    the checkpoint's partial folder. Megatron's default, a multiprocessing Manager queue, starts a helper by 'spawn',
    which re-imports the main module (see :func:`_write_results_to`); a pipe between the two processes (a
    multiprocessing queue) blocks the writer's exit once the results outgrow the pipe's buffer, so the write would
    never be seen to end. The file holds, beside the results, when this rank's write ended by the writer's clock (a
    network file system's modification times are the server's)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.finished_at: Optional[float] = None

    def put(self, item: Any) -> None:
        try:
            data = pickle.dumps((time.time(), item))
        except Exception as exc:  # an exception that cannot be pickled still says what failed
            data = pickle.dumps((time.time(), RuntimeError(f"{item!r} (not picklable: {exc})")))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    def get_nowait(self) -> Any:
        try:
            self.finished_at, item = pickle.loads(self.path.read_bytes())
        except FileNotFoundError:
            raise queue.Empty from None
        with contextlib.suppress(OSError):  # a folder turned read-only: the completion's own write says so
            self.path.unlink()
        return item


def _write_results_to(results: Any) -> None:
    """Where Megatron's writer reports the results of this process's next save (it creates, on a process's first
    save, a multiprocessing Manager started by 'spawn'. Spawn re-imports the main module: a training script with its
    code at top level ran again in that helper, and the save failed with a bare EOFError, or under torchrun hung for
    ever (the re-run joined the job)). A synchronous save writes and reads back in this process: a plain queue
    serves. An asynchronous one writes in a forked process: a :class:`_ResultsFile`."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = results


def _begin_save(trainer: "Trainer", root: Path, keep: Optional[int],
                tokenizer_assumed_for: Optional[str]) -> tuple[Path, dict[str, Any], Callable[[], None]]:
    """The partial folder a save writes into, the state to write, and the completion that rank 0 runs once every
    rank's files are written (manifest, rename to ``step_<N>``, pruning). The manifest is taken now: an
    asynchronous save completes after later steps changed the trainer."""
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be >= 1 (the checkpoint just saved is always kept; None keeps all), "
                              f"got {keep}")
    final = step_dir(root, trainer.step)

    def start() -> Path:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        if (final.exists() or final.is_symlink()) and not (final.is_dir() and is_complete(final)):
            raise CheckpointError(f"{final}: exists but is not a complete checkpoint (no {MANIFEST}), so no save "
                                  "wrote it; a save replaces only its own checkpoints: move it away or save elsewhere")
        partial = root / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
        partial.mkdir()
        return partial

    partial = _on_rank0(start, _cannot_write(root))
    with_optimizer = _optimizer_has_state(trainer)
    manifest = {"format": FORMAT_VERSION, "step": trainer.step, "optimizer_state": with_optimizer,
                "distributed_optimizer": trainer.cfg.optimizer.distributed, "layout": trainer.layout.describe(),
                "world_size": trainer.layout.world_size, "architecture": _architecture(trainer),
                "tokenizer": {**tokenizer_identity(trainer.cfg.model.tokenizer),
                              **({"assumed_for": tokenizer_assumed_for} if tokenizer_assumed_for else {})}}

    def finish() -> None:
        manifest["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync_tree(partial)
        if final.exists():  # the same step saved before: replace it only now that the new one is complete
            old = root / f".{final.name}.replaced-{uuid.uuid4().hex[:12]}"
            os.rename(final, old)
            try:
                os.rename(partial, final)
            except OSError:
                os.rename(old, final)  # the replaced checkpoint back in place: the failed save leaves it as it was
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, final)
        step = f"syncing {root}"  # the checkpoint is complete and in place from here: a failure must not say otherwise
        try:
            fsync_path(root)
            step = "pruning the older checkpoints"
            if keep is not None:
                _prune(root, keep, final)
        except OSError as exc:
            raise CheckpointError(f"{final}: saved and in place, but {step} failed afterwards ({_failure(exc)}); "
                                  "check that file system") from exc

    state = _sharded_state(trainer, is_loading=False, with_optimizer=with_optimizer)
    return partial, state, finish


@functools.cache
def _plan_keeping_strategy() -> type:
    """Megatron-Core's ``torch_dist`` save strategy, keeping its plan (the storage writer, the global metadata on the
    coordinator, the process group's wrapper) for :class:`_SaveFiles`, which completes the save in Megatron's stead."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class PlanKeeping(TorchDistSaveShardedStrategy):  # type: ignore[misc]
        plan: Optional[tuple[Any, Any, Any]] = None

        def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any, async_strategy: Any) -> Any:
            self.plan = save_state_dict_ret
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, async_strategy)

    return PlanKeeping


def _write_files(transforms: list[Any], rank: int, buckets: list[Any], results: Any) -> None:
    """This rank's files of a save, one per bucket, each by Megatron's own file writer, then the results (or the first
    failure, as raised) to ``results``; never raises. In place of Megatron's wrapper, which reported a file that
    failed (a full disk) as 'error: <class 'OSError'>', the error itself only in its log, and whose thread workers'
    failures escaped it with no results: a foreground save then raised on that rank alone, its peers waiting."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    written: dict[int, Any] = {}
    try:
        for i, bucket in enumerate(buckets):
            _, output = FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, None, None, True)
            if isinstance(output, BaseException):
                results.put(output)
                return
            written[i] = output
    except Exception as exc:
        results.put(exc)
        return
    results.put(written)


def _writer_failure(writer: Any) -> Optional[str]:
    """How a background writer process that did not return ended: a signal (SIGKILL is the kernel's OOM killer unless
    someone sent it) or an exit status; None if it returned (or none was started)."""
    code = None if writer is None else writer.exitcode
    if not code:
        return None
    if code > 0:
        return (f"its background writer (pid {writer.pid}) exited with status {code} before reporting its files (its "
                "error is in this rank's log)")
    name = signal.Signals(-code).name
    why = (": the kernel's OOM killer, unless someone sent it (see dmesg); the writer's copy-on-write pages grow as "
           "training changes the weights it saves, so the host needs up to the rank's state again in free memory"
           if -code == signal.SIGKILL else "")
    return f"its background writer (pid {writer.pid}) was killed by {name}{why}"


def _first_failure(failure: Optional[str]) -> Optional[tuple[int, str]]:
    """The first rank's failure of a step that each rank runs on its own, and that rank (None: none failed), on every
    rank (an all-gather): every rank raises it, where one alone would leave the others waiting in the next
    collective."""
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next(((rank, message) for rank, message in enumerate(failures) if message is not None), None)


class _SaveFiles:
    """One save's files: planned by Megatron-Core (``dist_checkpointing.save``, a collective), written by each rank
    (:meth:`write_here`, or a forked writer), then made the checkpoint by :meth:`complete`, one agreement of all ranks
    in place of Megatron's completion."""

    def __init__(self, state: dict[str, Any], partial: Path, final: Path, finish: Callable[[], None], results: Any,
                 *, background: bool) -> None:
        from megatron.core import dist_checkpointing

        strategy = _plan_keeping_strategy()()
        failure = None
        try:  # planning's collectives, then each rank alone stages its tensors to write (host memory: it may fail)
            with _storage_errors(lambda failure: failure):
                # "mcore": Megatron-Core's own asynchronous writer (NVIDIA resiliency-ext's is the other, not installed)
                request = dist_checkpointing.save(state, str(partial), sharded_strategy=strategy,
                                                  async_sharded_save=True, async_strategy="mcore")
        except CheckpointError as exc:
            failure = str(exc)
        failed = _first_failure(failure)
        if failed is not None:
            if dist.get_rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(f"{final}: preparing this checkpoint's files failed (rank {failed[0]}: {failed[1]}); "
                                  "nothing was written, no earlier checkpoint was removed")
        self.writer, self.metadata, self.group = strategy.plan
        self.config = (strategy.backend, strategy.version)
        write = None if request.async_fn is None else functools.partial(_write_files, request.async_fn.args[0])
        if write is not None and background:
            write = _dying_with_trainer(write)
        self.request = request._replace(async_fn=write, finalize_fns=[])
        self.partial, self.final, self.results, self.background = partial, final, results, background
        self._finish = finish
        self.started = time.time()

    def write_here(self) -> Optional[str]:
        """This rank's files, written in this process; what failed (None: the results are in ``results``)."""
        try:
            args = list(self.request.async_fn_args)
            if self.request.preload_fn is not None:  # device to host
                args[1] = self.request.preload_fn()
            if self.request.async_fn is not None:
                self.request.async_fn(*args, **self.request.async_fn_kwargs)
        except Exception as exc:
            return _failure(exc)
        return None

    def _left(self) -> str:
        where = "its partial folder was removed" if not self.partial.exists() else \
            f"its files are left in the hidden folder {self.partial.name}: loading refuses it, the next save removes it"
        return f"it was not completed ({where}), the previous checkpoint stays the newest"

    def complete(self, failure: Optional[str]) -> float:
        """Make the written files the checkpoint, on every rank (collective). Each rank's write results, or its
        ``failure``, are gathered on rank 0, which writes torch's ``.metadata``, Megatron's ``metadata.json`` and the
        manifest and renames the folder; one failure anywhere (a rank's write, a step of rank 0's) is raised on every
        rank, naming the rank and its error, with the partial folder removed. Returns the seconds the slowest rank's
        background write took (by its writer's clock, see :class:`_ResultsFile`; 0 for a foreground one)."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

        results = None
        if failure is None:
            try:  # a list, or torch's wrapped exception (exception, trace); reading a writer's file may fail too
                results = self.writer.retrieve_write_results()
            except Exception as exc:
                results = (exc, None)
            if not isinstance(results, list):
                failure = _failure(results[0].__cause__ or results[0])
        ended = getattr(self.results, "finished_at", None)
        took = max(0.0, ended - self.started) if ended is not None else 0.0
        gathered = self.group.gather_object((failure, results if failure is None else None, took))
        what = "the background write of this checkpoint" if self.background else "the write of this checkpoint"

        def completion() -> float:
            failed = [f"rank {rank}: {error}" for rank, (error, _, _) in enumerate(gathered) if error is not None]
            try:
                if not failed:
                    self.writer.finish(self.metadata, [written for _, written, _ in gathered])
                    save_config(CheckpointingConfig(*self.config), str(self.partial))
                    self._finish()
                    return max(took for _, _, took in gathered)
            except BaseException:
                shutil.rmtree(self.partial, ignore_errors=True)
                raise
            shutil.rmtree(self.partial, ignore_errors=True)
            raise CheckpointError(f"{self.final}: {what} failed ({'; '.join(failed)}); {self._left()}")

        return _on_rank0(completion, lambda failure: f"{self.final}: the completion of this checkpoint failed (rank 0: "
                                                     f"{failure}); {self._left()}")


def save_checkpoint(trainer: "Trainer", root: str | Path, *, keep: Optional[int] = None,
                    tokenizer_assumed_for: Optional[str] = None) -> Path:
    """Save the trainer at its current step as ``root/step_<N>``; collective (every rank calls it). A failure on any
    rank raises the same CheckpointError on every rank (see the module's docstring).

    ``keep``: afterwards delete all but the newest ``keep`` complete checkpoints. ``tokenizer_assumed_for``: the
    Hugging Face folder (without tokenizer files) whose weights these are, taken to use ``model.tokenizer``
    unchecked (convert from-hf); the manifest's tokenizer records it as ``assumed_for``."""
    root = Path(root)
    partial, state, finish = _begin_save(trainer, root, keep, tokenizer_assumed_for)
    results: queue.Queue[Any] = queue.Queue()
    _write_results_to(results)
    files = _SaveFiles(state, partial, step_dir(root, trainer.step), finish, results, background=False)
    files.complete(files.write_here())
    return files.final


class PendingSave:
    """A checkpoint whose files are being written by a forked process on each rank (Megatron-Core's asynchronous
    save: its filesystem writer's files, the process started by its TemporalAsyncCaller).

    The fork holds the state as it was when the save started: on a GPU Megatron first copies the tensors to host
    memory; on the host the fork's copy-on-write pages are that copy (later updates change the trainer's pages, not
    the fork's). Until :meth:`finish` completes it on every rank the checkpoint is a hidden partial folder: not the
    newest for a resume, not counted by ``keep``; a job killed meanwhile resumes from the previous checkpoint."""

    def __init__(self, files: _SaveFiles, calls: Any, writer: Any) -> None:
        self.path = files.final  # the step folder it becomes
        self._files, self._calls, self._writer = files, calls, writer

    def finish(self, *, wait: bool) -> Optional[float]:
        """Complete the checkpoint once its files are written on every rank (``wait``: until they are); collective.
        Returns the seconds the slowest rank's background write took, or None while some rank is still writing.
        A write that failed on any rank, or a writer that died (the OOM killer's SIGKILL), raises the same
        CheckpointError on every rank, naming it."""
        if not self._calls.maybe_finalize_async_calls(blocking=wait):  # every rank's writer ended (an all-reduce)
            return None
        return self._files.complete(_writer_failure(self._writer))

    def abandon(self) -> None:
        """End this rank's background write without completing the checkpoint (no collective): the exit of a rank that
        failed, whose peers may be elsewhere. The checkpoint can never be completed then (completing is collective),
        so the writer is killed rather than waited for (minutes at scale, for files thrown away) and the partial
        folder removed (what a peer's writer still adds to it, the next save removes)."""
        _stop_writers(self._calls)
        shutil.rmtree(self._files.partial, ignore_errors=True)


def _stop_writers(calls: Any) -> None:
    """Kill this rank's background writers and wait until they are gone (each is one process: threads, no
    children)."""
    for call in calls.async_calls:
        writer = call.async_caller.process
        call.async_caller.close(abort=True)  # SIGKILL
        if writer is not None:
            writer.join()
    calls.async_calls.clear()


def _dying_with_trainer(write: Callable[..., None]) -> Callable[..., None]:
    """``write`` as the body of a writer that the kernel kills when its trainer process dies, however it dies. The
    writer is a fork: it holds the trainer's descriptors, the run directory's lock among them (an flock is released
    only once every copy is closed), and a trainer killed alone (kill -9, the OOM killer) can no longer complete the
    checkpoint; an orphaned writer only kept a restarted run out of its run directory until the write ended, for ever
    if the write stalled. Linux only; the signal goes when the *thread* that saved exits, so save from a lasting one
    (the loop saves from the main thread)."""
    if not sys.platform.startswith("linux"):
        return write
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: the writer only calls it
    trainer, sigkill = os.getpid(), int(signal.SIGKILL)

    def writer(*args: Any, **kwargs: Any) -> None:
        prctl(1, sigkill)  # PR_SET_PDEATHSIG
        if os.getppid() != trainer:  # the trainer died before the call
            os._exit(1)
        write(*args, **kwargs)

    return writer


def start_async_save(trainer: "Trainer", root: str | Path, *, keep: Optional[int] = None,
                     tokenizer_assumed_for: Optional[str] = None) -> PendingSave:
    """Start saving the trainer at its current step as ``root/step_<N>`` and return once the state is handed to the
    background writer (see :class:`PendingSave`); collective. ``keep`` prunes when the save completes."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    root = Path(root)
    partial, state, finish = _begin_save(trainer, root, keep, tokenizer_assumed_for)
    results = _ResultsFile(partial / f".write_results.rank{dist.get_rank()}")
    _write_results_to(results)
    files = _SaveFiles(state, partial, step_dir(root, trainer.step), finish, results, background=True)
    calls = AsyncCallsQueue()  # a process forked per save; the persistent caller would start one by 'spawn'
    failure = None
    try:  # a fork the kernel refuses (no memory for the copy, a process limit) fails on its own rank only
        with _writing(root):
            calls.schedule_async_request(files.request)
    except CheckpointError as exc:
        failure = str(exc)
    failed = _first_failure(failure)
    if failed is not None:  # the checkpoint cannot complete without the failed rank's files
        _stop_writers(calls)
        shutil.rmtree(partial, ignore_errors=True)
        rank, message = failed
        raise CheckpointError(f"{message} (rank {rank}'s background writer did not start; the writers that did were "
                              "stopped, the partial folder removed)")
    writer = calls.async_calls[-1].async_caller.process if calls.async_calls else None
    return PendingSave(files, calls, writer)


# The scheduler's saved values under the config names that set them (the scheduler is built from the config).
_SCHEDULE_NAMES = {"max_lr": "optimizer.lr", "min_lr": "optimizer.min_lr", "lr_warmup_steps": "optimizer.warmup_steps",
                   "lr_decay_style": "optimizer.lr_schedule", "start_wd": "optimizer.weight_decay",
                   "lr_decay_steps": "lr_decay_steps"}


def _apply_configured_hyperparameters(trainer: "Trainer", saved_schedule: dict[str, Any], path: Path) -> None:
    """The config wins over the checkpoint for every optimizer hyper-parameter (Megatron's
    ``--override-opt_param-scheduler``): a checkpoint restores the weights, Adam's moments and how far along the
    schedule the run is, never a setting. Learning rate and weight decay come from the scheduler, which the Trainer
    built from the config; Adam's betas and eps came back in the checkpoint's parameter groups and are set here. The
    log names every value that this run changes, so a resumed run's settings are never a silent choice."""
    opt = trainer.cfg.optimizer
    current = trainer.scheduler.state_dict()
    changed = {name: (saved_schedule[key], current[key]) for key, name in _SCHEDULE_NAMES.items()
               if key in saved_schedule and saved_schedule[key] != current[key]}
    configured = {"optimizer.adam_beta1": opt.adam_beta1, "optimizer.adam_beta2": opt.adam_beta2,
                  "optimizer.adam_eps": opt.adam_eps}
    for optimizer in _chained(trainer.optimizer):
        for group in optimizer.optimizer.param_groups:
            loaded = {"optimizer.adam_beta1": group["betas"][0], "optimizer.adam_beta2": group["betas"][1],
                      "optimizer.adam_eps": group["eps"]}
            for name, value in loaded.items():
                if value != configured[name]:
                    changed.setdefault(name, (value, configured[name]))
            group["betas"], group["eps"] = (opt.adam_beta1, opt.adam_beta2), opt.adam_eps
    if changed and dist.get_rank() == 0:
        log.warning("%s: this run's optimizer settings differ from the checkpoint's and apply from step %s (the "
                    "config wins): %s", path, saved_schedule.get("num_steps"),
                    ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changed.items()))


def check_tokenizer(manifest: dict[str, Any], name: Optional[str], path: Path) -> None:
    """The configured tokenizer (``model.tokenizer``) must be the one the checkpoint was trained with: another one
    gives every token id another meaning, and the model would train or serve on garbage without an error."""
    saved = manifest.get("tokenizer")
    if saved is None:  # written before checkpoints recorded it
        log.warning("%s: the checkpoint does not record its tokenizer; model.tokenizer is assumed to be the one it "
                    "was trained with", path)
        return
    current = tokenizer_identity(name)
    if not isinstance(saved, dict) or not same_tokenizer(saved, current):
        saved_text = describe_tokenizer(saved) if isinstance(saved, dict) else repr(saved)
        remedy = "Set model.tokenizer to the checkpoint's tokenizer"
        if isinstance(saved, dict) and saved.get("assumed_for"):  # a pairing convert from-hf could not check
            remedy = (f"convert from-hf took model.tokenizer for {saved['assumed_for']}, which has no tokenizer "
                      "files: if its weights were trained with another, convert it again with model.tokenizer set to "
                      "that one; else set model.tokenizer to the checkpoint's tokenizer")
        raise CheckpointError(f"{path}: trained with the tokenizer {saved_text}; this run's is "
                              f"{describe_tokenizer(current)}: their token ids mean different things. {remedy}")


def _check_optimizer_kind(trainer: "Trainer", manifest: dict[str, Any], path: Path) -> None:
    """Optimizer state loads into the kind of optimizer that saved it: the distributed optimizer's (per parameter,
    ``fully_reshardable``) into any layout, the non-distributed one's (Megatron's per-layout structure) into the
    layout that saved it only."""
    saved = manifest.get("distributed_optimizer", True)
    configured = trainer.cfg.optimizer.distributed
    if saved != configured:
        raise CheckpointError(f"{path}: its optimizer state was saved with optimizer.distributed: "
                              f"{str(saved).lower()}, this run has {str(configured).lower()}; set it back to resume")
    layout = trainer.layout.describe()
    if not configured and manifest.get("layout") != layout:
        raise CheckpointError(f"{path}: the state of the non-distributed optimizer (optimizer.distributed: false) "
                              f"loads only into the layout that saved it ({manifest.get('layout')}), this run is "
                              f"{layout}; resume in that layout (optimizer.distributed: true saves state that any "
                              "layout loads)")


_SAVE_IN_PROGRESS = re.compile(r"^\.step_\d+\.(partial|replaced|pruned)-")


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint folder ``path`` names: itself if it is a step folder (or what a save left of one), else the
    newest complete checkpoint under it (a root, hidden or not)."""
    if not path.is_dir() or _STEP_DIR.match(path.name) or _SAVE_IN_PROGRESS.match(path.name):
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{path}: holds no complete checkpoint (step_<N> folder with {MANIFEST})")
    return latest


def load_checkpoint(trainer: "Trainer", path: str | Path, *, weights_only: bool = False) -> int:
    """Load model, optimizer and schedule into ``trainer`` (any layout); returns the checkpoint's step.

    ``path`` is a ``step_<N>`` folder or a root holding them (then the newest complete one is loaded).
    ``weights_only``: the model's weights and the step, not the optimizer state (twice the model's size in float32
    Adam moments, read for nothing by an export); the optimizer starts fresh, and its kind need not match."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(Path(path))
    manifest = read_manifest(path)
    expected = _architecture(trainer)
    if manifest.get("architecture") != expected:
        diff = {k: (manifest.get("architecture", {}).get(k), v) for k, v in expected.items()
                if manifest.get("architecture", {}).get(k) != v}
        raise CheckpointError(f"{path}: saved for another model architecture (saved, configured): {diff}")
    check_tokenizer(manifest, trainer.cfg.model.tokenizer, path)
    with_optimizer = bool(manifest.get("optimizer_state")) and not weights_only
    if with_optimizer:
        _check_optimizer_kind(trainer, manifest, path)
    with _reading(path):
        state = dist_checkpointing.load(_sharded_state(trainer, is_loading=True, with_optimizer=with_optimizer),
                                        str(path))
        chunks = [chunk.module for chunk in trainer.model]
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state["model"] if len(chunks) == 1 else state[f"model{i}"])
        if with_optimizer and trainer.cfg.optimizer.distributed:
            trainer.optimizer.load_state_dict(_restructure_optimizer_state(trainer, state["optimizer"], path))
        elif with_optimizer:  # the same layout saved it (checked): Megatron's own structure, groups re-identified
            trainer.optimizer.load_state_dict(_reidentify_param_groups(trainer, state["optimizer"], path))
        else:  # saved before the first update (or weights only): the optimizer starts fresh, as it did then
            for optimizer in _chained(trainer.optimizer):
                optimizer.optimizer.state.clear()
            trainer.optimizer.reload_model_params()
        if not weights_only:
            _apply_configured_hyperparameters(trainer, state["scheduler"], path)
        trainer.scheduler.num_steps = 0  # Megatron's load adds the saved count to the current one (a rollback)
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.step = int(state["step"])
    if trainer.step != manifest["step"]:
        raise CheckpointError(f"{path}: manifest step {manifest['step']} but saved state step {trainer.step}")
    dist.barrier()
    return trainer.step
