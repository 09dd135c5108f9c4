"""SLURM launch: the launch config's checks, placement against the parallel layout, the rendered sbatch script, and the
in-job wiring (host lists, ranks, rendezvous, engine servers) run for real as separate processes over gloo."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spade_mega.cli import main as cli_main
from spade_mega.config import ConfigError, load_config, to_dict
from spade_mega.config.schema import slurm_time_seconds
from spade_mega.launch import node
from spade_mega.launch.local import local_command
from spade_mega.launch.plan import minimal_world_size, plan_launch
from spade_mega.launch.sbatch import CONFIG_DELIMITER, render_sbatch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "examples/configs/qwen3_30b_a3b_games.yaml"
TINY = "examples/configs/tiny_cpu.yaml"
DATA = ROOT / "tests" / "data" / "launch"
# A node of a real 5-node job: what srun exports to the task of node index 2, local rank 3 (launcher srun, 8 per node)
SLURM_ENV = {"SLURM_JOB_ID": "4187321", "SLURM_JOB_NODELIST": "gpu[001-004,010]", "SLURM_NODEID": "2",
             "SLURM_PROCID": "19", "SLURM_NTASKS": "40", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "8",
             "SLURM_STEP_NUM_TASKS": "40"}


def recipe(*overrides: str):
    return load_config(ROOT / RECIPE, list(overrides))


def render(*overrides: str, path: str = RECIPE) -> str:
    return render_sbatch(load_config(ROOT / path, list(overrides)), path)


def config_error(*overrides: str, path: str = RECIPE) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        plan_launch(load_config(ROOT / path, list(overrides)))
    return info.value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the launch section and placement ---------------------------------------------------------------------------


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("5:30", 330), ("24:00:00", 86400), ("2-0", 172800),
                                          ("1-12:30", 131400), ("0-00:10:05", 605)])
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("override,key,words", [
    ("launch.time=24h", "launch.time", "SLURM time limit"),
    ("launch.time='1:2:3:4'", "launch.time", "SLURM time limit"),
    ("launch.time=24:00:00", "launch.time", "must be quoted"),  # YAML 1.1 reads it as the number 86400
    ("launch.time='10:00'", "launch.signal_before_s", "at least a minute"),
    ("launch.engine_placement=separate", "launch.engine_nodes", "exactly when"),
    ("launch.engine_nodes=2", "launch.engine_nodes", "exactly when"),
    ("launch.engine_gpus=3", "launch.engine_gpus", "must divide launch.gpus_per_node (8)"),
    ("run.resume=never", "launch.requeue", "run.resume 'auto'"),
    ("launch.env={'NCCL-DEBUG': INFO}", "launch.env.NCCL-DEBUG", "environment variable name"),
    ("launch.sbatch_extra=[exclusive]", "launch.sbatch_extra[0]", "one sbatch option"),
    ("launch.partition='gpu large'", "launch.partition", "without spaces"),
    ("launch.master_port=80", "launch.master_port", "[1024, 65535]"),
    ("launch.engine_placement=in_process", "launch.engine_placement", "needs rollout.engine 'hf'"),
])
def test_launch_section_rejects_bad_values_naming_the_key(override: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        recipe(override)
    assert info.value.path == key and words in info.value.message


def test_colocated_engines_need_a_server_engine() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / TINY, ["launch.engine_placement=colocated"])
    assert info.value.path == "launch.engine_placement" and "needs rollout.engine sglang or vllm" in str(info.value)
    assert plan_launch(load_config(ROOT / TINY, ["launch.gpus_per_node=1"])).engines is None  # hf: in-process


@pytest.mark.parametrize("overrides,key,needs", [
    (["launch.gpus_per_node=6"], "parallel.tensor", "6 processes"),  # TP4 does not divide 6
    (["launch.gpus_per_node=4"], "parallel.expert", "4 processes"),  # ETP1 x EP8 does not divide 4
    (["parallel.expert_tensor=4"], "parallel.expert", "8 processes"),  # the default ETP = TP4 would need 32
])
def test_world_size_must_fit_the_layout(overrides: list[str], key: str, needs: str) -> None:
    error = config_error(*overrides)
    assert error.path == key and needs in error.message
    assert "launch.nodes x launch.gpus_per_node" in error.message and "multiple of" in error.message


def test_recipe_places_trainer_and_colocated_sglang_on_one_node() -> None:
    plan = plan_launch(recipe())
    assert (plan.layout.world_size, plan.layout.tensor, plan.layout.expert, plan.layout.data) == (8, 4, 8, 2)
    e = plan.engines
    assert (e.engine, e.placement, e.first_node, e.nodes, e.servers_per_node, e.gpus_per_server) == \
        ("sglang", "colocated", 0, 1, 1, 8)
    assert plan.total_nodes == 1
    # the engine's own command (as a run starting its own server uses), plus colocation and expert parallelism
    from spade_mega.inference.sglang import SGLangEngine

    own = SGLangEngine.server_command("python", "checkpoints/Qwen3-30B-A3B", host="0.0.0.0", port=30000,
                                      tensor_parallel=8, dtype="bfloat16", max_model_len=32768)
    assert e.command == ("env", "HF_HUB_OFFLINE=1", "SGLANG_RETURN_ORIGINAL_LOGPROB=0", *own,
                         "--enable-memory-saver", "--ep-size", "8")


def test_separate_engine_nodes_come_after_the_trainer() -> None:
    plan = plan_launch(recipe("launch.nodes=2", "launch.engine_placement=separate", "launch.engine_nodes=3",
                              "launch.engine_gpus=4", "rollout.engine=vllm", "inference.hf_weights=/ckpt/base",
                              "inference.weight_sync_dir=/shared/sync", "inference.server_args=[--seed, '1']"))
    e = plan.engines
    assert (plan.train_nodes, plan.total_nodes, e.first_node, e.nodes, e.servers_per_node, e.count) == \
        (2, 5, 2, 3, 2, 6)
    assert "--enable-sleep-mode" not in e.command and "--enable-expert-parallel" in e.command
    assert e.command[e.command.index("--model") + 1] == "/ckpt/base" and e.command[-2:] == ("--seed", "1")
    assert e.command[e.command.index("--tensor-parallel-size") + 1] == "4"


@pytest.mark.parametrize("overrides,key", [
    (["inference.hf_weights=null"], "inference.hf_weights"),  # what would the servers load?
    (["launch.nodes=2"], "inference.weight_sync_dir"),  # servers on node 1 cannot read node 0's /dev/shm
    (["launch.engine_placement=separate", "launch.engine_nodes=1"], "inference.weight_sync_dir"),
])
def test_engine_servers_need_weights_and_a_shared_sync_folder(overrides: list[str], key: str) -> None:
    assert config_error(*overrides).path == key


@pytest.mark.parametrize("overrides,key,words", [
    (["launch.master_port=30000"], "launch.master_port", "30000"),  # the colocated server's port on node 0
    (["launch.engine_port=25000"], "launch.engine_port", "20000-29999"),  # the default master port's range
    (["launch.engine_port=65534", "launch.engine_gpus=2"], "launch.engine_port", "65537"),  # 4 servers
])
def test_engine_ports_must_not_collide_with_the_rendezvous(overrides: list[str], key: str, words: str) -> None:
    """Servers colocated with global rank 0 bind their ports on the node where torchrun binds the rendezvous port:
    a job whose ports collide would fail at start (or, on the default port's range, for some job ids only)."""
    error = config_error(*overrides)
    assert error.path == key and words in error.message
    separate = ["launch.engine_placement=separate", "launch.engine_nodes=1", "inference.weight_sync_dir=/s"]
    assert plan_launch(recipe("launch.master_port=30000", *separate)).engines.first_node == 1  # other nodes: fine


@pytest.mark.parametrize("args", ["[--port, '31000']", "['--port=31000']", "[--host, 127.0.0.1]"])
def test_server_args_may_not_move_the_servers_address(args: str) -> None:
    """The launcher gives each server of a node its own port (engine_port and up) and tells the trainer where they
    are; a --port in server_args comes later and wins, so every server of a node would take the same one."""
    error = config_error(f"inference.server_args={args}")
    assert error.path == "inference.server_args" and "launch.engine_port" in error.message


def test_minimal_world_size_is_the_smallest_world_both_grids_tile() -> None:
    assert minimal_world_size(recipe()) == 8  # TP4 and ETP1 x EP8
    assert minimal_world_size(recipe("parallel.expert_tensor=2")) == 16


# ---- the rendered script ----------------------------------------------------------------------------------------

VARIANTS = {
    "recipe": [],
    "srun-launcher": ["launch.launcher=srun", "launch.nodes=2", "launch.master_port=29400",
                      "inference.weight_sync_dir=/shared/sync"],
    "separate-vllm": ["rollout.engine=vllm", "launch.engine_placement=separate", "launch.engine_nodes=2",
                      "launch.engine_gpus=2", "inference.server_args=[--max-num-seqs, '512']",
                      "inference.weight_sync_dir=/shared/sync"],
    "cluster": ["launch.partition=h100", "launch.account=proj-42", "launch.qos=high", "launch.cpus_per_task=96",
                "launch.workdir=/scratch/me/spade", "launch.sbatch_extra=[--exclusive, --constraint=h100]",
                "launch.setup=['module load cuda/12.4', 'source $HOME/venvs/spade/bin/activate']",
                "launch.container_image=nvcr.io#nvidia/pytorch:25.01-py3",
                "launch.container_mounts=['/scratch:/scratch']", "launch.env={HF_HOME: /scratch/hf cache}"],
    "no-requeue": ["launch.requeue=false", "launch.time='30'"],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rendered_script_is_deterministic_and_valid_bash(name: str, tmp_path: Path) -> None:
    script = render(*VARIANTS[name])
    assert script == render(*VARIANTS[name])
    target = tmp_path / "job.sbatch"
    target.write_text(script)
    result = subprocess.run(["bash", "-n", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_script_run_outside_slurm_says_to_use_sbatch(tmp_path: Path) -> None:
    (tmp_path / "job.sbatch").write_text(render())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "SLURM_JOB_ID: is not set: submit this script with sbatch" in result.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "job.sbatch"]  # before anything was written


def directives(script: str) -> list[str]:
    return re.findall(r"^#SBATCH (\S+)$", script, flags=re.M)


def steps(script: str) -> list[str]:
    """The job's steps after the check that the run is not already complete: engine servers (if any), trainer."""
    finished, *rest = script.split('"${SRUN[@]}" ')[1:]
    assert "spade_mega.launch.node finished \"$CONFIG\"" in finished
    return rest


def test_recipe_script_directives_steps_and_environment() -> None:
    script = render()
    assert directives(script) == ["--job-name=qwen3_30b_a3b_games", "--nodes=1", "--ntasks-per-node=1",
                                  "--gpus-per-node=8", "--time=24:00:00", "--output=logs/%x-%j.out",
                                  "--open-mode=append", "--requeue", "--signal=B:USR1@600", "--exclusive"]
    assert "export NCCL_DEBUG=WARN\n" in script
    engine, train = steps(script)
    assert engine.startswith("--overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=0")
    assert "spade_mega.launch.node serve --servers 1 --gpus-per-server 8 --" in engine and "--port 30000" in engine
    assert train.startswith("--overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 --relative=0")
    flat = " ".join(train.replace("\\\n", " ").split())
    assert ("spade_mega.launch.node exec --launcher torchrun --nproc-per-node 8 --nnodes 1 --shutdown-timeout 540 "
            "--engines 0:1:1:30000 --engine-timeout 1800 -- -m spade_mega.cli train \"$CONFIG\" &") in flat
    assert "trap on_time_limit USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_cluster_script_carries_every_setting() -> None:
    script = render(*VARIANTS["cluster"])
    found = directives(script)
    for directive in ("--partition=h100", "--account=proj-42", "--qos=high", "--cpus-per-task=96",
                      "--chdir=/scratch/me/spade", "--exclusive", "--constraint=h100"):
        assert directive in found
    assert "  'module load cuda/12.4'\n  'source $HOME/venvs/spade/bin/activate'\n" in script
    assert "export HF_HOME='/scratch/hf cache'\n" in script
    assert ("SRUN=(srun --kill-on-bad-exit=1 '--container-image=nvcr.io#nvidia/pytorch:25.01-py3' "
            '--container-workdir="$PWD" --container-mounts=/scratch:/scratch)') in script


def test_srun_launcher_runs_one_task_per_gpu() -> None:
    script = render(*VARIANTS["srun-launcher"])
    assert "--ntasks-per-node=8" in directives(script) and "--nodes=2" in directives(script)
    train = steps(script)[-1]
    assert train.startswith("--overlap --nodes=2 --ntasks=16 --ntasks-per-node=8 --relative=0")
    assert "--launcher srun" in train and "--master-port 29400" in train


def test_separate_engines_get_their_own_nodes() -> None:
    script = render(*VARIANTS["separate-vllm"])
    assert "--nodes=3" in directives(script)
    engine, train = steps(script)
    assert engine.startswith("--overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 --relative=1")
    assert "--servers 4 --gpus-per-server 2" in engine and "--max-num-seqs 512" in engine
    assert train.startswith("--nodes=1 --ntasks=1")  # not --overlap: the trainer's node is its own
    assert "--engines 1:2:4:30000" in train


def test_directive_values_with_spaces_or_hashes_stay_one_option() -> None:
    """sbatch splits an #SBATCH line at blanks and drops what follows an unquoted '#' (as a comment)."""
    script = render("run.name='my run'", "launch.workdir='/scratch/my dir'", "launch.log_dir='my logs'",
                    "launch.sbatch_extra=['--comment=run #3']")
    options = [shlex.split(line[len("#SBATCH "):]) for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert all(len(option) == 1 for option in options), options
    found = [option[0] for option in options]
    for option in ("--job-name=my run", "--chdir=/scratch/my dir", "--output=my logs/%x-%j.out", "--comment=run #3"):
        assert option in found
    assert "LOG_DIR='my logs'\n" in script


@pytest.mark.parametrize("override,key", [
    ('launch.workdir="/scratch\\ntouch pwned"', "launch.workdir"),
    ('launch.log_dir="logs\\ntouch pwned"', "launch.log_dir"),
    ('run.name="spade\\ntouch pwned"', "run.name"),
    ("launch.log_dir='logs-%j'", "launch.log_dir"),  # sbatch expands it in --output, the script's LOG_DIR does not
    ("launch.job_name=team/spade", "launch.job_name"),  # the job's files are log_dir/JOB_NAME-ID.*
])
def test_directive_values_that_would_break_the_script_are_refused(override: str, key: str) -> None:
    """A newline would end the #SBATCH line: the rest would run as a shell command, before any directive after it
    (--output, --requeue, --signal) was read."""
    cfg = recipe(override)
    with pytest.raises(ConfigError) as info:
        render_sbatch(cfg, RECIPE)
    assert info.value.path == key


def test_program_words_are_quoted_even_when_they_look_like_shell_expansions(tmp_path: Path) -> None:
    """Only the script's own "$CONFIG" is left to the shell: a server argument like '"$(...)' is one quoted word."""
    script = render('inference.server_args=[\'"$(touch pwned)\']')
    target = tmp_path / "job.sbatch"
    target.write_text(script)
    result = subprocess.run(["bash", "-n", str(target)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    engine = steps(script)[0].split("ENGINE_PID=$!")[0]
    assert shlex.split(engine.replace("\\\n", " "))[-2] == '"$(touch pwned)'


def test_setup_lines_run_without_set_u(tmp_path: Path) -> None:
    """Activation scripts (conda's, some module systems') read unset variables: under the script's set -u they would
    end the job before it starts."""
    (tmp_path / "activate.sh").write_text('export ACTIVATED="${UNSET_BY_EVERYONE_R4}x"\n')
    script = render("launch.setup=['source activate.sh', 'exit 7']")
    (tmp_path / "job.sbatch").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env={**env, "SLURM_JOB_ID": "1"},
                            capture_output=True, text=True)
    assert result.returncode == 7, result.stderr
    assert script.index("set +u") < script.index("source activate.sh") < script.index("set -u\n")


@pytest.mark.parametrize("line,status", [
    ("module-not-on-this-cluster load cuda/12.4  # a trailing comment must not hide the check", 127),
    ("source /nowhere/venv/bin/activate", 1),
    ("if then", 2),  # a syntax error fails alone: the rest of the script stays valid bash
])
def test_a_failing_setup_line_stops_the_job_naming_it(tmp_path: Path, line: str, status: int) -> None:
    """A module that does not load or an environment that does not activate would leave the job running in the wrong
    environment (or failing after the engine servers started): the job stops at that line, naming it."""
    script = _stand_in_job(tmp_path, [f"launch.setup=['export EARLIER=1', {line!r}, 'touch later-line-ran']"])
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=_stand_in_env(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert (f"spade-mega: launch.setup[1] failed with exit status {status}, stopping the job before anything "
            f"starts: {line}") in result.stderr
    assert not (tmp_path / "later-line-ran").exists() and not (tmp_path / "srun.log").exists()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_a_config_the_script_cannot_write_stops_the_job_before_any_step(tmp_path: Path) -> None:
    """Without the resolved config on disk the trainer would start on a missing (or, on a full disk, cut short and
    still loadable) file: the script stops, naming the file."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\necho srun ran >> srun.log\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    (tmp_path / "logs").write_text("a file where the log folder should be\n")
    (tmp_path / "job.sbatch").write_text(render())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**env, "SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "j",
                                 "PATH": f"{tmp_path / 'bin'}:{env['PATH']}"})
    assert result.returncode != 0 and "cannot write the resolved config logs/j-5.yaml" in result.stderr
    assert not (tmp_path / "srun.log").exists()


def test_engine_logs_are_appended_across_requeues_like_the_jobs_own() -> None:
    """srun truncates its --output by default (JobFileAppend=0): a requeued job would wipe the engine logs of the
    attempt before, while the job's own log is appended (--open-mode=append)."""
    engine = steps(render())[0].split(" \\\n")[0].split()
    assert '--output="$LOG_DIR/%x-%j-engines-%N.out"' in engine and "--open-mode=append" in engine
    assert "--open-mode=append" in directives(render())


def test_in_process_engine_starts_no_servers() -> None:
    script = render("launch.gpus_per_node=1", path=TINY)
    assert "launch.node serve" not in script and "--engines" not in script and len(steps(script)) == 1
    assert "runs the hf engine in-process" in script


def test_embedded_config_is_the_resolved_config(tmp_path: Path) -> None:
    cfg = recipe("selfplay.num_rollouts=7", "launch.nodes=2", "inference.weight_sync_dir=/shared/sync")
    script = render_sbatch(cfg, RECIPE)
    embedded = script.split(f"<<'{CONFIG_DELIMITER}'")[1].split("\n", 1)[1].split(f"\n{CONFIG_DELIMITER}\n")[0]
    (tmp_path / "c.yaml").write_text(embedded)
    assert to_dict(load_config(tmp_path / "c.yaml")) == to_dict(cfg)


def test_example_sbatch_is_up_to_date() -> None:
    """examples/slurm/ is rendered from examples/configs/: re-render after changing either side."""
    committed = (ROOT / "examples" / "slurm" / "qwen3_30b_a3b_games.sbatch").read_text()
    assert committed == render(), ("examples/slurm/qwen3_30b_a3b_games.sbatch is stale: run `spade-mega launch slurm "
                                   f"{RECIPE} -o examples/slurm/qwen3_30b_a3b_games.sbatch`")


# ---- the CLI ----------------------------------------------------------------------------------------------------


def test_cli_writes_the_script_and_submit_without_sbatch_says_so(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "job.sbatch"
    assert cli_main(["launch", "slurm", str(ROOT / RECIPE), "launch.time='2-0'", "-o", str(out)]) == 0
    assert out.read_text() == render_sbatch(recipe("launch.time='2-0'"), str(ROOT / RECIPE))
    assert os.access(out, os.X_OK)
    capsys.readouterr()
    assert cli_main(["launch", "slurm", str(ROOT / RECIPE), "-o", str(out), "--submit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"spade-mega: error: sbatch not found on PATH: submit {out} from a SLURM login node"


def test_cli_will_not_write_the_script_over_a_file_it_did_not_render(tmp_path: Path, capsys) -> None:
    """-o naming the config itself (or any other file) would replace it with the script: refused, the file kept."""
    config = tmp_path / "games.yaml"
    config.write_text((ROOT / RECIPE).read_text())
    original = config.read_text()
    assert cli_main(["launch", "slurm", str(config), "-o", str(config)]) == 2
    assert config.read_text() == original
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{config} exists and is not a script rendered by spade-mega" in err


def test_cli_refuses_a_world_the_layout_does_not_fit(capsys) -> None:
    assert cli_main(["launch", "slurm", str(ROOT / RECIPE), "launch.gpus_per_node=6", "-o", "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("spade-mega: error: parallel.tensor:") and "1 x 6" in err


def test_submit_creates_the_log_dir_and_prints_the_job_id(tmp_path: Path, capsys, monkeypatch) -> None:
    """sbatch itself cannot run here: a stand-in on PATH records its arguments and answers as --parsable does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho '987654;cluster'\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["launch", "slurm", str(ROOT / RECIPE), "--submit"]) == 0
    assert capsys.readouterr().out.strip() == "987654"
    assert (tmp_path / "args").read_text().split() == ["--parsable", "qwen3_30b_a3b_games.sbatch"]
    assert (tmp_path / "logs").is_dir()


# ---- wiring inside the job --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,hosts", [
    ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
    ("node7", ["node7"]),
    ("a[1-3],login,b[08-10]", ["a1", "a2", "a3", "login", "b08", "b09", "b10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
])
def test_hostlist_expansion(text: str, hosts: list[str]) -> None:
    assert node.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[1-", "a]", "a,,b", "a[3-1]", "a[x]", "a[]"])
def test_bad_hostlists_are_named(text: str) -> None:
    with pytest.raises(node.SlurmEnvError, match="host list" if text else "empty"):
        node.expand_hostlist(text)


def test_wiring_from_a_real_slurm_environment() -> None:
    wiring = node.node_wiring(SLURM_ENV)
    assert (wiring.master_addr, wiring.node_rank, wiring.master_port) == ("gpu001", 2, 20000 + 4187321 % 10000)
    assert node.torch_env(SLURM_ENV, wiring, "torchrun") == {"MASTER_ADDR": "gpu001", "MASTER_PORT": "27321"}
    assert node.torch_env(SLURM_ENV, wiring, "srun") == {
        "MASTER_ADDR": "gpu001", "MASTER_PORT": "27321", "RANK": "19", "WORLD_SIZE": "40", "LOCAL_RANK": "3",
        "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "8"}
    command, env = node.node_command(wiring, "torchrun", 8, 4, ["-m", "spade_mega.cli", "train", "c.yaml"],
                                     shutdown_timeout_s=540)
    assert command[1:] == ["-m", "torch.distributed.run", "--nnodes=4", "--nproc-per-node=8", "--node-rank=2",
                           "--master-addr=gpu001", "--master-port=27321", "-m", "spade_mega.cli", "train", "c.yaml"]
    assert env == {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "PET_SHUTDOWN_TIMEOUT": "540"}
    assert node.node_command(wiring, "srun", 8, 4, ["x.py", "c.yaml"]) == ([sys.executable, "x.py", "c.yaml"], {})
    assert wiring.engine_urls(4, 1, 2, 30000) == ["http://gpu010:30000", "http://gpu010:30001"]
    assert wiring.engine_urls(1, 2, 1, 30000) == ["http://gpu002:30000", "http://127.0.0.1:30000"]  # node 2: here


def test_wiring_errors_name_the_variable() -> None:
    with pytest.raises(node.SlurmEnvError, match="SLURM_JOB_NODELIST is not set"):
        node.node_wiring({"SLURM_NODEID": "0"})
    with pytest.raises(node.SlurmEnvError, match="SLURM_NODEID=5 but the job has 5 nodes"):
        node.node_wiring({**SLURM_ENV, "SLURM_NODEID": "5"})
    with pytest.raises(node.SlurmEnvError, match="SLURM_JOB_ID is not set"):
        node.node_wiring({k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_ID"})
    wiring = node.node_wiring(SLURM_ENV, master_port=29500)
    with pytest.raises(node.SlurmEnvError, match="not one of the trainer's 2 nodes"):
        node.node_command(wiring, "torchrun", 8, 2, ["x.py"])
    with pytest.raises(node.SlurmEnvError, match="engine nodes 4..5 lie outside"):
        wiring.engine_urls(4, 2, 1, 30000)


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a one-node job on this machine, as srun gives it (SLURM's own variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update({"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODEID": "0",
                "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPADE_TEST_OUT": str(tmp_path), **extra})
    return env


def read_ranks(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.multiproc
def test_srun_direct_tasks_form_one_world(tmp_path: Path) -> None:
    """Two srun tasks of one node (srun's variables, no RANK): the wrapper wires them and init_distributed joins
    them into one gloo world (without it, it refuses: each task would train alone)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "spade_mega.launch.node", "exec", "--launcher", "srun",
                               "--nproc-per-node", "2", "--nnodes", "1", "--master-port", str(port), "--",
                               str(DATA / "allreduce.py"), "cfg.yaml", "a.b=1"],
                              env=job_env(tmp_path, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                                          SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS_PER_NODE="2"))
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = read_ranks(tmp_path, 2)
    assert [(r["rank"], r["world"], r["local_rank"], r["sum"]) for r in ranks] == [(0, 2, 0, 3.0), (1, 2, 1, 3.0)]
    assert {(r["master_addr"], r["master_port"]) for r in ranks} == {("localhost", port)}
    assert ranks[0]["args"] == ["cfg.yaml", "a.b=1"]


@pytest.mark.multiproc
def test_torchrun_nodes_form_one_world_and_pass_the_time_limit_signal_on(tmp_path: Path) -> None:
    """Two nodes of a job (two hosts of SLURM_JOB_NODELIST, both this machine), one torchrun each as the job script
    starts them: they wait for the engine server on node 0, rendezvous on the first host into one world with the
    server's URL (loopback on its own node), and hand SIGUSR1 (the script's time-limit warning) on to their ranks."""
    engine_port, master_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, str(DATA / "health_server.py"), "--port", str(engine_port)])
    torchruns = []
    try:
        for node_id in range(2):
            torchruns.append(subprocess.Popen(
                [sys.executable, "-m", "spade_mega.launch.node", "exec", "--launcher", "torchrun", "--nproc-per-node",
                 "1", "--nnodes", "2", "--master-port", str(master_port), "--shutdown-timeout", "60",
                 "--engines", f"0:1:1:{engine_port}", "--engine-timeout", "60", "--", str(DATA / "allreduce.py")],
                env=job_env(tmp_path, SLURM_JOB_NODELIST="localhost,127.0.0.1", SLURM_NODEID=str(node_id),
                            SPADE_TEST_WAIT_USR1="1")))
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert all(t.poll() is None for t in torchruns) and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        for torchrun in torchruns:
            torchrun.send_signal(signal.SIGUSR1)
        for torchrun in torchruns:
            torchrun.wait(timeout=90)
    finally:
        for proc in (server, *torchruns):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    ranks = read_ranks(tmp_path, 2)
    assert [(r["rank"], r["world"], r["local_rank"], r["sum"], r["usr1"]) for r in ranks] == \
        [(0, 2, 0, 3.0, True), (1, 2, 0, 3.0, True)]
    assert {(r["master_addr"], r["master_port"]) for r in ranks} == {("localhost", master_port)}
    assert [r["engine_urls"] for r in ranks] == [f"http://127.0.0.1:{engine_port}", f"http://localhost:{engine_port}"]


@pytest.mark.multiproc
def test_launch_local_runs_the_layouts_ranks(tmp_path: Path) -> None:
    """`spade-mega launch local` with parallel.tensor=2: two ranks by default, under a real torchrun."""
    overrides = ["parallel.tensor=2", "model.num_experts=0"]
    cfg = load_config(ROOT / TINY, overrides)
    assert "--nproc-per-node=2" in local_command(cfg, TINY, overrides, script=str(DATA / "allreduce.py"))
    result = subprocess.run([sys.executable, "-m", "spade_mega.cli", "launch", "local", str(ROOT / TINY), *overrides,
                             "--script", str(DATA / "allreduce.py")], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=job_env(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = read_ranks(tmp_path, 2)
    assert [(r["rank"], r["world"], r["sum"]) for r in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert ranks[1]["args"] == [str(ROOT / TINY), *overrides]


def test_launch_local_refuses_a_process_count_the_layout_does_not_fit() -> None:
    cfg = load_config(ROOT / TINY, ["parallel.tensor=2", "model.num_experts=0"])
    with pytest.raises(ConfigError, match="launch local runs 3 processes; the layout needs a multiple of 2"):
        local_command(cfg, TINY, [], nproc=3)
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        local_command(cfg, TINY, [], nproc=0)


# srun and scontrol cannot run here: these stand-ins do what they do for a one-node job. srun drops its step options,
# sets the task's variables and becomes the command (so a signal to it reaches the task, as srun forwards it).
STAND_IN_SRUN = """#!/bin/bash
if [[ -n "${SRUN_LOG:-}" ]]; then echo "$*" >> "$SRUN_LOG"; fi
out=""
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in --output=*) out="${1#--output=}" ;; esac
  shift
done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_STEP_NUM_TASKS=1
if [[ -n "$out" ]]; then
  out="${out//%x/$SLURM_JOB_NAME}"; out="${out//%j/$SLURM_JOB_ID}"; exec "$@" >>"${out//%N/localhost}" 2>&1
fi
exec "$@"
"""
STAND_IN_SCONTROL = '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n'


def _ranks_of(config: str) -> list[int]:
    """Processes running ``spade_mega.cli train CONFIG`` themselves (the command lines of the node wrapper and of
    torchrun hold it too)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace") if entry.name.isdigit() else ""
        except OSError:
            continue
        if f"spade_mega.cli\0train\0{config}" in cmdline and "torch.distributed.run" not in cmdline \
                and "spade_mega.launch.node" not in cmdline:
            found.append(int(entry.name))
    return found


def _stand_in_job(tmp_path: Path, overrides: list[str]) -> Path:
    """The tiny config's job script, and srun / scontrol stand-ins in tmp_path/bin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STAND_IN_SRUN), ("scontrol", STAND_IN_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(load_config(ROOT / TINY, [
        "launch.gpus_per_node=1", f"launch.python={sys.executable}", f"run.output_dir={tmp_path / 'runs'}",
        *overrides]), TINY))
    return script


def _stand_in_env(tmp_path: Path) -> dict[str, str]:
    return job_env(tmp_path, SLURM_JOB_NAME="tiny", SCONTROL_LOG=str(tmp_path / "scontrol.log"),
                   SRUN_LOG=str(tmp_path / "srun.log"), PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")


# colocated servers that would start (and fail: /bin/false is their interpreter) unless the job stops first
STAND_IN_SERVERS = ["rollout.engine=vllm", "launch.engine_placement=colocated", "inference.hf_weights=/nowhere",
                    "inference.server_python=/bin/false"]


def _saved_run(run_dir: Path, rollout: int, damaged: bool = False) -> None:
    """A run's newest checkpoint as the loop leaves it: the trainer's step folder (its manifest marks it complete)
    and, beside it, the loop state counting ``rollout`` rollouts."""
    from spade_mega.megatron.checkpoint import MANIFEST, step_dir
    from spade_mega.selfplay.state import CheckpointStore, LoopState

    store = CheckpointStore(run_dir)
    path = store.write_state(rollout, LoopState(rollout=rollout))
    if damaged:
        path.write_text('{"format": "spade-mega.selfplay-state", "version": 1, "rollout": "eight"}')
    step = step_dir(store.root, rollout)
    step.mkdir(parents=True)
    (step / MANIFEST).write_text(json.dumps({"format": 1, "step": rollout}))


@pytest.mark.parametrize("damaged", [False, True])
def test_requeued_job_of_a_complete_run_starts_nothing(tmp_path: Path, damaged: bool) -> None:
    """A job requeued (or resubmitted) after its run saved its last rollout would start its engine servers, minutes
    on a cluster, for a trainer with nothing to do: the script sees the run complete in the loop state beside the
    checkpoints and exits 0 saying so. A loop state it cannot read stops the job, before anything starts, too."""
    script = _stand_in_job(tmp_path, STAND_IN_SERVERS)
    _saved_run(tmp_path / "runs" / "tiny_cpu", rollout=8, damaged=damaged)  # tiny_cpu: selfplay.num_rollouts 8
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=_stand_in_env(tmp_path), capture_output=True,
                            text=True, timeout=120)
    if damaged:
        assert result.returncode == 2, result.stderr[-3000:]
        assert "loop state is damaged" in result.stderr and "cannot tell whether the run is complete" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("run 'tiny_cpu' is already complete (8 of 8 rollouts, checkpoint "
                f"{tmp_path / 'runs' / 'tiny_cpu' / 'checkpoints' / 'step_00000008'}): nothing to start") \
            in result.stderr
    srun_steps = (tmp_path / "srun.log").read_text().splitlines()
    assert len(srun_steps) == 1 and "spade_mega.launch.node finished logs/tiny-123.yaml" in srun_steps[0]
    assert not (tmp_path / "logs" / "tiny-123-engines-localhost.out").exists()
    assert not (tmp_path / "scontrol.log").exists()


def test_a_run_with_rollouts_left_is_not_finished(tmp_path: Path) -> None:
    """Anything short of every rollout saved (no checkpoint yet, or rollout 4 of 8) lets the job start."""
    config = tmp_path / "c.yaml"
    config.write_text((ROOT / TINY).read_text().replace("output_dir: runs", f"output_dir: {tmp_path / 'runs'}"))

    def finished() -> int:
        return subprocess.run([sys.executable, "-m", "spade_mega.launch.node", "finished", str(config)],
                              capture_output=True, text=True, timeout=60, env=job_env(tmp_path)).returncode

    assert finished() == node.UNFINISHED
    _saved_run(tmp_path / "runs" / "tiny_cpu", rollout=4)
    assert node.finished_run(str(config)) is None
    _saved_run(tmp_path / "runs" / "tiny_cpu", rollout=8)
    assert "8 of 8 rollouts" in node.finished_run(str(config)) and finished() == 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_job_script_passes_the_time_limit_warning_to_the_trainer_and_requeues(tmp_path: Path) -> None:
    """The rendered script itself, with the real trainer command: SIGUSR1 to the batch shell (what --signal=B:USR1
    sends) reaches the trainer's rank through srun and torchrun, the rank stops, and the job is requeued."""
    script = _stand_in_job(tmp_path, [])
    env = _stand_in_env(tmp_path)
    log = tmp_path / "job.out"
    with log.open("w") as out:
        job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _ranks_of("logs/tiny-123.yaml"):
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer's rank did not start"
            time.sleep(0.2)
        time.sleep(1.0)  # let bash settle in its wait
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 123\n"
    text = log.read_text()
    assert "time limit in 600 s: asking the trainer to checkpoint" in text and "requeueing job 123" in text
    assert re.search(r"Sending process \d+ closing signal SIGUSR1", text)  # torchrun passed it on to the rank
    assert (tmp_path / "logs" / "tiny-123.yaml").is_file()
    assert not _ranks_of("logs/tiny-123.yaml")  # nothing of the job is left running


@pytest.mark.multiproc
def test_job_script_stops_a_trainer_that_outlives_the_warning_and_still_requeues(tmp_path: Path) -> None:
    """A trainer still running STOP_GRACE_S after the time-limit warning (a rollout longer than the warning leaves,
    or launcher srun, where no torchrun bounds the ranks' grace) is stopped by the script, which then requeues: left
    to the limit, SLURM would kill the whole job (state TIMEOUT, never requeued). The grace is shortened here."""
    script = _stand_in_job(tmp_path, ["launch.launcher=srun", "launch.signal_before_s=300"])
    text = script.read_text()
    assert "STOP_GRACE_S=270\n" in text  # signal_before_s - 30: after torchrun's own grace (- 60), before the limit
    script.write_text(text.replace("STOP_GRACE_S=270\n", "STOP_GRACE_S=2\n"))
    marker = f"deaf trainer of {tmp_path}"  # the training step: a rank deep in a rollout, deaf to the warning
    _training_step_is(tmp_path, f"import time; time.sleep(600)  # {marker}", deaf_to_usr1=True)
    log = tmp_path / "job.out"
    with log.open("w") as out:
        job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=_stand_in_env(tmp_path), stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _running(marker):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)
        job.send_signal(signal.SIGUSR1)
        status = job.wait(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert "still running 2 s after the time-limit warning; stopping it" in text, text[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 123\n" and status != 0
    assert not _running(marker)


def _training_step_is(tmp_path: Path, code: str, deaf_to_usr1: bool = False) -> None:
    """The stand-in srun runs ``python -c code`` as the training step (the other steps as they are)."""
    (tmp_path / "bin" / "srun").write_text(STAND_IN_SRUN.replace(
        'if [[ -n "$out" ]]; then',
        f'if [[ "$*" == *"spade_mega.launch.node exec"* ]]; then\n' + ('  trap "" USR1\n' if deaf_to_usr1 else "")
        + f'  set -- {sys.executable} -c {shlex.quote(code)}\nfi\n' + 'if [[ -n "$out" ]]; then', 1))


def test_a_requeue_that_fails_is_said_and_fails_the_job(tmp_path: Path) -> None:
    """scontrol requeue can fail (requeue disabled on the partition, job arrays, a controller outage): the job then
    ended COMPLETED, exit 0, its run stopped half way, with the log still saying it resumes."""
    script = _stand_in_job(tmp_path, [])
    (tmp_path / "bin" / "scontrol").write_text(
        '#!/bin/bash\necho "scontrol: error: Requested operation is presently disabled" >&2\nexit 1\n')
    _training_step_is(tmp_path, f"import pathlib, signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: "
                                f"sys.exit(0)); pathlib.Path({str(tmp_path / 'ready')!r}).touch(); time.sleep(60)")
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=_stand_in_env(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()
            time.sleep(0.1)
        time.sleep(0.5)
        job.send_signal(signal.SIGUSR1)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, output[-3000:]
    assert "scontrol requeue failed (see above): the run stopped at its newest checkpoint; submit this script " \
           "again to resume it" in output


def test_steps_get_the_jobs_environment_under_sbatch_export_none(tmp_path: Path) -> None:
    """sbatch --export=NONE sets SLURM_EXPORT_ENV=NONE in the job and srun honours it: without the script's own
    SLURM_EXPORT_ENV=ALL, every step started without launch.env and what launch.setup set up (the venv)."""
    script = _stand_in_job(tmp_path, ["launch.env={SPADE_MARK: from-the-job}", "launch.sbatch_extra=[--export=NONE]"])
    seen = tmp_path / "seen"
    _training_step_is(tmp_path, f"import os, pathlib; pathlib.Path({str(seen)!r}).write_text("
                                "os.environ.get('SPADE_MARK', 'missing'))")
    srun = (tmp_path / "bin" / "srun").read_text()
    (tmp_path / "bin" / "srun").write_text(srun.replace(  # srun's --export as SLURM_EXPORT_ENV sets it
        'if [[ -n "$out" ]]; then',
        'if [[ "${SLURM_EXPORT_ENV:-ALL}" == NONE ]]; then\n'
        '  mapfile -t keep < <(env | grep "^SLURM_"); set -- env -i "${keep[@]}" "$@"\nfi\n'
        'if [[ -n "$out" ]]; then', 1))
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**_stand_in_env(tmp_path), "SLURM_EXPORT_ENV": "NONE"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert seen.read_text() == "from-the-job"


def _running(marker: str) -> bool:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.multiproc
def test_job_script_stops_the_trainer_when_the_engine_servers_fail(tmp_path: Path) -> None:
    """A server that cannot start (here its interpreter is /bin/false) ends the engine step; the script stops the
    trainer, still waiting for /health, instead of leaving it to wait out engine_start_timeout_s."""
    script = _stand_in_job(tmp_path, ["rollout.engine=vllm", "launch.engine_placement=colocated",
                                      "inference.hf_weights=/nowhere", "inference.server_python=/bin/false"])
    log = tmp_path / "job.out"
    with log.open("w") as out:
        status = subprocess.run(["bash", str(script)], cwd=tmp_path, env=_stand_in_env(tmp_path), stdout=out,
                                stderr=subprocess.STDOUT, timeout=120).returncode
    text = log.read_text()
    assert status != 0 and "the engine servers exited; stopping the trainer" in text, text[-3000:]
    engine_log = (tmp_path / "logs" / "tiny-123-engines-localhost.out").read_text()
    assert "exited with status 1; stopping this node's servers" in engine_log
    assert not (tmp_path / "scontrol.log").exists()  # a failure is not requeued


@pytest.mark.multiproc
def test_time_limit_signal_to_the_whole_step_leaves_sandbox_workers_running() -> None:
    """slurmstepd hands a signal for a step (srun forwarding the script's SIGUSR1) to every process of the step: rank
    0's sandbox workers (bubblewrap's launcher, its init, the worker) get it too. They must outlive it, or the episodes
    in flight end as sandbox errors, blamed on their environment programs, in the rollout saved before the requeue."""
    from sandbox_support import GUESS_NUMBER, pid_gone, program, strict_pool, wait_warm

    with strict_pool(warm_workers=1) as pool:
        with pool.open(program(GUESS_NUMBER)) as env:
            env.reset(0)
            wait_warm(pool)
            pids = sorted(pool.processes())
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
            assert [pid for pid in pids if pid_gone(pid)] == []
            assert "higher" in env.step("1").observation  # the episode goes on in the same worker


# ---- engine servers on a node -----------------------------------------------------------------------------------


def test_serve_splits_the_gpus_and_stops_every_server_on_sigterm(tmp_path: Path) -> None:
    base = free_port()
    command = [sys.executable, "-m", "spade_mega.launch.node", "serve", "--servers", "2", "--gpus-per-server", "2",
               "--", sys.executable, str(DATA / "health_server.py"), "--port", str(base)]
    serve = subprocess.Popen(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6,7",
                                           "PYTHONPATH": str(ROOT)})
    urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    try:
        node.wait_healthy(urls, timeout_s=60, poll_s=0.2)
        import urllib.request

        gpus = [json.loads(urllib.request.urlopen(f"{u}/health").read())["gpus"] for u in urls]
        assert gpus == ["4,5", "6,7"]
    finally:
        serve.send_signal(signal.SIGTERM)
        status = serve.wait(timeout=60)
    assert status == 128 + signal.SIGTERM
    with pytest.raises(node.SlurmEnvError, match=r"not healthy after 0.5 s: http://127.0.0.1:\d+ \("):
        node.wait_healthy(urls[:1], timeout_s=0.5, poll_s=0.1)


def test_health_wait_names_a_port_that_answers_something_else_than_http() -> None:
    """A port taken by another program (a collision) answers garbage: the wait names the server instead of crashing
    with a traceback out of http.client."""
    import threading

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_garbage() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=answer_garbage, daemon=True).start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(node.SlurmEnvError, match=rf"not healthy after 0.5 s: {url} \("):
            node.wait_healthy([url], timeout_s=0.5, poll_s=0.1)


def test_serve_stops_the_node_when_one_server_crashes() -> None:
    base = free_port()
    commands = [([sys.executable, str(DATA / "health_server.py"), "--port", str(base), "0.5", "3"], dict(os.environ)),
                ([sys.executable, str(DATA / "health_server.py"), "--port", str(base + 1)], dict(os.environ))]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    assert node.serve(commands, poll_s=0.1) == 3
    assert time.monotonic() - started < 30
    # the caller's handlers are back: they swallowed the Ctrl-C of a process that runs serve and then goes on
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    with pytest.raises(node.SlurmEnvError):  # the healthy one was stopped with it
        node.wait_healthy([f"http://127.0.0.1:{base + 1}"], timeout_s=0.3, poll_s=0.1)


def test_server_commands_count_ports_up_and_split_gpus() -> None:
    commands = node.server_commands(["srv", "--port", "30000", "--x"], 4, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    assert [(argv[2], env["CUDA_VISIBLE_DEVICES"]) for argv, env in commands] == \
        [("30000", "0,1"), ("30001", "2,3"), ("30002", "4,5"), ("30003", "6,7")]
    with pytest.raises(node.SlurmEnvError, match="must give its port as '--port N'"):
        node.server_commands(["server", "--host", "0.0.0.0"], 1, 8, {})
    with pytest.raises(node.SlurmEnvError, match="need 16 GPUs, this node shows 8"):
        node.server_commands(["s", "--port", "1"], 2, 8, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})


SIGNALLED_RANK = """
import os, signal, sys, time
from pathlib import Path
out, rank = Path(os.environ["SPADE_TEST_OUT"]), os.environ["RANK"]
def stop(signum, frame):
    time.sleep(1.0)  # a rank saving before it exits
    (out / f"stopped{rank}").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out / f"ready{rank}").touch()
time.sleep(120)
"""


@pytest.mark.multiproc
def test_launch_local_hands_sigterm_to_the_ranks_and_waits_for_them(tmp_path: Path) -> None:
    """`kill` of `spade-mega launch local` (a scheduler, a terminal closing) must reach the ranks through torchrun
    and wait for them to stop: the launcher died alone, torchrun and its ranks trained on."""
    rank_script = tmp_path / "signalled_rank.py"
    rank_script.write_text(SIGNALLED_RANK)
    launcher = subprocess.Popen([sys.executable, "-m", "spade_mega.cli", "launch", "local", str(ROOT / TINY),
                                 "parallel.tensor=2", "model.num_experts=0", "--script", str(rank_script)],
                                cwd=tmp_path, env=job_env(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        assert [(tmp_path / f"stopped{r}").read_text() for r in range(2)] == ["SIGTERM", "SIGTERM"]
        assert not _running(str(rank_script))  # nothing of the run outlives the launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for entry in Path("/proc").iterdir():  # a rank left behind by a failure above
            try:
                if entry.name.isdigit() and str(rank_script) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue
