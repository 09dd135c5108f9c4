"""Weights & Biases sink: the records of ``metrics.jsonl``, name for name and record for record, sent to a W&B run.

wandb is an optional extra (``pip install 'spade-mega[wandb]'``), imported only when ``logging.wandb`` is on: without
it, importing spade_mega.monitor never imports wandb. :func:`require_wandb` lets a run fail at its start, before the
model is built, when the setting is on and the package is missing or older than 0.31.

Every record is one W&B row, logged at once, with the record's step as the metric ``rollout``: W&B's x-axis for every
metric (``define_metric``), not W&B's own ``_step``. W&B ignores a row logged at an earlier ``_step`` than its last,
so a record that comes late (the evaluation a resumed run redoes after a SIGUSR1 stop, or a rollout's evaluation
scores, a second record of its step) would be lost with ``step=``; with its own x-axis each lands at its rollout.

One W&B run per spade-mega run: its id is kept in ``run_dir/wandb_run_id``. A run resumed from a checkpoint (requeued
by SLURM, or started again by hand) passes ``resume_step`` and continues that W&B run (``resume="allow"``) on the same
x-axis; a new run in the directory (its JSONL records are set aside) starts a new W&B run. W&B's history only grows:
rows the interrupted attempt sent after its last checkpoint stay there, so those rollouts show both attempts' values
(metrics.jsonl and TensorBoard keep this attempt's).

Failures: a new run whose W&B cannot start (online mode without an API key, wandb.init failing: a bad entity, no
network) stops before the model is built, on every rank (the loop opens the logger first). An online run never asks for
an API key: on a terminal wandb would prompt for one and the job would wait there. Any W&B error after that (its service
process gone, say), and a failing start when resuming (a requeued job meeting a W&B outage), is said once; the sink then
goes quiet and metrics.jsonl and TensorBoard go on, so monitoring never kills training. Nor does it hold the job's
nodes: at the run's end W&B uploads what it still holds and, with the network down, retries for many minutes;
``finish_timeout_s`` (default 120 s) bounds that wait, and what is left stays in the run's W&B files for ``wandb sync``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import string
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Optional

from spade_mega.config.schema import WandbConfig
from spade_mega.errors import SpadeError
from spade_mega.files import replace_atomically

log = logging.getLogger("spade_mega.monitor")
WANDB_EXTRA = "pip install 'spade-mega[wandb]'"
OLDEST_WANDB = (0, 31)  # the oldest tested; wandb.login(prompt=False), which the sink calls, is new in 0.30
DEFAULT_PROJECT = "spade-mega"
RUN_ID_FILE = "wandb_run_id"
STEP_METRIC = "rollout"  # W&B's x-axis: the record's step; metric names hold a '/', so none is called this
FINISH_TIMEOUT_S = 120.0  # logging.wandb.finish_timeout_s unset and no $WANDB_FINISH_TIMEOUT
_ID_CHARS = string.ascii_lowercase + string.digits  # W&B's own run id alphabet


class WandbError(SpadeError):
    """W&B logging cannot start: the package is missing, or wandb.init failed."""


def wandb_wanted(cfg: WandbConfig) -> bool:
    """Whether the run logs to W&B: ``enabled``, and the mode (the setting, else ``$WANDB_MODE``) not disabled."""
    return cfg.enabled and (cfg.mode or os.environ.get("WANDB_MODE")) != "disabled"


def import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError as exc:
        raise WandbError(f"logging.wandb.enabled is true but wandb cannot be imported ({exc}): {WANDB_EXTRA}, or "
                         "set logging.wandb.enabled=false") from None
    except Exception as exc:  # installed but broken: a broken install, a dependency at a version it cannot use
        raise WandbError(f"logging.wandb.enabled is true but importing wandb failed ({_said(exc)}): a broken install "
                         f"or a dependency wandb cannot use; reinstall it ({WANDB_EXTRA}), or set "
                         "logging.wandb.enabled=false") from exc
    check_wandb_version(getattr(wandb, "__version__", "0"))
    return wandb


def check_wandb_version(version: str) -> None:
    """Below the oldest tested wandb, refused by name: one before 0.30 has no wandb.login(prompt=False) and would fail
    at the run's start with a TypeError naming none of this."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < OLDEST_WANDB:
        oldest = ".".join(map(str, OLDEST_WANDB))
        raise WandbError(f"logging.wandb.enabled is true but wandb {version} is older than {oldest}, the oldest "
                         f"spade-mega is tested with: pip install -U 'wandb>={oldest}' ({WANDB_EXTRA} does), or set "
                         "logging.wandb.enabled=false")


def require_wandb(cfg: WandbConfig) -> None:
    """Fail now, naming the extra, when the run will log to W&B and wandb is not installed."""
    if wandb_wanted(cfg):
        import_wandb()


def _run_id(run_dir: Path, resume_step: Optional[int]) -> str:
    """The stored id when resuming (a run that never started W&B gets one now); a new id for a new run."""
    path = run_dir / RUN_ID_FILE
    if resume_step is not None and path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored and not set(stored) & set("/\\#?%: \t"):  # a hand-written id may name any W&B run
            return stored
        log.warning("%s: %r is not a W&B run id; this run logs to a new W&B run", path, stored[:80])
    run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    replace_atomically(path, lambda f: f.write(f"{run_id}\n".encode()))
    return run_id


