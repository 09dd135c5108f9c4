"""What runs on each node inside a SLURM job: rank wiring from SLURM's variables, engine servers, health waits.

The rendered sbatch script (``sbatch.py``) starts every process through ``python -m spade_mega.launch.node``, so this
module, not shell arithmetic, decides who is rank 0 and where the rendezvous is:

* ``exec``: derive MASTER_ADDR (first host of SLURM_JOB_NODELIST, expanded here in Python, no ``scontrol`` needed
  inside containers), MASTER_PORT, the node rank (SLURM_NODEID) and, for ``--launcher srun``, RANK / WORLD_SIZE /
  LOCAL_RANK from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; optionally wait for the engine servers' /health; then
  replace itself with torchrun (one per node) or with the program (one srun task per GPU).
* ``serve``: start this node's engine servers, each on its own GPUs and port; stop them all when one exits.
* ``finished``: whether the run of a config is already complete (a requeued or resubmitted job then starts nothing).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from spade_mega.errors import SpadeError

PORT_FLAG = "--port"  # in a ``serve`` command, followed by the port of the node's first server
UNFINISHED = 3  # exit status of ``finished`` when the run has rollouts left (0: complete; 2: cannot tell)


class SlurmEnvError(SpadeError):
    """The SLURM environment lacks or garbles what a launch needs (a variable, a host list)."""


def _split_top_level(text: str) -> list[str]:
    """Split at commas that are not inside brackets: ``a[1-2],b`` -> ``['a[1-2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"host list {text!r}: unbalanced ']' at position {i}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"host list {text!r}: unclosed '['")
    parts.append(text[start:])
    return parts


def _expand_range(spec: str, text: str) -> list[str]:
    """``001-003,010`` -> ``['001', '002', '003', '010']``, keeping zero padding as SLURM does."""
    out: list[str] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise SlurmEnvError(f"host list {text!r}: bad range {item!r} inside brackets")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise SlurmEnvError(f"host list {text!r}: range {item!r} runs backwards")
        width = len(first) if first.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list (``gpu[001-004,010],login1``, ``rack[1-2]-node[01-02]``) in SLURM's order."""
    text = text.strip()
    if not text:
        raise SlurmEnvError("empty host list")
    hosts: list[str] = []
    for part in _split_top_level(text):
        if not part:
            raise SlurmEnvError(f"host list {text!r}: empty host name between commas")
        expanded = [""]
        for literal, has_bracket, bracket in re.findall(r"([^\[]*)(\[([^\]]*)\])?", part):
            choices = _expand_range(bracket, text) if has_bracket else [""]
            expanded = [head + literal + tail for head in expanded for tail in choices]
        hosts += expanded
    return hosts


@dataclass(frozen=True)
class NodeWiring:
    """Where this process sits in the job, from SLURM's variables."""

    hosts: tuple[str, ...]  # every node of the job, in SLURM's order
    node_rank: int  # SLURM_NODEID
    master_addr: str
    master_port: int

    def engine_urls(self, first_node: int, nodes: int, servers_per_node: int, port: int) -> list[str]:
        """URLs of the engine servers on ``nodes`` nodes from index ``first_node`` of the job's host list; those on
        this node by loopback (the engine then knows they share this node's /dev/shm for weight updates)."""
        if first_node + nodes > len(self.hosts):
            raise SlurmEnvError(f"engine nodes {first_node}..{first_node + nodes - 1} lie outside the job's "
                                f"{len(self.hosts)} nodes ({','.join(self.hosts)})")
        return [f"http://{'127.0.0.1' if index == self.node_rank else self.hosts[index]}:{port + i}"
                for index in range(first_node, first_node + nodes) for i in range(servers_per_node)]


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise SlurmEnvError(f"{name} is not set: run this inside a SLURM job step (srun), not on a login node")
    if not value.isdigit():
        raise SlurmEnvError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


DEFAULT_MASTER_PORTS = range(20000, 30000)  # where default_master_port falls; the launch plan keeps servers out


def default_master_port(environ: Mapping[str, str]) -> int:
    """20000 + job id % 10000: the same on every node of a job, different for jobs that share a node, and below the
    engine servers' ports (launch.engine_port, 30000 by default)."""
    return DEFAULT_MASTER_PORTS.start + _int_var(environ, "SLURM_JOB_ID") % len(DEFAULT_MASTER_PORTS)


def node_wiring(environ: Mapping[str, str], master_port: Optional[int] = None) -> NodeWiring:
    """Read the job's host list, this node's rank and the rendezvous address from SLURM's variables."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set: run this inside a SLURM job step (srun)")
    hosts = tuple(expand_hostlist(nodelist))
    node_rank = _int_var(environ, "SLURM_NODEID")
    if node_rank >= len(hosts):
        raise SlurmEnvError(f"SLURM_NODEID={node_rank} but the job has {len(hosts)} nodes ({nodelist})")
    port = master_port if master_port is not None else default_master_port(environ)
    return NodeWiring(hosts=hosts, node_rank=node_rank, master_addr=hosts[0], master_port=port)


def torch_env(environ: Mapping[str, str], wiring: NodeWiring, launcher: str) -> dict[str, str]:
    """The torch.distributed variables for this process: the rendezvous, plus the rank itself under srun."""
    env = {"MASTER_ADDR": wiring.master_addr, "MASTER_PORT": str(wiring.master_port)}
    if launcher == "srun":
        rank, world = _int_var(environ, "SLURM_PROCID"), _int_var(environ, "SLURM_NTASKS")
        local = _int_var(environ, "SLURM_LOCALID")
        if rank >= world:
            raise SlurmEnvError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}")
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), GROUP_RANK=str(wiring.node_rank))
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
        if per_node.isdigit():
            env["LOCAL_WORLD_SIZE"] = per_node
    return env


def node_command(wiring: NodeWiring, launcher: str, nproc_per_node: int, nnodes: int, program: Sequence[str],
                 shutdown_timeout_s: Optional[int] = None) -> tuple[list[str], dict[str, str]]:
    """The command this node runs and the variables it needs: torchrun for the node's ``nproc_per_node`` ranks, or
    the program itself (srun: this task is one rank).

    torchrun takes SIGUSR1 (the job's time-limit warning) as one of the signals it hands on to every rank, and gives
    the ranks ``shutdown_timeout_s`` before killing them. Both go through torchrun's PET_* variables, not flags: a
    torchrun older than these options (torch < 2.9) ignores them instead of refusing to start; there, SIGUSR1 stops
    the ranks at once and the requeued job resumes from its last periodic checkpoint.
    """
    if not program:
        raise SlurmEnvError("no program given after '--' (e.g. -- -m spade_mega.cli train config.yaml)")
    if launcher == "srun":
        return [sys.executable, *program], {}
    if wiring.node_rank >= nnodes:
        raise SlurmEnvError(f"SLURM_NODEID={wiring.node_rank} is not one of the trainer's {nnodes} nodes "
                            "(the training step must start on the first nodes of the job)")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               f"--nproc-per-node={nproc_per_node}", f"--node-rank={wiring.node_rank}",
               f"--master-addr={wiring.master_addr}", f"--master-port={wiring.master_port}", *program]
    env = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    if shutdown_timeout_s is not None:
        env["PET_SHUTDOWN_TIMEOUT"] = str(shutdown_timeout_s)
    return command, env


def wait_healthy(urls: Sequence[str], timeout_s: float, poll_s: float = 2.0) -> None:
    """Return once every ``URL/health`` answers 200; raise naming the servers still down after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    last_error: dict[str, str] = {}
    while pending:
        for url in list(pending):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=min(10.0, max(poll_s, 1.0))) as reply:
                    if reply.status == 200:
                        pending.remove(url)
                        continue
                    last_error[url] = f"HTTP {reply.status}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # Bad*: not HTTP there
                last_error[url] = str(getattr(exc, "reason", exc))
        if not pending:
            return
        if time.monotonic() >= deadline:
            down = ", ".join(f"{u} ({last_error.get(u, 'no answer')})" for u in pending)
            raise SlurmEnvError(f"engine servers not healthy after {timeout_s:g} s: {down}; see the engine logs "
                                "(launch.log_dir), or raise launch.engine_start_timeout_s")
        time.sleep(poll_s)


def server_commands(command: Sequence[str], servers: int, gpus_per_server: int,
                    environ: Mapping[str, str]) -> list[tuple[list[str], dict[str, str]]]:
    """One (argv, env) per server of this node: its own slice of GPUs, and its own port, counting up from the one
    after ``--port`` in ``command`` (both SGLang and vLLM take ``--port N``)."""
    if PORT_FLAG not in command[:-1]:
        raise SlurmEnvError(f"the server command must give its port as '{PORT_FLAG} N': {' '.join(command)}")
    at = list(command).index(PORT_FLAG) + 1
    if not command[at].isdigit():
        raise SlurmEnvError(f"the server command's {PORT_FLAG} must be a number, got {command[at]!r}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(servers * gpus_per_server)]
    if len(gpus) < servers * gpus_per_server:
        raise SlurmEnvError(f"{servers} servers x {gpus_per_server} GPUs need {servers * gpus_per_server} GPUs, "
                            f"this node shows {len(gpus)} (CUDA_VISIBLE_DEVICES={visible})")
    out = []
    for i in range(servers):
        argv = list(command)
        argv[at] = str(int(command[at]) + i)
        env = dict(environ, CUDA_VISIBLE_DEVICES=",".join(gpus[i * gpus_per_server:(i + 1) * gpus_per_server]))
        out.append((argv, env))
    return out


def serve(commands: Sequence[tuple[list[str], dict[str, str]]], poll_s: float = 1.0) -> int:
    """Run this node's servers until one exits or this process is asked to stop; then stop the rest.

    Returns the first non-zero exit status (or 0), so srun and the job script see a crashed server. The caller's
    SIGTERM and SIGINT handlers are back when it returns (a Ctrl-C after it is the caller's again).
    """
    procs = [subprocess.Popen(argv, env=env, start_new_session=True) for argv, env in commands]
    stop = {"signal": 0}

    def _stop(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        while not stop["signal"]:
            exited = [p for p in procs if p.poll() is not None]
            if exited:
                code = next((p.returncode for p in exited if p.returncode), 0)
                status = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
                print(f"spade-mega: engine server {' '.join(exited[0].args)} exited with status "
                      f"{exited[0].returncode}; stopping this node's servers", file=sys.stderr, flush=True)
                break
            time.sleep(poll_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status if not stop["signal"] else 128 + stop["signal"]


def finished_run(config: str) -> Optional[str]:
    """The line saying that the run of ``config`` is complete, or None when it has rollouts left (or none done).

    The run is complete when its newest checkpoint's loop state (selfplay/state.py) counts selfplay.num_rollouts
    rollouts: the loop saves at its last rollout, so a job requeued after that (a time-limit warning that came
    during the last save or the report) would start its engine servers, minutes on a cluster, only for the trainer
    to find nothing to do. Under run.resume never the trainer's own refusal is left to speak."""
    from spade_mega.config.loader import load_config
    from spade_mega.selfplay.state import CheckpointStore

    cfg = load_config(config)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    store = CheckpointStore(run_dir)
    latest = store.latest() if cfg.run.resume != "never" else None
    if latest is None:
        return None
    done, total = store.read_state(latest).rollout, cfg.selfplay.num_rollouts
    if done < total:
        return None
    return (f"spade-mega: run {cfg.run.name!r} is already complete ({done} of {total} rollouts, checkpoint "
            f"{latest}): nothing to start; its report: spade-mega report {run_dir}")


def _split_program(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Arguments before ``--`` are ours, the rest is the program (argparse would eat its options)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spade_mega.launch.node", description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    run = actions.add_parser("exec", help="wire torch.distributed from SLURM's variables, then exec the trainer")
    run.add_argument("--launcher", choices=("torchrun", "srun"), required=True)
    run.add_argument("--nproc-per-node", type=int, required=True)
    run.add_argument("--nnodes", type=int, required=True, help="nodes of the trainer (the first of the job)")
    run.add_argument("--master-port", type=int, default=None, help="default: 20000 + SLURM_JOB_ID %% 10000")
    run.add_argument("--shutdown-timeout", type=int, default=None, help="torchrun's grace after a signal (s)")
    run.add_argument("--engines", default=None, metavar="FIRST:NODES:SERVERS:PORT",
                     help="engine servers to wait for and pass on as SPADE_ENGINE_URLS")
    run.add_argument("--engine-timeout", type=float, default=1800.0)
    srv = actions.add_parser("serve", help="run this node's engine servers (ports from the command's --port up)")
    srv.add_argument("--servers", type=int, required=True)
    srv.add_argument("--gpus-per-server", type=int, required=True)
    done = actions.add_parser("finished", help=f"exit 0 (with a line saying so) when the run of CONFIG is complete, "
                                               f"{UNFINISHED} when it has rollouts left")
    done.add_argument("config", metavar="CONFIG", help="the job's resolved config")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    ours, program = _split_program(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(ours)
    environ = dict(os.environ)
    try:
        if args.action == "serve":
            return serve(server_commands(program, args.servers, args.gpus_per_server, environ))
        if args.action == "finished":
            line = finished_run(args.config)
            if line is not None:
                print(line, file=sys.stderr)
            return UNFINISHED if line is None else 0
        wiring = node_wiring(environ, args.master_port)
        env = torch_env(environ, wiring, args.launcher)
        if args.engines:
            try:
                first, nodes, servers, port = (int(x) for x in args.engines.split(":"))
            except ValueError:
                raise SlurmEnvError(f"--engines must be FIRST:NODES:SERVERS:PORT, got {args.engines!r}") from None
            urls = wiring.engine_urls(first, nodes, servers, port)
            env["SPADE_ENGINE_URLS"] = ",".join(urls)
            print(f"spade-mega: node {wiring.node_rank} waiting for {len(urls)} engine server(s)", file=sys.stderr,
                  flush=True)
            wait_healthy(urls, args.engine_timeout)
        command, launcher_env = node_command(wiring, args.launcher, args.nproc_per_node, args.nnodes, program,
                                             args.shutdown_timeout)
        env.update(launcher_env)
    except SpadeError as exc:
        print(f"spade-mega: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execve(command[0], command, {**environ, **env})


if __name__ == "__main__":
    sys.exit(main())
