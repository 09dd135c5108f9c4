"""Render a self-contained sbatch script from a resolved config (``spade-mega launch slurm``).

The script embeds the resolved config (written to the log directory when the job starts), so the job runs exactly
what was rendered, requeues included. Rendering is deterministic: the same config gives the same bytes (no dates, no
user names), which lets examples/slurm/ be checked against the renderer. Every process is started through
``python -m spade_mega.launch.node`` (see node.py): the shell only allocates steps and supervises them.

Time limit: SLURM sends the batch shell SIGUSR1 ``launch.signal_before_s`` before the limit (``--signal=B:USR1@S``).
The script passes it to the training step; torchrun hands it on to every rank (node.py sets its signals_to_handle)
and gives the ranks ``signal_before_s - 60`` seconds before it kills them; a training step still running 30 seconds
before the limit (launcher srun has no torchrun to bound it) is stopped by the script. Then the script requeues the
job, which resumes from the newest checkpoint (``run.resume: auto``).
"""

from __future__ import annotations

import shlex
from typing import Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import to_yaml
from spade_mega.config.schema import SpadeConfig
from spade_mega.launch.node import UNFINISHED
from spade_mega.launch.plan import LaunchPlan, plan_launch

CONFIG_DELIMITER = "SPADE_MEGA_RESOLVED_CONFIG"
RENDERED_BY = "rendered by `spade-mega launch slurm`"  # in the header: a file the CLI may overwrite when re-rendering
TRAIN_PROGRAM = ("-m", "spade_mega.cli", "train")  # run by every rank; global rank 0 owns the rollout


class _Shell(str):
    """A word of the script's own that the shell must expand (``"$CONFIG"``); every other word is quoted."""


CONFIG_WORD = _Shell('"$CONFIG"')


def _q(text: str) -> str:
    return shlex.quote(text)


def _directive_value(key: str, value: str) -> str:
    """A config value going into an #SBATCH line: one line (a newline would end the directive block and run the rest
    as a command), quoted there by the caller."""
    if "\n" in value or "\r" in value:
        raise ConfigError(key, f"must be one line: it goes into an #SBATCH directive, got {value!r}")
    return value


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _wrap(words: Sequence[str], width: int = 100) -> list[str]:
    """Words over lines of about ``width`` characters, breaking only before an option."""
    lines = [words[0]]
    for word in words[1:]:
        if word.startswith("-") and len(lines[-1]) + len(word) > width:
            lines.append(word)
        else:
            lines[-1] += " " + word
    return lines


def _command(argv: Sequence[str], indent: str = "  ") -> str:
    """A command over several lines: our own arguments, then the program after ``--`` on lines of its own."""
    words = [a if isinstance(a, _Shell) else _q(a) for a in argv]
    lines = _wrap(words[:words.index("--") + 1]) + _wrap(words[words.index("--") + 1:]) if "--" in words \
        else _wrap(words)
    return f" \\\n{indent}".join(lines)


def _directives(cfg: SpadeConfig, plan: LaunchPlan) -> list[str]:
    """The #SBATCH options, each quoted as one word (sbatch splits the line at blanks and an unquoted '#' starts a
    comment there)."""
    launch = cfg.launch
    job_name = _directive_value("launch.job_name" if launch.job_name else "run.name", plan.job_name)
    if "/" in job_name:
        raise ConfigError("launch.job_name", f"must not contain '/': the job's files are log_dir/JOB_NAME-ID.*, got "
                                             f"{job_name!r}")
    log_dir = _directive_value("launch.log_dir", launch.log_dir)
    if "%" in log_dir:
        raise ConfigError("launch.log_dir", f"must not contain '%': sbatch expands it in the job's --output file, "
                                            f"the script's own files would go elsewhere, got {log_dir!r}")
    tasks = launch.gpus_per_node if launch.launcher == "srun" else 1
    out = [f"--job-name={job_name}", f"--nodes={plan.total_nodes}", f"--ntasks-per-node={tasks}",
           f"--gpus-per-node={launch.gpus_per_node}", f"--time={launch.time}"]
    out += [f"--cpus-per-task={launch.cpus_per_task}"] if launch.cpus_per_task else []
    out += [f"--{name}={getattr(launch, name)}" for name in ("partition", "account", "qos") if getattr(launch, name)]
    out += [f"--chdir={_directive_value('launch.workdir', launch.workdir)}"] if launch.workdir else []
    out += [f"--output={log_dir}/%x-%j.out", "--open-mode=append"]
    out += ["--requeue", f"--signal=B:USR1@{launch.signal_before_s}"] if launch.requeue else ["--no-requeue"]
    return [_q(option) for option in out + list(launch.sbatch_extra)]


