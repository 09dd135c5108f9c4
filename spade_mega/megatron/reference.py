"""The reference policy of the KL term (``rl.kl_coef > 0``), kept the way slime keeps it: no second model, but this
rank's parameter shards of the reference weights in host memory (pinned on CUDA), exchanged with the model's own for
the no-grad forward that gives the reference log-probs of a batch (same packing, micro-batches and parallel layout as
the policy's forward), then exchanged back. Copies are exact, so the policy comes back bit for bit; the optimizer's
main copies and moments are never touched. Cost: one more copy of the rank's parameter shards in host memory, one
transient copy of one parameter on the device, one extra forward and two host <-> device copies of the shards per
rollout (the self-play loop's pre-pass, :meth:`Trainer.reference_logprobs_of_steps`; per step for a ``train_step``
given samples without ``ref_logprobs``).

Which weights (``rl.reference``): ``initial`` is the weights the run starts from, ``inference.hf_weights`` or else the
seeded initialisation; any other value names a spade-mega checkpoint (a step folder or a root) or a Hugging Face
folder. A resumed run reads them again from that source before its checkpoint replaces the initial weights (never
from the checkpoint), so its reference is the straight run's: a root is pinned at the run's start to the step folder
it then resolved to (:func:`pinned_reference`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import SpadeConfig
from spade_mega.errors import SpadeError

if TYPE_CHECKING:
    from spade_mega.megatron.train import Trainer

INITIAL = "initial"
# torch's pinned host allocator rounds every allocation up to a power of two: the shards allocated one by one took
# ~35% more host memory than their size in the example layout (Qwen3-30B-A3B's 6.3 MB expert weights in 8 MB
# blocks, 156 MB embedding shards in 256 MB ones). They are packed into buckets of this size instead.
BUCKET_BYTES = 1 << 30
_ALIGN = 512  # bytes: every held tensor starts at a multiple (any dtype's alignment)


class ReferencePolicy:
    """This rank's shards of the reference weights, in host memory; taken from the model by :meth:`capture`."""

    def __init__(self, trainer: "Trainer") -> None:
        self._params = [p for chunk in trainer.model for p in chunk.module.parameters()]
        self._held: Optional[list[torch.Tensor]] = None

    @property
    def ready(self) -> bool:
        return self._held is not None

    @property
    def nbytes(self) -> int:
        """Host memory the reference holds (this rank's parameter shards)."""
        return sum(p.numel() * p.element_size() for p in self._params)

    def capture(self) -> None:
        """The model's current weights become the reference."""
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self._params)
        with torch.no_grad():
            self._held = [held.copy_(p) for held, p in zip(host_copies(self._params, pin=pin), self._params)]
        self._synchronize()

    def exchange(self) -> None:
        """Swap the model's weights with the held ones, in place (the parameters keep their storage: Megatron's
        DDP buffers and the optimizer's views of them stay valid)."""
        if self._held is None:
            raise RuntimeError("no reference weights captured yet")
        with torch.no_grad():
            for param, held in zip(self._params, self._held):
                current = param.detach().clone()
                param.copy_(held, non_blocking=True)
                held.copy_(current, non_blocking=True)
        self._synchronize()

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The reference weights in the model for the body; the policy's back afterwards, also on an error."""
        self.exchange()
        try:
            yield
        finally:
            self.exchange()

    def _synchronize(self) -> None:
        if torch.cuda.is_available() and any(p.is_cuda for p in self._params):
            torch.cuda.synchronize()


def host_copies(params: list[torch.Tensor], *, pin: bool, bucket_bytes: int = BUCKET_BYTES) -> list[torch.Tensor]:
    """Uninitialised host tensors shaped as ``params``: views into the buckets of :func:`pack_buckets`."""
    sizes = [p.numel() * p.element_size() for p in params]
    used, place = pack_buckets(sizes, bucket_bytes)
    buckets = [torch.empty(filled, dtype=torch.uint8, device="cpu", pin_memory=pin) for filled in used]
    return [buckets[b][offset:offset + size].view(p.dtype).view(p.shape)
            for p, size, (b, offset) in zip(params, sizes, place)]


