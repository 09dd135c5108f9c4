"""The GRPO training step on Megatron-Core: one optimizer step over a global batch of variable-length samples.

Every rank is given the same global batch (a list of :class:`~spade_mega.megatron.batch.TrainSample`); each takes
its data-parallel share, packed into micro-batches by the ``parallel.max_tokens_per_gpu`` token budget, and runs
Megatron's pipeline schedule (no pipelining, 1F1B or interleaved, as the layout needs) with the GRPO loss on the last
stage. Gradients are reduced by Megatron's DDP and ``finalize_model_grads``, clipped and applied by Megatron's
(distributed) optimizer.

Normalisation: the loss of the whole global batch is ``sum(token losses) / N`` with N the global count of
:func:`spade_mega.rl.loss.loss_normalizer` (every rank computes it from the batch it was given). Each micro-batch
contributes its share; Megatron divides each micro-batch loss by the micro-batch count and DDP averages over
data-parallel ranks, so shares are multiplied by both, and the summed gradients are those of the full-batch loss
whatever the layout. Under context parallelism each CP rank holds a load-balanced share of every row (two chunks of
every sample, :meth:`MicroBatch.context_shard`); its loss is the share of its tokens, Megatron multiplies it by the
CP size and DDP averages gradients over DP x CP, so the shares still sum to the full-batch gradient. The MoE
load-balancing loss is added by Megatron's routers with the same averaging, over the
real tokens of each micro-batch: padding is given to the model as its ``padding_mask`` (an all-padding micro-batch
adds nothing, and its average is taken over the micro-batches holding samples only).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial, wraps
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import SpadeConfig
from spade_mega.megatron import compat
from spade_mega.megatron.batch import (
    ROLES,
    BatchError,
    MicroBatch,
    PackPlan,
    TrainSample,
    pack,
    row_length_multiple,
    samples_from,
)
from spade_mega.megatron.objective import Objective, select_objective
from spade_mega.megatron.offload import TrainerOffload
from spade_mega.megatron.parallel import ParallelLayout, init_distributed, initialize, release, resolve_layout
from spade_mega.megatron.providers import (
    Backend,
    build_model_chunks,
    resolve_model_config,
    select_backend,
    transformer_config,
)
from spade_mega.megatron.reference import ReferencePolicy
from spade_mega.rl.loss import SampleSums, loss_normalizer

if TYPE_CHECKING:
    from spade_mega.megatron.checkpoint import PendingSave
    from spade_mega.megatron.routing import RoutingReplay

# a forward's routing hook: a context around the model call of one micro-batch by one model chunk (routing.py)
Route = Callable[[int, MicroBatch], AbstractContextManager]

log = logging.getLogger("spade_mega.megatron")

# metrics of spade_mega.rl.loss.policy_loss combined over micro-batches weighted by their loss tokens
_MEAN_METRICS = ("pg_loss", "clip_frac", "approx_kl")
_TIS_METRICS = ("tis_ratio_mean", "tis_truncated_frac")


def _released_on_failure(init: Callable[..., None]) -> Callable[..., None]:
    """``Trainer.__init__`` that closes what it built when it fails after building the process groups (a setting
    refused once the model and optimizer exist, a reference or routing check): a process that goes on after the
    error (a sweep, a notebook, ``spade-mega eval`` reporting it) kept its groups, model and optimizer otherwise."""

    @wraps(init)
    def build(self: "Trainer", *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if hasattr(self, "groups"):
                try:
                    self.close()
                except Exception:  # the construction's own error is the one to report
                    log.exception("releasing a trainer whose construction failed")
            raise

    return build


@dataclass(frozen=True)
class StepResult:
    """What one call of :meth:`Trainer.train_step` did. ``metrics`` are global (identical on every rank)."""

    step: int
    updated: bool  # False when the optimizer skipped the update (non-finite gradients)
    metrics: dict[str, float]


class Trainer:
    """A Qwen3-MoE policy on Megatron-Core with its optimizer, trained by GRPO steps.

    Construct it on every rank (under torchrun / srun, or as a single process); it joins torch.distributed, builds
    the process groups of ``cfg.parallel`` and the model of ``cfg.model``. ``temperature`` is the rollout sampling
    temperature the log-probs are computed at (default ``cfg.rollout.temperature``); ``total_steps`` is the horizon
    of a decaying learning-rate schedule (default ``cfg.selfplay.num_rollouts``).
    """

    @_released_on_failure
    def __init__(self, cfg: SpadeConfig, *, temperature: Optional[float] = None,
                 total_steps: Optional[int] = None) -> None:
        self.cfg = cfg
        self.pending_save: Optional[PendingSave] = None  # a checkpoint being written in the background
        self.model_cfg = resolve_model_config(cfg.model)
        cfg.rl.check_routing_replay(self.model_cfg.num_experts)  # the model a config.json describes, too
        self.backend: Backend = select_backend(self.model_cfg.transformer_impl)
        compat.install()
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.layout: ParallelLayout = resolve_layout(cfg.parallel, self.model_cfg, init_distributed(cfg.parallel))
        self.groups = initialize(self.layout, cfg.run.seed, cfg.parallel.collective_timeout_min)
        self.config = transformer_config(self.model_cfg, cfg.parallel, self.backend)
        chunks = build_model_chunks(self.model_cfg, self.config, self.backend)

        opt = cfg.optimizer
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=opt.distributed)
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        overflow_skip = compat.norm_overflow_skip()
        self._optimizer_skips_overflow = bool(overflow_skip)  # else _norm_finite asks before the step
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                            adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                            clip_grad=opt.clip_grad, use_distributed_optimizer=opt.distributed,
                            bf16=self.config.bf16, params_dtype=self.config.params_dtype, **overflow_skip),
            self.model)
        self.config.grad_scale_func = self.optimizer.scale_loss
        horizon = max(total_steps or cfg.selfplay.num_rollouts, opt.warmup_steps + 1)
        # The schedule is this run's config; a checkpoint restores only how far along it is. Megatron's default
        # took warmup, horizon and decay style from the checkpoint but the learning rates from the config, so a
        # resumed run with more steps decayed to min_lr at the old horizon and trained no further.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if opt.warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps, lr_decay_steps=horizon, lr_decay_style=opt.lr_schedule,
            start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=horizon, wd_incr_style="constant",
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
        self.objective: Objective = select_objective(
            cfg.rl, cfg.kernels, cfg.rollout.temperature if temperature is None else temperature)
        self.step = 0
        self._ps = ps
        # rl.kl_coef > 0: the reference policy's weights, held in host memory (reference.py); unless a reference is
        # loaded first (reference.prepare_reference), the weights of the first step
        self.reference: Optional[ReferencePolicy] = ReferencePolicy(self) if cfg.rl.kl_coef > 0 else None
        # parallel.offload_trainer: its device memory released while a colocated engine generates (offload.py)
        self.offloader: Optional[TrainerOffload] = TrainerOffload(self)
        # rl.routing_replay: the old policy's experts replayed in the steps (routing.py)
        self.routing: Optional[RoutingReplay] = None
        if cfg.rl.routing_replay:
            from spade_mega.megatron.routing import RoutingReplay

            self.routing = RoutingReplay(chunks, self.model_cfg.num_experts, self.layout.tensor,
                                         self.layout.sequence_parallel, ps.get_tensor_model_parallel_rank())

    # --- layout helpers ---------------------------------------------------------------------------------------

    @property
    def is_last_stage(self) -> bool:
        return self._ps.is_pipeline_last_stage()

    @property
    def reports_metrics(self) -> bool:
        """One rank per data-parallel replica owns the loss values: last stage, tensor-parallel rank 0."""
        return self.is_last_stage and self._ps.get_tensor_model_parallel_rank() == 0

    def _plan(self, batch: Sequence[TrainSample]) -> PackPlan:
        return pack(batch, token_budget=self.cfg.parallel.max_tokens_per_gpu, data_parallel=self.layout.data,
                    length_multiple=row_length_multiple(self.layout.tensor, self.layout.context,
                                                        self.layout.sequence_parallel),
                    count_multiple=self.layout.pipeline if self.layout.virtual_pipeline else 1,
                    common_length=self.layout.virtual_pipeline is not None, context=self.layout.context)

    def _check(self, batch: Sequence[TrainSample]) -> None:
        vocab = self.model_cfg.vocab_size
        for s in batch:
            if int(s.tokens.max()) >= vocab:
                raise BatchError(f"sample {s.index}: token id {int(s.tokens.max())} is outside the vocabulary "
                                 f"(model.vocab_size = {vocab})")

    def _model_inputs(self, mb: MicroBatch, chunk: Any) -> dict[str, Any]:
        device = self.backend.device
        inputs: dict[str, Any] = dict(input_ids=mb.tokens.to(device), position_ids=mb.position_ids.to(device))
        if self.backend.te or self.layout.context > 1:  # the local attention's CP path takes THD too
            inputs.update(attention_mask=None, packed_seq_params=mb.packed_seq_params(device))
        else:
            inputs.update(attention_mask=mb.attention_mask().to(device))
        if self.model_cfg.num_experts:
            inputs.update(padding_mask=self._padding_mask(mb, chunk).to(device))
        return inputs

    def _padding_mask(self, mb: MicroBatch, chunk: Any) -> torch.Tensor:
        """The row's padding for GPTModel's ``padding_mask``: the routers leave it out of the load-balancing loss.
        GPTModel cuts the mask to this rank's sequence-parallel slice only on the stage that embeds the tokens; a
        later stage receives hidden states already cut, so it is given its slice."""
        from megatron.core.utils import get_attr_wrapped_model

        padding = mb.padding_mask
        if self.layout.sequence_parallel and not get_attr_wrapped_model(chunk, "pre_process"):
            padding = padding.chunk(self.layout.tensor, dim=1)[self._ps.get_tensor_model_parallel_rank()]
        return padding

    def _run_schedule(self, micro_batches: list[MicroBatch], loss_fn: Callable[[MicroBatch, torch.Tensor], Any],
                      forward_only: bool, route: Optional[Route] = None) -> None:
        """Megatron's forward(-backward) schedule over this rank's micro-batches; ``loss_fn`` runs on the last stage;
        ``route`` (routing replay) wraps each forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Callable]:
            mb = next(data_iterator).context_shard(self._ps.get_context_parallel_rank(), self.layout.context)
            routed = nullcontext() if route is None else \
                route(next(i for i, c in enumerate(self.model) if c is model), mb)
            with routed:
                output = model(**self._model_inputs(mb, model))
            return output, partial(loss_fn, mb)

        self.offloader.check_loaded("a forward")
        iterators: Any = [iter(micro_batches) for _ in self.model] if len(self.model) > 1 else iter(micro_batches)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iterators, model=self.model,
                                    num_microbatches=len(micro_batches), seq_length=micro_batches[0].length,
                                    micro_batch_size=1, forward_only=forward_only)

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        for chunk in self.model:
            chunk.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for chunk in self.model:
                chunk.train()

    # --- public API -------------------------------------------------------------------------------------------

    def _forward_collect(self, samples: Sequence[TrainSample], width: int,
                         values_of: Callable[[MicroBatch, torch.Tensor], torch.Tensor],
                         route: Optional[Route] = None, on_device: bool = True) -> list[torch.Tensor]:
        """No-grad forward of ``samples``; ``values_of(mb, logits)`` gives [L, width] values per row position,
        returned per sample in token alignment ([n, width]; row 0, which has no prefix, is zero) on every rank, in
        host memory. The table is reduced ``on_device`` (NCCL on GPU: a rollout's log-probs are tens of MB, which
        gloo would carry over TCP), else in host memory (over gloo: a table too large for the device)."""
        batch = samples_from(samples)
        self._check(batch)
        offsets = [0]
        for s in batch:
            offsets.append(offsets[-1] + len(s))
        device = self.backend.device if on_device else torch.device("cpu")
        flat = torch.zeros(offsets[-1], width, dtype=torch.float32, device=device)

        def collect(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            values = values_of(mb, logits).reshape(mb.length, width).float().to(device)
            if mb.row_index is not None:  # a context-parallel shard: the other CP ranks write the rest of the row
                values = values.new_zeros(mb.row_length, width).index_copy(0, mb.row_index.to(device), values)
            if self.reports_metrics:
                for i, start, end in self._segments(mb):
                    # row position t predicts token t + 1: shift into token alignment
                    flat[offsets[i] + 1: offsets[i] + end - start] = values[start:end - 1]
            return logits.new_zeros(()), {}

        with self._eval_mode():
            self._run_schedule(self._plan(batch).micro_batches[self._ps.get_data_parallel_rank()], collect,
                               forward_only=True, route=route)
        dist.all_reduce(flat)  # exactly one rank per sample wrote its values; the others hold zeros
        flat = flat.cpu()
        return [flat[offsets[i]:offsets[i + 1]].clone() for i in range(len(batch))]

    def logprobs(self, samples: Sequence[TrainSample], route: Optional[Route] = None) -> list[torch.Tensor]:
        """Per-token log-probs of every sample under the current weights (no-grad forward), on every rank.

        Aligned with ``tokens``: entry t is log p(tokens[t] | tokens[:t]) at the objective's temperature; entry 0
        (no prefix) is 0."""
        def values_of(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            return self.objective.token_logprobs(logits, mb.labels.to(logits.device))[0]

        return [v[:, 0] for v in self._forward_collect(samples, 1, values_of, route)]

    def old_policy(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """The old policy of a rollout, before its first step: the samples' :meth:`logprobs` (returned: the
        ``old_logprobs`` its steps clip against), and with ``rl.routing_replay`` the experts every MoE layer of this
        rank chose for every token in the same forward, set as each given sample's ``routing`` (host memory) for the
        steps to replay. Collective, like :meth:`logprobs`."""
        if self.routing is None:
            return self.logprobs(samples)
        batch = [TrainSample(s.tokens, s.loss_mask, s.advantages, s.role, index=s.index) for s in samples_from(samples)]
        with self.routing.recording([len(s) for s in batch], self.model_cfg.moe_router_topk,
                                    self._ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
                                    self.backend.device) as recorder:
            values = self.logprobs(batch, route=recorder.around)
        for s, routing in zip(samples, recorder.per_sample()):
            s.routing = routing
        return values

    def reference_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Per-token log-probs of every sample under the reference policy (``rl.kl_coef > 0``), aligned as
        :meth:`logprobs`: its weights swapped into the model for the forward, the policy's swapped back exactly."""
        return self.reference_logprobs_of_steps([samples])[0]

    def reference_logprobs_of_steps(self, batches: Sequence[Sequence[TrainSample]]) -> list[list[torch.Tensor]]:
        """:meth:`reference_logprobs` of each batch, under one swap of the weights (the self-play loop's pre-pass
        over a rollout's optimizer steps: two host <-> device copies of the shards per rollout, not per step). Each
        batch is packed as its :meth:`train_step` packs it, so the values are bit for bit the ones that step would
        compute itself (the packing changes a row's numerics in the last bits)."""
        if self.reference is None:
            raise ConfigError("rl.kl_coef", "is 0: the trainer keeps no reference policy")
        self.offloader.check_loaded("a reference forward")  # the swap reads and writes the parameters
        if not self.reference.ready:
            self.reference.capture()
        with self.reference.swapped_in():
            return [self.logprobs(batch) for batch in batches]

    def logits(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Full-vocabulary logits [n, vocab] of every sample (row t: the distribution of token t given tokens[:t];
        row 0 is zero), gathered over tensor-parallel ranks, on every rank. For checks and conversions: it moves
        the whole vocabulary, which the training step never does (the table, 4 bytes x vocab per token, is reduced in
        host memory)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def values_of(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            return gather_from_tensor_model_parallel_region(logits)

        return self._forward_collect(samples, self.model_cfg.vocab_size, values_of, on_device=False)

    @staticmethod
    def _segments(mb: MicroBatch) -> Iterator[tuple[int, int, int]]:
        """(sample, start, end) of each sample of the row: its tokens, without the padding of its segment."""
        bounds = mb.cu_seqlens.tolist()
        for k, sample in enumerate(mb.samples):
            yield sample, bounds[k], bounds[k] + mb.seqlens[k]

    def _sample_sums(self, mb: MicroBatch) -> Optional[SampleSums]:
        """For a context-parallel shard: per-token sums over each token's whole sample, all CP ranks' tokens
        (sequence-level TIS, seq-mean-token-mean); collective over the CP group, no gradient."""
        if mb.row_index is None:
            return None
        group = self._ps.get_context_parallel_group()
        segment = torch.repeat_interleave(torch.arange(len(mb.seqlens)), torch.diff(mb.cu_seqlens).long())

        def sums(values: torch.Tensor) -> torch.Tensor:
            index, seg = mb.row_index.to(values.device), segment.to(values.device)
            row = values.new_zeros(mb.row_length).index_copy(0, index, values.detach())
            dist.all_reduce(row, group=group)
            return row.new_zeros(len(mb.seqlens)).index_add(0, seg, row)[seg[index]]

        return sums

    def train_step(self, samples: Sequence[TrainSample]) -> StepResult:
        """One GRPO optimizer step over the global batch ``samples`` (the same list on every rank).

        Samples without ``old_logprobs`` get them from a no-grad forward of the current weights first; with
        ``rl.kl_coef > 0``, samples without ``ref_logprobs`` from one of the reference's."""
        self.offloader.check_loaded("a step")
        start = time.perf_counter()
        batch = samples_from(samples)
        self._check(batch)
        missing = [s for s in batch if s.old_logprobs is None]
        if missing:
            for s, values in zip(missing, self.old_policy(missing)):
                s.old_logprobs = values
        if self.routing is not None:
            self._check_routing(batch)
        without_ref = [s for s in batch if s.ref_logprobs is None] if self.reference is not None else []
        if without_ref:
            for s, values in zip(without_ref, self.reference_logprobs(without_ref)):
                s.ref_logprobs = values
        aggregation = self.cfg.rl.loss_aggregation
        normalizer = sum(loss_normalizer(s.loss_mask[None], aggregation) for s in batch)
        if normalizer == 0:
            raise BatchError("no sample of the batch has a loss-mask token (nothing to train on)")
        plan = self._plan(batch)
        micro_batches = plan.micro_batches[self._ps.get_data_parallel_rank()]
        scale = self.layout.data * len(micro_batches)
        # Megatron averages the MoE load-balancing loss (gradient and logged value) over the micro-batches a rank
        # runs, empty ones included (interleaved-schedule rounding, a short data-parallel share): average it over the
        # real micro-batches of all data-parallel ranks instead (per rank, before the DP average: their count / DP)
        aux_micro_batches = plan.num_real_micro_batches / self.layout.data
        has_rollout = any(s.rollout_logprobs is not None for s in batch)
        mean_keys = _MEAN_METRICS + (_TIS_METRICS if has_rollout else ()) + \
            (("entropy",) if self.objective.needs_entropy else ())
        sums = torch.zeros(2 + len(mean_keys), dtype=torch.float64)  # loss, loss tokens, weighted means
        peak = torch.zeros(1, dtype=torch.float64)
        gspo = self.cfg.rl.policy_loss == "gspo"
        sequences = torch.zeros(2, dtype=torch.float64)  # GSPO: samples (token shares under CP), clipped samples
        kl_sums = torch.zeros(2 * len(ROLES), dtype=torch.float64)  # per role: KL summed over loss tokens, tokens
        roles = torch.tensor([ROLES.index(s.role) for s in batch])

        def loss_fn(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            device = logits.device
            loss, metrics = self.objective(
                logits, mb.labels.to(device), mb.old_logprobs.to(device), mb.advantages.to(device),
                mb.loss_mask.to(device), mb.sample_ids.to(device),
                rollout_logprobs=None if mb.rollout_logprobs is None else mb.rollout_logprobs.to(device),
                ref_logprobs=None if self.reference is None else mb.ref_logprobs.to(device),
                normalizer=float(normalizer), sample_sums=self._sample_sums(mb))
            n = float(metrics["num_tokens"])
            # a micro-batch without loss tokens adds nothing (the empty ones that keep data-parallel ranks in step
            # carry no rollout log-probs, so no TIS metrics either)
            if self.reports_metrics and n > 0:
                sums[0] += float(loss.detach())
                sums[1] += n
                for k, key in enumerate(mean_keys):
                    sums[2 + k] += n * float(metrics[key])
                if has_rollout:
                    peak[0] = max(float(peak[0]), float(metrics["tis_ratio_max"]))
                if gspo:
                    sequences[0] += float(metrics["num_sequences"])
                    sequences[1] += float(metrics["num_sequences"]) * float(metrics["seq_clip_frac"])
                if self.reference is not None:
                    tokens = mb.loss_mask.reshape(-1)
                    role = roles[mb.sample_ids.reshape(-1).clamp(min=0)]
                    kl = metrics["kl_tokens"].detach().double().cpu()
                    for r in range(len(ROLES)):
                        kl_sums[2 * r] += kl[tokens & (role == r)].sum()
                        kl_sums[2 * r + 1] += int((tokens & (role == r)).sum())
            return loss * scale, {}

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.model_cfg.num_experts:
            compat.reset_moe_metrics()  # process-global: another model may have sized or filled it
        drift = torch.zeros(2, dtype=torch.float64)  # routing replay: tokens whose router now picks others, tokens
        with compat.moe_aux_loss_scaled(self.config, len(micro_batches) / aux_micro_batches), \
                self.routing.replaying() if self.routing is not None else nullcontext() as counted:
            self._run_schedule(micro_batches, loss_fn, forward_only=False,
                               route=None if self.routing is None else partial(self.routing.around,
                                                                               [s.routing for s in batch]))
            if counted is not None:
                drift += counted()
        updated, grad_norm = False, None  # skipped: no weight, Adam moment or schedule moves (grad_norm NaN)
        if self._gradients_finite():
            updated, grad_norm, _ = self.optimizer.step()  # itself skips a norm overflow (norm_overflow_skip)
            grad_norm = grad_norm if updated else None
        if updated:
            self.scheduler.step(increment=1)
        self.step += 1

        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if gspo:
            dist.all_reduce(sequences)
        aux = compat.moe_load_balancing_loss(self.model_cfg.num_layers, aux_micro_batches) \
            if self.model_cfg.num_experts else None
        elapsed = time.perf_counter() - start
        tokens = sum(len(s) for s in batch)
        rows = sum(mb.length for mbs in plan.micro_batches for mb in mbs)
        loss_tokens = max(float(sums[1]), 1.0)
        metrics = {"loss": float(sums[0]), "loss_tokens": float(sums[1]),
                   **{key: float(sums[2 + k]) / loss_tokens for k, key in enumerate(mean_keys)},
                   "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                   "lr": float(self.optimizer.param_groups[0]["lr"]),
                   "tokens": float(tokens), "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                   "micro_batches": float(plan.num_micro_batches), "padding_frac": 1.0 - tokens / rows,
                   "samples_agent": float(sum(s.role == "agent" for s in batch)),
                   "samples_designer": float(sum(s.role == "designer" for s in batch))}
        if has_rollout:
            metrics["tis_ratio_max"] = float(peak[0])
        if gspo:
            metrics["seq_clip_frac"] = float(sequences[1]) / float(sequences[0]) if sequences[0] > 0 else 0.0
        if self.reference is not None:  # per role only where the step had that role's loss tokens
            dist.all_reduce(kl_sums)
            metrics["kl"] = float(kl_sums[0::2].sum()) / max(float(kl_sums[1::2].sum()), 1.0)
            metrics.update({f"kl_{role}": float(kl_sums[2 * r] / kl_sums[2 * r + 1])
                            for r, role in enumerate(ROLES) if kl_sums[2 * r + 1] > 0})
        if aux is not None:
            metrics["moe_load_balancing_loss"] = aux
        if self.routing is not None:  # over (token, MoE layer) pairs of the step's forwards, all ranks
            dist.all_reduce(drift)
            metrics["routing_replay_drift"] = float(drift[0] / drift[1]) if drift[1] > 0 else 0.0
        return StepResult(step=self.step, updated=bool(updated), metrics=metrics)

    def _check_routing(self, batch: Sequence[TrainSample]) -> None:
        """Under routing replay every sample carries the routing its old log-probs were taken with, of this rank's
        MoE layers."""
        assert self.routing is not None
        shape = (self.routing.num_layers, self.model_cfg.moe_router_topk)
        for s in batch:
            if s.routing is None:
                raise BatchError(f"sample {s.index}: old_logprobs given without routing while rl.routing_replay is on: "
                                 "take both in one forward with Trainer.old_policy (or leave old_logprobs None for "
                                 "the step to take them)")
            if tuple(s.routing.shape[1:]) != shape or int(s.routing.max()) >= self.model_cfg.num_experts:
                raise BatchError(f"sample {s.index}: routing of shape {tuple(s.routing.shape)} (max "
                                 f"{int(s.routing.max())}) is not [tokens, {shape[0]} MoE layers of this rank, "
                                 f"top-{shape[1]}] expert indices below {self.model_cfg.num_experts}: it was recorded "
                                 "by another model or layout")

    def _gradients_finite(self) -> bool:
        """Whether every gradient of this step is finite, and (where Megatron's step does not judge it itself,
        :func:`compat.norm_overflow_skip`) their global norm too, on every rank (the same answer everywhere).
        Megatron's optimizers skip a step only under an fp16 loss scaler; in fp32 and bf16 they would apply a NaN or
        inf gradient and write NaN into every weight. One inf-norm reduction per grad buffer (reduced gradients, in
        fp32), no copy of it; NaN propagates through it."""
        return self._elements_finite() and (self._optimizer_skips_overflow or self._norm_finite())

    def _norm_finite(self) -> bool:
        """Whether the global gradient norm is finite. Finite gradients overflow it in float32 (from ~1.8e19). With
        clipping on, the clip scales every gradient by max_norm / inf = 0 and the optimizer still steps, Adam's
        moments moving the weights on zero gradients, its step count and the schedule advancing; with clipping off,
        Adam squares the largest gradients into second moments of inf, which freeze those weights for the rest of
        the run (their update is 0 from then on). The norm is Megatron's own (get_grad_norm, the same on every rank)
        of the main gradients that prepare_grads copies in; step() copies them again (idempotent without an fp16
        loss scaler, which no config builds) and recomputes it: one more pass over the gradients per step, taken only
        on a megatron-core without ``grad_norm_skip_threshold`` (0.16)."""
        self.optimizer.prepare_grads()
        return math.isfinite(float(self.optimizer.get_grad_norm()))

    def _elements_finite(self) -> bool:
        norms = [torch.linalg.vector_norm(buffer.grad_data, ord=float("inf")).float().reshape(1)
                 for chunk in self.model for buffer in chunk.buffers + chunk.expert_parallel_buffers
                 if buffer.grad_data.numel()]
        bad = (~torch.isfinite(torch.cat(norms))).any().float().reshape(1) if norms else \
            torch.zeros(1, device=self.backend.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def save(self, root: str, *, keep: Optional[int] = None, tokenizer_assumed_for: Optional[str] = None,
             background: bool = False) -> str:
        """Save model, optimizer and schedule as ``root/step_<N>`` (atomic); see checkpoint.save_checkpoint. A save
        still being written in the background is completed first. ``background``: return once the state is handed to
        the background writer; the checkpoint exists only after :meth:`finish_save` (checkpoint.PendingSave)."""
        from spade_mega.megatron.checkpoint import save_checkpoint, start_async_save

        self.offloader.check_loaded("a save")
        self.finish_save(wait=True)
        if background:
            self.pending_save = start_async_save(self, root, keep=keep, tokenizer_assumed_for=tokenizer_assumed_for)
            return str(self.pending_save.path)
        return str(save_checkpoint(self, root, keep=keep, tokenizer_assumed_for=tokenizer_assumed_for))

    def finish_save(self, *, wait: bool) -> Optional[float]:
        """Complete the background save if every rank has written its files (``wait``: once they have); collective.
        The seconds its write took when it completed now, else None (still writing, or no save pending)."""
        pending, self.pending_save = self.pending_save, None
        if pending is None:
            return None
        took = pending.finish(wait=wait)  # a failed write raises on every rank, and is no longer pending
        if took is None:
            self.pending_save = pending
        return took

    def abandon_save(self) -> None:
        """An error exit with a save still written in the background: this rank's writer is killed and the partial
        folder removed (checkpoint.PendingSave.abandon). Completing it would take collectives that the other ranks,
        failed elsewhere or still running, might never join, so waiting for the write (minutes at scale) would only
        delay the exit; the previous checkpoint stays the newest."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.abandon()
            log.warning("%s: not completed (the run stopped on an error while it was written in the background: its "
                        "writer was stopped, its partial folder removed); the previous checkpoint stays the newest",
                        pending.path)

    def close(self) -> None:
        """Free what the trainer holds beyond itself, for a process that trains more than once (a sweep, a notebook,
        the tests); collective, and the trainer is unusable after it. A background save is completed first.

        Each trainer lived as long as the process, with its weights, optimizer state and process groups: DDP's
        gradient hooks sit on the parameters' gradient accumulators (autograd's C++ nodes, which the garbage
        collector cannot see through) and hold DDP, hence the model; the nodes were held by the optimizer's fp32
        shards (views of the parameters; the optimizer was held by the model's config, ``grad_scale_func``) and by
        the last step's graph, which the MoE dispatcher keeps (its ``probs``). Both links are cut here (the model
        leaves its DDP wrapper); Megatron's process-global MoE metrics and rotary cache, which hold the model's
        groups, are emptied; the groups are destroyed (parallel.release). The trainer then drops its model, optimizer
        and reference: a sweep's ``trainer = Trainer(cfg)`` builds the next one while the name still holds this one."""
        self.finish_save(wait=True)
        if hasattr(self, "config"):  # else its construction failed before (_released_on_failure)
            self.config.grad_scale_func = None
        for chunk in getattr(self, "model", []):
            chunk.module = None
        if self.model_cfg.num_experts:
            compat.reset_moe_metrics()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.forward.cache_clear()
        release(self.groups)
        self.offloader = None  # and its host copies
        self.model = []
        self.optimizer = self.scheduler = self.reference = self.routing = None

    def load(self, path: str, *, weights_only: bool = False) -> int:
        """Load a checkpoint written by any layout (a step folder, or a root: its newest complete step);
        ``weights_only`` skips the optimizer state (exports, evaluation)."""
        from spade_mega.megatron.checkpoint import load_checkpoint

        self.offloader.check_loaded("a load")
        return load_checkpoint(self, path, weights_only=weights_only)