def _setup(setup: Sequence[str]) -> list[str]:
    """The launch.setup lines, each checked: one that fails (a module that does not exist, a conda environment that
    does not activate) stops the job, naming it, before any step starts; the trainer would otherwise start in the
    wrong environment, or fail minutes later, after the engine servers. Each line is eval'd in the script's own
    shell (what it sets stays), so a trailing comment cannot hide the check and a line with a syntax error fails
    alone instead of breaking the script; without set -u, as activation scripts (conda's, some module systems') read
    unset variables."""
    if not setup:
        return []
    return ["set +u", "SETUP_LINES=(", *(f"  {_q(line)}" for line in setup), ")",
            'for SETUP_INDEX in "${!SETUP_LINES[@]}"; do',
            '  eval "${SETUP_LINES[SETUP_INDEX]}" || { SETUP_STATUS=$?; echo "spade-mega: launch.setup[$SETUP_INDEX] '
            'failed with exit status $SETUP_STATUS, stopping the job before anything starts: '
            '${SETUP_LINES[SETUP_INDEX]}" >&2; exit "$SETUP_STATUS"; }',
            "done",
            "set -u"]


def _srun_prefix(cfg: SpadeConfig) -> str:
    launch = cfg.launch
    words = ["srun", "--kill-on-bad-exit=1"]
    if launch.container_image:
        words += [f"--container-image={launch.container_image}", _Shell('--container-workdir="$PWD"')]
        if launch.container_mounts:
            words.append(f"--container-mounts={','.join(launch.container_mounts)}")
    return " ".join(w if isinstance(w, _Shell) else _q(w) for w in words)


def _finished_step(cfg: SpadeConfig) -> list[str]:
    """A requeued (or resubmitted) job whose run is already complete exits 0 here, before any server starts."""
    argv = [cfg.launch.python, "-m", "spade_mega.launch.node", "finished", CONFIG_WORD]
    step = "--nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=0"
    return [
        "# A requeued or resubmitted job whose run is already complete (its loop state counts every rollout) stops "
        "here.",
        f'"${{SRUN[@]}}" {step} {_command(argv)}',
        "FINISHED=$?",
        'if [[ "$FINISHED" == 0 ]]; then exit 0; fi',
        f'if [[ "$FINISHED" != {UNFINISHED} ]]; then',
        '  echo "spade-mega: cannot tell whether the run is complete (exit status $FINISHED, see above); nothing '
        'started" >&2',
        '  exit "$FINISHED"',
        "fi",
        "",
    ]


def _engine_step(cfg: SpadeConfig, plan: LaunchPlan) -> list[str]:
    e = plan.engines
    if e is None:
        return []
    where = "on the trainer's nodes" if e.placement == "colocated" else "on nodes of their own"
    argv = [cfg.launch.python, "-m", "spade_mega.launch.node", "serve", "--servers", str(e.servers_per_node),
            "--gpus-per-server", str(e.gpus_per_server), "--", *e.command]
    step = ["--overlap", f"--nodes={e.nodes}", f"--ntasks={e.nodes}", "--ntasks-per-node=1",
            f"--relative={e.first_node}", f'--output="$LOG_DIR/%x-%j-engines-%N.out"', "--open-mode=append"]
    return [
        f"# Engine servers ({e.placement}, {where}): {_n(e.servers_per_node, e.engine + ' server')} of "
        f"{_n(e.gpus_per_server, 'GPU')} on each of {_n(e.nodes, 'node')}, ports from {e.port}, logs in $LOG_DIR.",
        f'"${{SRUN[@]}}" {" ".join(step)} \\\n  {_command(argv)} &',
        "ENGINE_PID=$!",
        "",
    ]


