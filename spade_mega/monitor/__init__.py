"""Monitoring of a run: metric sinks (JSONL, TensorBoard, W&B), NVML GPU stats, progress, console logging, the report.

What a training loop calls (on every rank; only rank 0 writes or prints)::

    setup_logging(cfg.logging)
    start = resumed_step or 0  # resumed_step: the step of the checkpoint resumed from, None for a new run
    with MetricsLogger(run_dir, cfg.logging, resume_step=resumed_step) as metrics, \\
         RunProgress(cfg.selfplay.num_rollouts, "rollouts", cfg=cfg.logging, start=start) as bar:
        for step in range(start + 1, cfg.selfplay.num_rollouts + 1):
            ...
            metrics.log(step, rollout_metrics, commit=False)      # agent/return, designer/regret, envs/valid_rate
            metrics.log(step, result.metrics, prefix="train")     # StepResult.metrics: loss, grad_norm, ...
            bar.update(step, {**rollout_metrics, "train/loss": result.metrics["loss"]})

``spade-mega report RUN_DIR`` turns ``metrics.jsonl`` into ``report.html`` with plots.
"""

from spade_mega.monitor.console import setup_logging
from spade_mega.monitor.gpu import GpuReading, GpuStats, gpu_metrics
from spade_mega.monitor.metrics import MetricsLogger, current_rank
from spade_mega.monitor.progress import RunProgress
from spade_mega.monitor.records import METRICS_FILE, MetricError, Record, scan
from spade_mega.monitor.wandb_sink import WandbError, require_wandb

__all__ = ["GpuReading", "GpuStats", "METRICS_FILE", "MetricError", "MetricsLogger", "Record", "RunProgress",
           "WandbError", "current_rank", "gpu_metrics", "require_wandb", "scan", "setup_logging"]