def pack_buckets(sizes: list[int], bucket_bytes: int = BUCKET_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """First-fit-decreasing packing of tensors of ``sizes`` bytes into buckets of ``bucket_bytes`` (a power of two;
    raised to the next one above the largest tensor), so that the pinned allocator's rounding costs at most the last
    bucket's: the bytes used per bucket, and each tensor's (bucket, offset)."""
    capacity = 1 << (max([bucket_bytes, *sizes]) - 1).bit_length()
    used: list[int] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = -(-sizes[i] // _ALIGN) * _ALIGN
        bucket = next((b for b, filled in enumerate(used) if filled + size <= capacity), len(used))
        if bucket == len(used):
            used.append(0)
        place[i] = (bucket, used[bucket])
        used[bucket] += size
    return used, place


def reference_source(cfg: SpadeConfig) -> tuple[str, Optional[str]]:
    """The config field that names the reference weights, and their folder (None: the seeded initialisation)."""
    if cfg.rl.reference != INITIAL:
        return "rl.reference", cfg.rl.reference
    return "inference.hf_weights", cfg.inference.hf_weights


def pinned_reference(cfg: SpadeConfig, recorded: Optional[str]) -> Optional[str]:
    """The step folder of the checkpoint root ``rl.reference`` names, for the whole run: ``recorded`` (what the run
    resolved it to at its start, kept in its loop states) when resuming, else the newest complete checkpoint there
    now. A root still being written (another run's) would otherwise give each resume a newer reference, so a resumed
    run would differ from a straight one. None when rl.reference names no checkpoint root (the KL term off, the
    initial weights, a Hugging Face folder, a step folder): the configured folder is read as it is."""
    from spade_mega.megatron.checkpoint import CheckpointError, resolve_checkpoint

    field, folder = reference_source(cfg)
    if cfg.rl.kl_coef <= 0 or field != "rl.reference" or folder is None:
        return None
    path = Path(folder)
    if recorded is not None and Path(recorded).parent.resolve() == path.resolve():  # not if rl.reference changed
        return recorded
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    try:
        resolved = resolve_checkpoint(path)
    except CheckpointError as exc:
        raise ConfigError(field, f"cannot be read as the reference policy: {exc}") from None
    return None if resolved == path else str(resolved)


def prepare_reference(trainer: "Trainer", checkpoint: Optional[Path], pinned: Optional[str] = None) -> None:
    """Give a just-built ``trainer`` the reference of its run, before any weights are loaded into it (collective).

    A new run (``checkpoint`` None) with ``rl.reference: initial`` takes it at its first step, from the weights it
    starts from. A run resuming from ``checkpoint`` re-reads the initial weights first: ``inference.hf_weights``, or
    the seeded initialisation the trainer holds now, which depends on the parallel layout (a resume in another
    layout is refused: name the initial weights instead). A named ``rl.reference`` folder is read either way (its
    step folder ``pinned`` when it names a checkpoint root: :func:`pinned_reference`)."""
    if trainer.reference is None:
        return
    field, folder = reference_source(trainer.cfg)
    if pinned is not None and field == "rl.reference":
        folder = pinned
    if folder is not None and (checkpoint is not None or field == "rl.reference"):
        load_reference(trainer, folder, field=field)
    elif checkpoint is not None:
        _check_same_layout(trainer.layout.describe(), checkpoint)
        trainer.reference.capture()


def check_reference(cfg: SpadeConfig, checkpoint: Optional[Path], world_size: int) -> None:
    """Refuse, before anything is built, the reference :func:`prepare_reference` would refuse once the trainer was
    built and the inference engine started, minutes into a job (every rank; no collective): a folder the run will
    read that does not exist, is no complete spade-mega checkpoint and no Hugging Face folder, or carries another
    tokenizer than ``model.tokenizer``; a resume from ``checkpoint`` in another model-parallel layout when the
    reference is the seeded initialisation. The architecture is compared when the folder is read (load_reference)."""
    if cfg.rl.kl_coef <= 0:
        return
    field, folder = reference_source(cfg)
    if folder is not None and (checkpoint is not None or field == "rl.reference"):
        _check_folder(cfg, Path(folder), field)
    elif checkpoint is not None:
        from spade_mega.megatron.parallel import resolve_layout
        from spade_mega.megatron.providers import resolve_model_config

        _check_same_layout(resolve_layout(cfg.parallel, resolve_model_config(cfg.model), world_size).describe(),
                           checkpoint)


def _check_folder(cfg: SpadeConfig, path: Path, field: str) -> None:
    from spade_mega.megatron.checkpoint import check_tokenizer, read_manifest, resolve_checkpoint
    from spade_mega.tokenizer import check_folder_tokenizer

    if not path.is_dir():
        raise ConfigError(field, f"{path}: no such folder (the reference policy's weights: a spade-mega checkpoint "
                                 "or a Hugging Face folder)")
    try:
        if (path / "config.json").is_file():
            check_folder_tokenizer(path, cfg.model.tokenizer)
        else:
            checkpoint = resolve_checkpoint(path)
            check_tokenizer(read_manifest(checkpoint), cfg.model.tokenizer, checkpoint)
    except SpadeError as exc:
        raise ConfigError(field, f"cannot be read as the reference policy: {exc}") from None


def _check_same_layout(current: str, checkpoint: Path) -> None:
    from spade_mega.megatron.checkpoint import read_manifest, resolve_checkpoint

    def model_parallel(layout: str) -> str:  # neither data nor sequence parallelism changes the initialisation
        return re.sub(r"\s*DP\d+|\+SP", "", layout)

    saved = read_manifest(resolve_checkpoint(checkpoint)).get("layout")
    if saved is not None and model_parallel(saved) != model_parallel(current):
        raise ConfigError("rl.reference", f"'initial' is the seeded initialisation here (no inference.hf_weights), "
                                          f"which depends on the parallel layout: {checkpoint} was trained in "
                                          f"{saved}, this run is {current}, so the reference would not be the "
                                          "run's initial weights. Resume in the checkpoint's layout, or save the "
                                          "initial weights (a checkpoint of step 0, or convert to-hf) and name "
                                          "them in rl.reference")


def load_reference(trainer: "Trainer", folder: str, *, field: str = "rl.reference") -> None:
    """Make the weights of ``folder`` (a spade-mega checkpoint, any layout, or a Hugging Face folder) the trainer's
    reference, leaving its own weights as they are (collective). Only before the first optimizer step: reading a
    folder goes through the model and refreshes the optimizer's main copies from it. ``field`` names the config key
    in errors."""
    reference = trainer.reference
    if reference is None:
        raise RuntimeError("the trainer keeps no reference (rl.kl_coef is 0)")
    if trainer.step != 0:
        raise RuntimeError(f"a reference is loaded before the first optimizer step (the trainer is at step "
                           f"{trainer.step})")
    path = Path(folder)
    _check_folder(trainer.cfg, path, field)
    if not reference.ready:
        reference.capture()
    reference.exchange()  # the policy is held, the model free to be read into
    try:
        _read_weights(trainer, path)
    except SpadeError as exc:
        raise ConfigError(field, f"cannot be read as the reference policy: {exc}") from None
    finally:
        reference.exchange()  # the policy back; the reference (read, or on an error the previous one) held
    trainer.optimizer.reload_model_params()


def _read_weights(trainer: "Trainer", path: Path) -> None:
    """The weights of ``path`` into the model only: the step count and the schedule stay the trainer's."""
    if (path / "config.json").is_file():
        from spade_mega.bridge import load_hf

        load_hf(trainer, path)
        return
    step, schedule = trainer.step, trainer.scheduler.state_dict()
    trainer.load(str(path), weights_only=True)
    trainer.step = step
    trainer.scheduler.num_steps = 0  # Megatron's load adds the saved count to the current one
    trainer.scheduler.load_state_dict(schedule)