def _train_step(cfg: SpadeConfig, plan: LaunchPlan) -> list[str]:
    launch, e = cfg.launch, plan.engines
    per_node = launch.gpus_per_node if launch.launcher == "srun" else 1
    argv = [launch.python, "-m", "spade_mega.launch.node", "exec", "--launcher", launch.launcher,
            "--nproc-per-node", str(launch.gpus_per_node), "--nnodes", str(plan.train_nodes)]
    argv += ["--master-port", str(launch.master_port)] if launch.master_port else []
    argv += ["--shutdown-timeout", str(max(launch.signal_before_s - 60, 30))] if launch.requeue else []
    if e is not None:
        argv += ["--engines", f"{e.first_node}:{e.nodes}:{e.servers_per_node}:{e.port}",
                 "--engine-timeout", str(launch.engine_start_timeout_s)]
    argv += ["--", *TRAIN_PROGRAM, CONFIG_WORD]
    step = (["--overlap"] if e is not None and e.placement == "colocated" else []) + [
        f"--nodes={plan.train_nodes}", f"--ntasks={plan.train_nodes * per_node}", f"--ntasks-per-node={per_node}",
        "--relative=0"]
    who = (f"one torchrun per node, {_n(launch.gpus_per_node, 'rank')} each" if launch.launcher == "torchrun"
           else f"one srun task per rank, {launch.gpus_per_node} per node")
    return [
        f"# Trainer: {_n(plan.layout.world_size, 'rank')} ({plan.layout.describe()}) on {_n(plan.train_nodes, 'node')}, "
        f"{who};",
        "# global rank 0 (first node) owns the rollout" + (", its engine URLs in SPADE_ENGINE_URLS." if e else
                                                             f" and runs the {cfg.rollout.engine} engine in-process."),
        f'"${{SRUN[@]}}" {" ".join(step)} \\\n  {_command(argv)} &',
        "TRAIN_PID=$!",
        "",
    ]


_SUPERVISE = """\
# Supervise: wait for the trainer; a crashed engine step stops it (a trainer without engines would hang).
STATUS=""
while [[ -z "$STATUS" ]]; do
  if ! kill -0 "$TRAIN_PID" 2>/dev/null; then
    wait "$TRAIN_PID"; STATUS=$?
  elif [[ -n "$ENGINE_PID" && "$ENGINE_FAILED" == 0 ]] && ! kill -0 "$ENGINE_PID" 2>/dev/null; then
    echo "spade-mega: the engine servers exited; stopping the trainer (see $LOG_DIR)" >&2
    ENGINE_FAILED=1
    kill -TERM "$TRAIN_PID" 2>/dev/null
  elif [[ -n "$STOP_BY" ]] && (( SECONDS >= STOP_BY )); then
    echo "spade-mega: the trainer is still running $STOP_GRACE_S s after the time-limit warning; stopping it" >&2
    STOP_BY=""
    kill -TERM "$TRAIN_PID" 2>/dev/null
  else
    sleep 2 & wait $!
  fi
done
if [[ "$ENGINE_FAILED" == 1 && "$STATUS" == 0 ]]; then STATUS=1; fi
if [[ "$REQUEUE" == 1 ]]; then
  echo "spade-mega: requeueing job $SLURM_JOB_ID; it resumes from its newest checkpoint" >&2
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "spade-mega: scontrol requeue failed (see above): the run stopped at its newest checkpoint; submit this" \\
      "script again to resume it" >&2
    if [[ "$STATUS" == 0 ]]; then STATUS=1; fi
  fi
fi
exit "$STATUS"
"""