def _finish_timeout(cfg: WandbConfig) -> Optional[float]:
    """The setting, else wandb's own $WANDB_FINISH_TIMEOUT (None: wandb reads it), else FINISH_TIMEOUT_S."""
    if cfg.finish_timeout_s is not None:
        return cfg.finish_timeout_s
    return None if os.environ.get("WANDB_FINISH_TIMEOUT") else FINISH_TIMEOUT_S


def _said(exc: BaseException) -> str:
    """An exception in one line: wandb's errors carry the Go side's retry log on further lines."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class MissingApiKey(Exception):
    """An online run without W&B credentials (looked up without asking for them)."""


def _check_credentials(wandb: ModuleType, mode: Optional[str]) -> None:
    """An online run needs an API key found without a prompt: wandb.init asks for one when stdin and stderr are a
    terminal (an interactive srun, torchrun in a shell), and the job would wait there, on rank 0 alone."""
    settings = wandb.setup(wandb.Settings(mode=mode) if mode else None).settings  # with $WANDB_MODE, `wandb offline`
    if settings.mode in ("offline", "dryrun", "disabled"):
        return
    if not wandb.login(prompt=False, verify=False):
        raise MissingApiKey(f"online mode and no W&B API key for {settings.base_url}: run `wandb login` once (it "
                            "writes ~/.netrc, which every node of a shared home reads) or export WANDB_API_KEY, or "
                            "set logging.wandb.mode=offline and `wandb sync` the run later")


class WandbSink:
    """Sends each record to a W&B run as one row at ``rollout`` = the record's step; see the module docstring for
    resume and failures."""

    def __init__(self, run_dir: Path, cfg: WandbConfig, resume_step: Optional[int],
                 run_config: Optional[Mapping[str, Any]] = None) -> None:
        self._wandb = import_wandb()
        run_id = _run_id(run_dir, resume_step)
        project = cfg.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        finish_timeout = _finish_timeout(cfg)
        self._run: Any = None
        try:
            _check_credentials(self._wandb, cfg.mode)
            self._run = self._wandb.init(
                project=project, entity=cfg.entity, group=cfg.group, name=cfg.name or run_dir.name,
                tags=list(cfg.tags) or None, mode=cfg.mode, id=run_id, resume="allow",
                config=dict(run_config) if run_config is not None else None,
                # wandb's files beside the run's own, unless $WANDB_DIR puts them elsewhere (a scratch file system)
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                settings=self._wandb.Settings(finish_timeout_raises=True, **(
                    {} if finish_timeout is None else {"finish_timeout": finish_timeout})))
            self._run.define_metric(STEP_METRIC)
            self._run.define_metric("*", step_metric=STEP_METRIC)
        except Exception as exc:
            if resume_step is not None:  # a requeued job must not die of a W&B outage at its restart
                self._stop(f"to start when resuming from step {resume_step}", exc)
                return
            if isinstance(exc, MissingApiKey):
                raise WandbError(f"logging.wandb: {exc}") from None
            raise WandbError(f"logging.wandb: wandb.init failed for run id {run_id} ({_said(exc)}); "
                             "online mode needs an API key (wandb login, or $WANDB_API_KEY) and the network, or set "
                             "logging.wandb.mode=offline and `wandb sync` the run later") from exc
        log.info("W&B run %s (project %s, mode %s)", run_id, project, self._run.settings.mode)

    def write(self, step: int, wall_time: float, metrics: Mapping[str, float | int]) -> None:
        if self._run is None:
            return
        try:
            self._run.log({STEP_METRIC: step, **metrics})  # its own row, at once: no step= (see the docstring)
        except Exception as exc:
            self._stop(f"at step {step}", exc)

    def close(self, failed: bool = False) -> None:
        if self._run is None:
            return
        try:
            self._run.finish(exit_code=1 if failed else 0)
        except TimeoutError:  # finish_timeout_s ran out: the data is on disk, the job's nodes are free to go
            log.warning("W&B did not finish uploading this run within %s s (logging.wandb.finish_timeout_s, else "
                        "$WANDB_FINISH_TIMEOUT); what it holds is kept in %s: `wandb sync --include-online` that "
                        "directory later", self._run.settings.finish_timeout, self._run.settings.sync_dir)
        except Exception as exc:
            self._stop("when finishing the run", exc)
        self._run = None

    def _stop(self, when: str, exc: Exception) -> None:
        """Say it once, then stop: the W&B run ends here, the other sinks go on."""
        log.warning("W&B logging failed %s (%s) and is off for the rest of this run; metrics.jsonl and TensorBoard "
                    "go on", when, _said(exc))
        self._run = None
        try:
            self._wandb.teardown()  # its service connection, or wandb's exit hook reports the same failure again
        except Exception:
            pass  # the failure was just reported; a broken connection cannot be torn down more cleanly