def render_sbatch(cfg: SpadeConfig, source: str) -> str:
    """The sbatch script for ``cfg`` (``source`` names the config in the header comment only)."""
    plan = plan_launch(cfg)
    launch = cfg.launch
    resolved = to_yaml(cfg)
    if any(line.strip() == CONFIG_DELIMITER for line in resolved.splitlines()):
        raise ConfigError("launch", f"the config contains the line {CONFIG_DELIMITER!r}, which ends the embedded "
                                    "config in the script; change that value")
    engine = (f"{plan.engines.engine} servers, {plan.engines.placement}" if plan.engines
              else f"{cfg.rollout.engine}, in-process on global rank 0")
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {d}" for d in _directives(cfg, plan)]
    lines += [
        "#",
        f"# spade-mega run {cfg.run.name!r}, {RENDERED_BY} from {source}.",
        f"# Trainer {plan.layout.describe()} on {plan.train_nodes} x {launch.gpus_per_node} GPUs; rollout engine: "
        f"{engine}.",
        "# The resolved config is embedded below: re-render this file after changing the config, do not edit it.",
        f"# Submit with `spade-mega launch slurm ... --submit`, or create {launch.log_dir}/ first, then sbatch this file.",
        "",
        "set -uo pipefail",
        ': "${SLURM_JOB_ID:?is not set: submit this script with sbatch}"',
        "",
    ]
    if launch.setup or launch.env:
        lines.append("# Environment (launch.setup, launch.env)")
    lines += _setup(launch.setup)
    lines += [f"export {key}={_q(value)}" for key, value in launch.env.items()]
    lines += [
        # sbatch --export=NONE (some centres' advice, or sbatch_extra) sets SLURM_EXPORT_ENV=NONE in the job, and srun
        # honours it: every step would start without the environment built above (setup, launch.env, the venv)
        "export SLURM_EXPORT_ENV=ALL",
        "export PYTHONUNBUFFERED=1",
        "",
        f"LOG_DIR={_q(launch.log_dir)}",
        'mkdir -p "$LOG_DIR"',
        'CONFIG="$LOG_DIR/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.yaml"',
        f"cat > \"$CONFIG\" <<'{CONFIG_DELIMITER}' || "
        '{ echo "spade-mega: cannot write the resolved config $CONFIG" >&2; exit 1; }',
        resolved.rstrip("\n"),
        CONFIG_DELIMITER,
        "",
        f"SRUN=({_srun_prefix(cfg)})",
        'ENGINE_PID=""; TRAIN_PID=""; ENGINE_FAILED=0; REQUEUE=0; STOP_BY=""',
        "stop_engines() {",
        '  if [[ -n "$ENGINE_PID" ]] && kill -0 "$ENGINE_PID" 2>/dev/null; then kill -TERM "$ENGINE_PID"; '
        'wait "$ENGINE_PID"; fi',
        "}",
        "trap stop_engines EXIT",
    ]
    if launch.requeue:
        lines += [
            # a trainer still running 30 s before the limit is stopped: after torchrun's grace, in time to requeue
            f"STOP_GRACE_S={launch.signal_before_s - 30}",
            "on_time_limit() {  # SIGUSR1 from --signal: checkpoint on every rank, stop, then requeue",
            f'  echo "spade-mega: time limit in {launch.signal_before_s} s: asking the trainer to checkpoint and '
            'stop" >&2',
            "  REQUEUE=1; STOP_BY=$((SECONDS + STOP_GRACE_S))",
            '  if [[ -n "$TRAIN_PID" ]]; then kill -USR1 "$TRAIN_PID" 2>/dev/null; fi',
            "}",
            "trap on_time_limit USR1",
        ]
    lines.append("")
    lines += _finished_step(cfg)
    lines += _engine_step(cfg, plan)
    lines += _train_step(cfg, plan)
    return "\n".join(lines) + "\n" + _SUPERVISE
