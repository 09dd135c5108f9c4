"""The typed configuration schema: one dataclass per section, composed into :class:`SpadeConfig`.

Each section owns its defaults and a ``check()`` for constraints between its own fields; constraints that span
sections live in :meth:`SpadeConfig.check`. Types are enforced by the loader (``loader.py``) from these annotations,
so a field's annotation is its contract: ``int``, ``float``, ``bool``, ``str``, ``Optional[...]``, ``list[...]``,
``dict[str, ...]``, ``Literal[...]`` or a nested section. Later subsystems add their sections here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from spade_mega.config.errors import ConfigError


def _require(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(path, message)


def _positive(section: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is None or value > 0, f"{section}.{name}", f"must be > 0, got {value!r}")


@dataclass
class ModelConfig:
    """Architecture of the policy (Qwen3 / Qwen3-MoE family). ``num_experts: 0`` means a dense model."""

    name: str = "tiny-qwen3-moe"
    hf_config: Optional[str] = None  # path to a Hugging Face config.json; its values win over the fields below
    tokenizer: Optional[str] = None  # tokenizer name or folder; None = the run's built-in byte tokenizer
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    ffn_hidden_size: int = 128
    num_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 32
    moe_aux_loss_coeff: float = 1e-3
    vocab_size: int = 512
    max_position_embeddings: int = 40960  # Qwen3's; holds rollout.max_context_tokens (checked)
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    tie_embeddings: bool = False
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    # Megatron's layer modules: Transformer Engine (fused kernels, grouped-GEMM experts, packed sequences) or its
    # plain-torch "local" ones. auto: Transformer Engine on a GPU (required there unless local is asked for), local
    # on CPU. local on a GPU trains without Transformer Engine, slower (unfused attention with a mask per row).
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"

    def check(self) -> None:
        _positive("model", self, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "ffn_hidden_size", "vocab_size", "max_position_embeddings")
        _require(self.num_experts >= 0, "model.num_experts", f"must be >= 0, got {self.num_experts}")
        _require(self.num_attention_heads % self.num_query_groups == 0, "model.num_query_groups",
                 f"must divide model.num_attention_heads ({self.num_attention_heads}), got {self.num_query_groups}")
        if self.num_experts:
            _positive("model", self, "moe_router_topk", "moe_ffn_hidden_size")
            _require(self.moe_router_topk <= self.num_experts, "model.moe_router_topk",
                     f"must be <= model.num_experts ({self.num_experts}), got {self.moe_router_topk}")


@dataclass
class ParallelConfig:
    """Megatron-Core parallel layout. Data parallel size is whatever the world size leaves over."""

    tensor: int = 1
    sequence_parallel: bool = False
    expert: int = 1
    expert_tensor: Optional[int] = None  # None = same as tensor
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    context: int = 1
    recompute: Literal["none", "selective", "full"] = "none"
    max_tokens_per_gpu: int = 32768  # one micro-batch row; holds a whole sample (up to rollout.max_context_tokens)
    # how long a rank waits in a collective: the others wait in one while rank 0 rolls out or evaluates
    collective_timeout_min: float = 120.0
    # The trainer's parameters and optimizer state moved to host memory and its gradients freed while the rollout
    # engine generates, so a colocated engine gets that memory for its KV cache (slime's offload; docs/megatron.md,
    # "Memory"). auto: on where the engine releases its memory for training on the same GPUs (inference.
    # release_memory resolved) and a CUDA device is present; true forces it (also on CPU, as the tests run it).
    offload_trainer: Literal["auto", True, False] = "auto"

    def check(self) -> None:
        _positive("parallel", self, "tensor", "expert", "expert_tensor", "pipeline", "virtual_pipeline",
                  "context", "max_tokens_per_gpu", "collective_timeout_min")
        _require(not self.sequence_parallel or self.tensor > 1, "parallel.sequence_parallel",
                 "needs parallel.tensor > 1 (sequence parallel splits activations across tensor-parallel ranks)")
        _require(self.virtual_pipeline is None or self.pipeline > 1, "parallel.virtual_pipeline",
                 "needs parallel.pipeline > 1")


@dataclass
class OptimizerConfig:
    """Adam with Megatron's distributed optimizer; reference SPADE recipe: constant lr 1e-6, no weight decay."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = True  # Megatron DistributedOptimizer (shards optimizer state over data-parallel ranks)

    def check(self) -> None:
        _positive("optimizer", self, "lr", "adam_eps")
        _require(0.0 <= self.min_lr <= self.lr, "optimizer.min_lr", f"must be in [0, optimizer.lr], got {self.min_lr}")
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"optimizer.{name}", f"must be in [0, 1), got {value}")
        _require(self.clip_grad >= 0, "optimizer.clip_grad", f"must be >= 0 (0 disables clipping), got {self.clip_grad}")


@dataclass
class RolloutConfig:
    """Sampling for both roles. Reference 30B recipe: temperature 0.6 (hint plays 0.3), <= 25 turns."""

    engine: Literal["hf", "vllm", "sglang"] = "hf"
    temperature: float = 0.6
    hint_temperature: float = 0.3
    top_p: float = 1.0
    max_response_tokens: int = 8192
    max_designer_tokens: int = 16384
    max_context_tokens: int = 32768
    max_turns: int = 25  # steps of an episode the agent plays; a program may declare more, its episodes end here
    envs_per_rollout: int = 24
    agent_trajectories_per_env: int = 16
    hint_plays_per_env: int = 16
    max_open_envs: int = 128  # environments open at once while playing (each holds one sandbox worker)

    def check(self) -> None:
        _positive("rollout", self, "max_response_tokens", "max_designer_tokens", "max_context_tokens",
                  "max_turns", "envs_per_rollout", "agent_trajectories_per_env", "max_open_envs")
        for name in ("temperature", "hint_temperature"):
            value = getattr(self, name)
            _require(value >= 0.0, f"rollout.{name}", f"must be >= 0, got {value}")
        _require(0.0 < self.top_p <= 1.0, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.hint_plays_per_env >= 0, "rollout.hint_plays_per_env",
                 f"must be >= 0, got {self.hint_plays_per_env}")
        for name in ("max_response_tokens", "max_designer_tokens"):
            value = getattr(self, name)
            _require(value <= self.max_context_tokens, f"rollout.{name}",
                     f"must be <= rollout.max_context_tokens ({self.max_context_tokens}), got {value}")


@dataclass
class InferenceConfig:
    """Settings of the inference engines (spade_mega/inference). The in-process ``hf`` engine reads ``device``,
    ``dtype``, ``max_batch_size``, ``prefix_cache_mb`` and ``hf_weights``; the ``vllm`` and ``sglang`` servers read
    ``dtype``, ``hf_weights`` (the folder they serve) and the ``server_*`` / timeout fields below."""

    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when there is a GPU
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: model.params_dtype
    max_batch_size: int = 64  # sequences decoded together; bigger rollouts run in chunks
    # hf engine: keys and values of finished sequences kept so an agent's next turn prefills only its new tokens
    # (MiB; least recently used out; cleared at every weight update). 0: off
    prefix_cache_mb: float = 1024.0
    hf_weights: Optional[str] = None  # local Hugging Face folder (*.safetensors) loaded at start; None = random init
    # servers started elsewhere (SLURM: $SPADE_ENGINE_URLS) to attach to; empty: start one here
    server_urls: list[str] = field(default_factory=list)
    server_python: Optional[str] = None  # Python that has vllm / sglang (e.g. .venv-vllm/bin/python); None: this one
    server_args: list[str] = field(default_factory=list)  # appended to the server command a run starts
    tensor_parallel: int = 1  # GPUs of a server this run starts
    startup_timeout_s: float = 600.0  # a server must answer its health check within this
    request_timeout_s: float = 600.0  # one completion, or one weight reload
    # vllm: a server whose completions in flight have all gone this long without a token is hung (a wedged engine,
    # a GPU hang): one this run started is restarted and the requests redone, an attached one is an error; 0: off
    stall_timeout_s: float = 120.0
    concurrency: int = 64  # requests in flight per server (the server batches them)
    weight_sync_dir: Optional[str] = None  # where updates are staged for the servers to load; None: /dev/shm
    # how weight updates reach the servers: folder (staged safetensors the servers reload: the model's size in RAM,
    # written and read once per update) or collective (vllm only: each bucket broadcast over a process group
    # straight into the servers' workers, gloo without CUDA, NCCL on GPU; see docs/inference_servers.md)
    weight_transfer: Literal["folder", "collective"] = "folder"
    # Servers sharing the trainer's GPUs free their weights' and KV cache's memory while the trainer steps and take it
    # back around the weight sync. auto: on for sglang/vllm placed colocated (launch.engine_placement auto too) on a
    # machine with a GPU; they need --enable-memory-saver / --enable-sleep-mode (the launcher and a run that starts
    # its own server add it). Not for the hf engine, which runs inside the trainer's process.
    release_memory: Literal["auto", True, False] = "auto"
    # Fault tolerance of the server engines (docs/inference_servers.md): a request that fails for a passing reason
    # (refused, reset, HTTP 429/502/503/504, a server found dead) is redone up to request_retries times, waiting
    # retry_backoff_s, doubled each time (at most 30 s); a server this run started that died is restarted with the
    # weights of the current version, at most max_server_restarts times within restart_window_s (0: never; then its
    # staged weights are not kept), before the redo (request_retries 0: no restart either). An attached server that
    # stops answering is waited for up to startup_timeout_s.
    request_retries: int = 3
    retry_backoff_s: float = 1.0
    max_server_restarts: int = 3
    restart_window_s: float = 3600.0

    def check(self) -> None:
        _positive("inference", self, "max_batch_size", "tensor_parallel", "startup_timeout_s", "request_timeout_s",
                  "concurrency", "restart_window_s")
        for name in ("request_retries", "retry_backoff_s", "max_server_restarts"):
            _require(getattr(self, name) >= 0, f"inference.{name}", f"must be >= 0, got {getattr(self, name)}")
        _require(self.stall_timeout_s >= 0, "inference.stall_timeout_s",
                 f"must be >= 0 (0 turns stall detection off), got {self.stall_timeout_s}")
        _require(self.prefix_cache_mb >= 0, "inference.prefix_cache_mb",
                 f"must be >= 0 (0 turns the prefix cache off), got {self.prefix_cache_mb}")
        for i, url in enumerate(self.server_urls):
            _require(url.startswith(("http://", "https://")), f"inference.server_urls[{i}]",
                     f"must be an http(s) URL, got {url!r}")


@dataclass
class FixedEnvConfig:
    """An environment program file (the contract of docs/environments.md) the agent trains on with the designer off:
    ``selfplay.environments``. The hint and the skill travel beside the program, as a designer's do."""

    path: str = ""  # relative to the working directory (as corpus, eval and weight paths; not to the config file)
    hint: str = ""  # what hint plays (rollout.hint_plays_per_env) are given; part of the environment's identity
    skill: str = ""

    def check(self, path: str = "selfplay.environments") -> None:
        _require(self.path.endswith(".py"), f"{path}.path", f"must name a Python program file, got {self.path!r}")
        _require(bool(self.skill), f"{path}.skill", "must name the program's skill (the label of its memory "
                 "records and per-skill trackers)")


@dataclass
class SelfPlayConfig:
    """The SPADE schedule: how many rollouts, how often the designer regenerates, how long its update is delayed."""

    num_rollouts: int = 400
    regen_interval: int = 4
    designer_delay: int = 4
    global_batch_size: int = 192  # samples per optimizer step; one rollout may give several steps
    save_interval: int = 10  # rollouts between checkpoints (model, optimizer and the loop's state); the last is saved
    keep_checkpoints: Optional[int] = 2  # newest checkpoints kept (None keeps all)
    # Periodic checkpoints written in the background (Megatron-Core's asynchronous save): training goes on once the
    # state is copied to host memory; the checkpoint counts (newest for a resume, for keep_checkpoints) once every
    # rank has written it, checked after each rollout. The last save and a SIGUSR1 stop's save wait for their files.
    async_save: bool = False
    # One-step off-policy rollouts (slime's train_async, verl's one-step-off-policy): rank 0 generates rollout r+1 in
    # a background thread while every rank trains on rollout r, so r+1 is sampled from the weights before that
    # training (one rollout's optimizer steps behind the policy it trains: rollout/policy_lag; truncated importance
    # sampling corrects it); the new weights reach the engine once r+1 is done. A rollout that is saved, evaluated or
    # the last is not overlapped with the next (a drain point), so checkpoints and resumes are a synchronous run's.
    # Needs an engine that keeps its memory while the trainer steps (not inference.release_memory). See
    # spade_mega/selfplay/loop.py.
    async_rollouts: bool = False
    # Environment slots the designer left empty (invalid programs) are filled with library programs of the active
    # skills, so the agent always has its envs_per_rollout environments; they never pay a designer. A tiny random
    # model never writes a valid program: without it the demo would train on nothing but designer penalties.
    library_fallback: bool = True
    # Agent-only training: with programs here the designer is off and every rollout plays exactly these (one
    # environment per slot: rollout.envs_per_rollout must equal their number); nothing pays a designer.
    environments: list[FixedEnvConfig] = field(default_factory=list)

    def check(self) -> None:
        _positive("selfplay", self, "num_rollouts", "regen_interval", "global_batch_size", "save_interval",
                  "keep_checkpoints")
        _require(self.designer_delay >= 0, "selfplay.designer_delay", f"must be >= 0, got {self.designer_delay}")
        for i, env in enumerate(self.environments):
            env.check(f"selfplay.environments[{i}]")


@dataclass
class RunConfig:
    """Where a run writes and how it is seeded. The run directory is ``output_dir/name``."""

    name: str = "spade"
    output_dir: str = "runs"
    seed: int = 1234
    resume: Literal["auto", "never", "must"] = "auto"

    def check(self) -> None:
        _require(bool(self.name) and "/" not in self.name, "run.name",
                 f"must be a non-empty folder name without '/', got {self.name!r}")
        _require(bool(self.output_dir), "run.output_dir", "must not be empty")


_SECRET_SUFFIXES = ("API_KEY", "TOKEN", "SECRET", "PASSWORD")  # WANDB_API_KEY, HF_TOKEN, ...: never in launch.env
_WANDB_FORBIDDEN = set("/\\#?%:")  # characters W&B refuses in project and entity names


@dataclass
class WandbConfig:
    """Weights & Biases logging (rank 0): metrics.jsonl's records, one row each with the same names, drawn over the
    metric ``rollout`` (the record's step), and the resolved config; needs ``pip install 'spade-mega[wandb]'``. The
    W&B run id is kept in the run directory, so a resumed or requeued run continues the same W&B run."""

    enabled: bool = False
    project: Optional[str] = None  # None = $WANDB_PROJECT, else spade-mega
    entity: Optional[str] = None  # team or user; None = $WANDB_ENTITY, else the API key's default entity
    group: Optional[str] = None  # groups runs in the W&B UI (a sweep, an ablation)
    name: Optional[str] = None  # display name; None = run.name
    # None = $WANDB_MODE, else online; online needs an API key (wandb login, $WANDB_API_KEY) and never prompts for one
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    tags: list[str] = field(default_factory=list)
    # how long the run's end waits for W&B to upload what it still holds (None = $WANDB_FINISH_TIMEOUT, else 120;
    # 0 = until all is uploaded): with the network down W&B retries for many minutes, holding the job's nodes
    finish_timeout_s: Optional[float] = None

    def check(self) -> None:
        _require(self.finish_timeout_s is None or self.finish_timeout_s >= 0, "logging.wandb.finish_timeout_s",
                 f"must be >= 0 seconds (0: wait until all is uploaded) or null, got {self.finish_timeout_s!r}")
        for key in ("project", "entity"):
            value = getattr(self, key)
            if value is not None:
                _require(0 < len(value) <= 128 and not _WANDB_FORBIDDEN & set(value), f"logging.wandb.{key}",
                         f"must be 1 to 128 characters without any of / \\ # ? % :, got {value!r}")
        for key in ("group", "name"):
            value = getattr(self, key)
            _require(value is None or 0 < len(value) <= 128, f"logging.wandb.{key}",
                     f"must be 1 to 128 characters (or null), got {value!r}")
        for i, tag in enumerate(self.tags):
            _require(0 < len(tag) <= 64, f"logging.wandb.tags[{i}]", f"must be 1 to 64 characters, got {tag!r}")
        _require(len(set(self.tags)) == len(self.tags), "logging.wandb.tags", f"has duplicates: {self.tags!r}")


@dataclass
class LoggingConfig:
    """Metric sinks and console output (spade_mega/monitor): run_dir/metrics.jsonl, run_dir/tensorboard, W&B."""

    jsonl: bool = True
    tensorboard: bool = True
    gpu_stats: bool = True  # NVML memory, utilisation, power, temperature of the node's GPUs in every record
    log_interval: int = 1  # steps between plain progress lines (when there is no progress bar)
    progress: bool = True  # a progress bar when stdout is a terminal
    progress_metrics: list[str] = field(default_factory=lambda: ["agent/return", "designer/regret", "train/loss"])
    level: Literal["debug", "info", "warning", "error"] = "info"
    # run_dir/rollouts/rollout_<N>.jsonl.gz: every designer output and agent episode as text, with its reward and
    # advantage (spade-mega rollouts); each text field kept to transcript_max_chars (its head and tail)
    transcripts: bool = True
    transcript_max_chars: int = 16000
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def check(self) -> None:
        self.wandb.check()
        _positive("logging", self, "log_interval")
        _require(self.transcript_max_chars >= 200, "logging.transcript_max_chars",
                 f"must be >= 200 (room for a text's head, tail and the cut marker), got {self.transcript_max_chars!r}")
        for i, name in enumerate(self.progress_metrics):
            _require("/" in name.strip("/"), f"logging.progress_metrics[{i}]",
                     f"must be a metric name group/name (e.g. agent/return), got {name!r}")


@dataclass
class RewardsConfig:
    """Agent episode reward and the designer reward variant (the paper's ablations); see curriculum/rewards.py.

    Reference (deployed) designer reward: ``blend = 0.6 * plateau(win_rate) + 0.4 * clip(regret / 0.15, 0, 1)``.
    """

    variant: Literal["blend", "regret", "learning_potential", "micro_lp", "learnability"] = "blend"
    plateau_weight: float = 0.6
    regret_weight: float = 0.4
    regret_scale: float = 0.15  # fixed nominal scale of regret (never a per-batch std)
    regret_floor: bool = True  # floor normalised regret at 0; when false, a negative blend is masked instead
    plateau_lo: float = 0.4
    plateau_hi: float = 0.6
    plateau_ramp: float = 0.25
    invalid_program_penalty: float = 0.0
    step_timeout_penalty: float = -0.5
    env_reward_scale_cap: float = 50.0
    ema_fast: float = 0.99  # weight of the newest value in the fast EMA of the learning-potential tracker
    ema_slow: float = 0.95
    # An episode is won when its reward is >= win_threshold: every win rate (plateau, learning potential,
    # learnability, memory outcomes, the solvability check, metrics) counts wins; regret is a difference of returns
    win_threshold: float = 0.5
    agent_reward_min: float = -1.0
    agent_reward_max: float = 1.0
    truncated_episode: Literal["zero", "return"] = "zero"  # reward of an episode cut by the turn budget

    def check(self) -> None:
        for name in ("plateau_weight", "regret_weight"):
            value = getattr(self, name)
            _require(value >= 0.0, f"rewards.{name}", f"must be >= 0, got {value}")
        _positive("rewards", self, "regret_scale", "plateau_ramp", "env_reward_scale_cap")
        _require(0.0 <= self.plateau_lo <= self.plateau_hi <= 1.0, "rewards.plateau_lo",
                 f"needs 0 <= rewards.plateau_lo <= rewards.plateau_hi <= 1, got {self.plateau_lo}, {self.plateau_hi}")
        for name in ("invalid_program_penalty", "step_timeout_penalty"):
            value = getattr(self, name)
            _require(-1.0 <= value <= 0.0, f"rewards.{name}", f"must be a bounded penalty in [-1, 0], got {value}")
        _require(0.0 < self.ema_slow < self.ema_fast < 1.0, "rewards.ema_fast",
                 f"needs 0 < rewards.ema_slow < rewards.ema_fast < 1, got {self.ema_slow}, {self.ema_fast}")
        _require(self.agent_reward_min < self.agent_reward_max, "rewards.agent_reward_max",
                 f"must be > rewards.agent_reward_min ({self.agent_reward_min}), got {self.agent_reward_max}")
        _require(self.agent_reward_min < self.win_threshold <= self.agent_reward_max, "rewards.win_threshold",
                 f"must be in (rewards.agent_reward_min, rewards.agent_reward_max] = ({self.agent_reward_min}, "
                 f"{self.agent_reward_max}] (else every episode or none is a win), got {self.win_threshold}")


@dataclass
class RLConfig:
    """GRPO for both roles: advantages, PPO-clip (or GSPO) loss, truncated importance sampling; see rl/. Reference:
    KL 0, entropy 0."""

    # "ppo": token-level PPO-clip (GRPO, the SPADE recipe). "gspo": Group Sequence Policy Optimization (Zheng et al.
    # 2025; verl's loss_mode gspo, slime's --advantage-estimator gspo): one importance ratio per sample, the geometric
    # mean of its tokens' ratios, clipped per sample; needs loss_aggregation seq-mean-token-mean and clip ranges of
    # its own scale: the paper's 3e-4 / 4e-4. The PPO defaults 0.2 / 0.28 are wrong for GSPO (a per-token geometric
    # mean stays far inside them: it would almost never clip), so gspo with both at those defaults is refused.
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    tis_level: Literal["token", "sequence"] = "token"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    # KL to a reference policy in the loss (verl's use_kl_loss, slime's --use-kl-loss): kl_coef x the per-token
    # estimate of KL(current || reference), rl.loss.kl_to_reference: k1, k2, k3 (unbiased and >= 0: the default) or
    # verl's low_var_kl (k3 clamped at 10). The reference: "initial" = the weights the run starts from
    # (inference.hf_weights, else the seeded initialisation), or a spade-mega checkpoint or Hugging Face folder. Its
    # weights are kept in host memory (docs/megatron.md, KL to a reference policy).
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    reference: str = "initial"
    entropy_coef: float = 0.0
    adv_std_normalize: bool = True  # agent advantages only; designer advantages are never divided by a std
    adv_eps: float = 1e-6
    # DAPO's dynamic sampling (verl's algorithm.filter_groups): an environment's agent group whose rewards are all equal
    # (always won, always lost) has advantage 0 everywhere; true drops its samples from the optimizer steps instead of
    # letting them dilute the token mean. Designer samples are never dropped; returns, win rates, regret and the
    # designer's reward still count every play (README, Training: dynamic sampling). Off in the SPADE recipe.
    filter_zero_std_groups: bool = False
    # MoE routing replay (slime's --use-routing-replay, verl's router replay R2): the experts each MoE layer chose for
    # each token in the rollout's old-log-prob pass are replayed in every optimizer step's forward (and backward
    # recompute), so the token ratio compares the same experts; docs/megatron.md, Routing replay. MoE models only.
    routing_replay: bool = False

    def check_routing_replay(self, num_experts: int) -> None:
        """Routing replay needs a model with a router (``num_experts``: the model's, resolved from its config)."""
        _require(not self.routing_replay or num_experts > 0, "rl.routing_replay",
                 "needs a mixture-of-experts model (model.num_experts > 0): a dense model routes nothing to replay; "
                 "set rl.routing_replay false")

    def check(self) -> None:
        _require(0.0 < self.eps_clip_low < 1.0, "rl.eps_clip_low", f"must be in (0, 1), got {self.eps_clip_low}")
        _positive("rl", self, "eps_clip_high", "tis_clip", "adv_eps")
        _require(0.0 <= self.tis_clip_low <= 1.0 <= self.tis_clip, "rl.tis_clip_low",
                 f"needs 0 <= rl.tis_clip_low <= 1 <= rl.tis_clip, got {self.tis_clip_low}, {self.tis_clip}")
        if self.policy_loss == "gspo":
            _require(self.loss_aggregation == "seq-mean-token-mean", "rl.loss_aggregation",
                     f"must be seq-mean-token-mean with rl.policy_loss gspo (each sample's term is its token mean, "
                     f"each sample weighs the same, as in the GSPO objective), got {self.loss_aggregation}; "
                     "examples/configs/qwen3_30b_a3b_gspo.yaml has all of GSPO's settings")
            # one bound set and the other forgotten at PPO's is as bad on its side: a clip of 0.2 below lets the
            # negative-advantage samples' ratio fall unclipped
            for name, ppo in (("eps_clip_low", 0.2), ("eps_clip_high", 0.28)):
                _require(getattr(self, name) != ppo, f"rl.{name}",
                         f"is left at the PPO default {ppo} with rl.policy_loss gspo, whose per-sample ratio (a "
                         "geometric mean over the tokens) stays far inside it: it would almost never clip. Set GSPO's "
                         "own ranges, the paper's rl.eps_clip_low 3e-4 and rl.eps_clip_high 4e-4")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            _require(value >= 0.0, f"rl.{name}", f"must be >= 0, got {value}")
        _require(bool(self.reference), "rl.reference", "must be 'initial' or a checkpoint / Hugging Face folder")
        # a named reference with the KL term off would be read by nothing: the run would train without the KL its
        # user asked for, silently
        _require(self.kl_coef > 0 or self.reference == "initial", "rl.reference",
                 f"names {self.reference} but rl.kl_coef is 0: the reference policy is used only by the KL term, so "
                 "it would be ignored; set rl.kl_coef > 0, or leave rl.reference at 'initial'")


@dataclass
class CorpusSourceConfig:
    """One corpus source. ``path``: a JSONL or Parquet file, a ``save_to_disk`` dataset folder, a folder of text
    files, or ``builtin:maths|science|code`` (the offline default corpus). Field names may be dotted (``meta.id``)."""

    path: str = "builtin:maths"
    format: Literal["auto", "jsonl", "parquet", "hf_disk", "text", "builtin"] = "auto"
    domain: str = "maths"  # label of every document, unless domain_field names a per-record label
    text_field: str = "text"
    id_field: Optional[str] = None  # None = the record's position in the source
    domain_field: Optional[str] = None
    split: Optional[str] = None  # DatasetDict folders: one split (None = all)

    def check(self, path: str = "curriculum.corpus.sources") -> None:
        _require(bool(self.path), f"{path}.path", "must not be empty")
        _require(bool(self.domain), f"{path}.domain", "must not be empty")
        _require(bool(self.text_field), f"{path}.text_field", "must not be empty")


def _builtin_sources() -> list[CorpusSourceConfig]:
    return [CorpusSourceConfig(path=f"builtin:{d}", domain=d) for d in ("maths", "science", "code")]


@dataclass
class CorpusConfig:
    """Grounding documents for designer prompts (reference: 10k maths + 5k science, or 15k code; ~6000 tokens)."""

    sources: list[CorpusSourceConfig] = field(default_factory=_builtin_sources)
    token_budget: int = 6000  # tokens of the run's tokenizer (model.tokenizer) per document
    min_chars: int = 200  # shorter documents are skipped
    dedup: bool = True  # drop exact and near duplicates at load time
    near_duplicate_threshold: float = 0.8  # estimated Jaccard of word 5-gram sets

    def check(self) -> None:
        _require(bool(self.sources), "curriculum.corpus.sources", "needs at least one source")
        for i, source in enumerate(self.sources):
            source.check(f"curriculum.corpus.sources[{i}]")
        _positive("curriculum.corpus", self, "token_budget")
        _require(self.min_chars >= 0, "curriculum.corpus.min_chars", f"must be >= 0, got {self.min_chars}")
        _require(0.0 < self.near_duplicate_threshold <= 1.0, "curriculum.corpus.near_duplicate_threshold",
                 f"must be in (0, 1], got {self.near_duplicate_threshold}")


@dataclass
class MemoryConfig:
    """The environment memory (SQLite, WAL): every environment ever proposed; prompts see a recent window of it."""

    path: str = "memory.sqlite"  # relative to the run directory
    prompt_window: int = 200  # seeds and negatives are drawn from this many most recently played environments
    seeds_per_prompt: int = 2  # high-regret environments shown in full as few-shot seeds
    negatives_per_prompt: int = 4  # mastered / unsolvable environments summarised as "do not repeat"
    near_duplicate_threshold: float = 0.9  # program similarity (normalised-AST token 5-grams) that counts as a copy
    synchronous: Literal["normal", "full"] = "full"  # full: a commit survives power loss too, not just a crash

    def check(self) -> None:
        _require(bool(self.path), "curriculum.memory.path", "must not be empty")
        _positive("curriculum.memory", self, "prompt_window")
        for name in ("seeds_per_prompt", "negatives_per_prompt"):
            value = getattr(self, name)
            _require(value >= 0, f"curriculum.memory.{name}", f"must be >= 0, got {value}")
        _require(0.0 < self.near_duplicate_threshold <= 1.0, "curriculum.memory.near_duplicate_threshold",
                 f"must be in (0, 1], got {self.near_duplicate_threshold}")


@dataclass
class SkillConfig:
    """A skill the designer writes environments for; ``domains`` are the corpus domains grounding it (empty = all)."""

    name: str = ""
    description: str = ""
    domains: list[str] = field(default_factory=list)


def _default_skills() -> list[SkillConfig]:
    return [
        SkillConfig("arithmetic", "arithmetic and algebra: compute, solve equations, manipulate numbers", ["maths"]),
        SkillConfig("logic", "logic deduction: constraints, truth tellers, orderings, inference puzzles", ["maths"]),
        SkillConfig("navigation", "spatial and grid navigation: mazes, maps, moving pieces on a board",
                    ["maths", "science"]),
        SkillConfig("science", "science simulation: physical, chemical or biological systems stepped in time",
                    ["science"]),
        SkillConfig("code_tracing", "algorithm and code tracing: predict what a procedure does or returns",
                    ["code"]),
        SkillConfig("tool_use", "stateful tool use with mock APIs: call functions with arguments to reach a goal",
                    ["code"]),
    ]


@dataclass
class CurriculumConfig:
    """What keeps the designer diverse: corpus grounding, environment memory, skills (reference: 6, 3 active)."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    skills: list[SkillConfig] = field(default_factory=_default_skills)
    active_skills: int = 3  # skills chosen round-robin for each regeneration

    def check(self) -> None:
        self.corpus.check()
        self.memory.check()
        _require(bool(self.skills), "curriculum.skills", "needs at least one skill")
        seen: set[str] = set()
        for i, skill in enumerate(self.skills):
            where = f"curriculum.skills[{i}]"
            _require(skill.name.isidentifier() and skill.name == skill.name.lower(), f"{where}.name",
                     f"must be a lower-case identifier (letters, digits, _), got {skill.name!r}")
            _require(skill.name not in seen, f"{where}.name", f"duplicate skill {skill.name!r}")
            _require(bool(skill.description.strip()), f"{where}.description", "must describe the skill")
            seen.add(skill.name)
        _require(1 <= self.active_skills <= len(self.skills), "curriculum.active_skills",
                 f"must be in [1, number of curriculum.skills ({len(self.skills)})], got {self.active_skills}")


@dataclass
class SandboxConfig:
    """Isolated workers that run environment programs (spade_mega/envs/sandbox). ``strict`` refuses to start without
    bubblewrap and seccomp; ``best-effort`` runs with what the machine has and logs, loudly, what it got."""

    isolation: Literal["strict", "best-effort"] = "strict"
    warm_workers: int = 4  # workers started ahead of need, so open() and replacements do not wait
    spawners: int = 2  # threads starting workers in parallel
    call_timeout_s: float = 5.0  # deadline of one reset() or step()
    load_timeout_s: float = 10.0  # deadline of loading a program (its module-level code)
    start_timeout_s: float = 30.0  # deadline of starting one worker
    memory_mb: int = 1024  # address space (RLIMIT_AS) and memory cgroup limit of one worker
    cpu_s: int = 600  # CPU seconds over a worker's life (RLIMIT_CPU); a handle renews its worker at half of it
    file_size_mb: int = 8  # largest file a program can write (RLIMIT_FSIZE), its captured output included
    open_files: int = 64  # RLIMIT_NOFILE
    threads: int = 8  # tasks per worker (RLIMIT_NPROC in the worker's user namespace; pids cgroup)
    scratch_mb: int = 16  # size of the writable /tmp inside the sandbox
    output_limit_kb: int = 64  # what a program may print (stdout + stderr) in one call
    reply_limit_kb: int = 1024  # one encoded reply: observation and info
    hash_seed: int = 0  # PYTHONHASHSEED of every worker, so set and dict orders agree across workers
    uid: int = 65534  # the non-root user workers run as when the trainer runs as root
    gid: int = 65534
    bwrap: str = "bwrap"  # name or path of the bubblewrap executable
    cgroups: bool = True  # per-worker memory and pids cgroups where this process may create them

    def check(self) -> None:
        _positive("sandbox", self, "warm_workers", "spawners", "call_timeout_s", "load_timeout_s", "start_timeout_s",
                  "memory_mb", "cpu_s", "file_size_mb", "open_files", "threads", "scratch_mb", "output_limit_kb",
                  "reply_limit_kb")
        _require(self.memory_mb >= 256, "sandbox.memory_mb", f"must be >= 256 (the interpreter needs it), "
                                                              f"got {self.memory_mb}")
        _require(self.open_files >= 16, "sandbox.open_files", f"must be >= 16, got {self.open_files}")
        _require(self.output_limit_kb < self.file_size_mb << 10, "sandbox.output_limit_kb",
                 f"must be below sandbox.file_size_mb ({self.file_size_mb} MB), got {self.output_limit_kb}")
        _require(0 <= self.hash_seed <= 4294967295, "sandbox.hash_seed", f"must be in [0, 2**32 - 1], "
                                                                          f"got {self.hash_seed}")
        for name in ("uid", "gid"):
            _require(0 < getattr(self, name) < 2**32 - 1, f"sandbox.{name}",
                     f"must be a non-root id, got {getattr(self, name)}")


@dataclass
class SolvabilityConfig:
    """The LLM solvability check, validation's last step (SPADE's tool-use recipe), in one of two modes.
    ``play``: the policy plays the program with its hint ``attempts`` times (each attempt a fresh reset seed, all
    programs' attempts batched in lockstep); it is solvable when at least ``min_wins`` attempts are won
    (``rewards.win_threshold``). ``judge`` (the reference's): the policy reads the program's source and answers a boxed
    yes or no, one request per program, at most ``judge_max_tokens`` long; a reply without a verdict and a failed
    engine call are decided by ``on_no_verdict`` / ``on_error`` (the reference accepts both). Off by default;
    ``temperature`` (the reference's 0.3) samples either mode (docs/environments.md)."""

    enabled: bool = False
    mode: Literal["play", "judge"] = "play"
    attempts: int = 4  # play
    min_wins: int = 1  # play
    temperature: float = 0.3
    judge_max_tokens: int = 16384  # judge: the reply's length limit (the reference's --spade-env-validator-max-tokens)
    on_no_verdict: Literal["accept", "refuse"] = "accept"  # judge: a reply with no single \boxed{yes} / \boxed{no}
    on_error: Literal["accept", "refuse"] = "accept"  # judge: the engine call failed (EngineError) or cannot fit

    def check(self) -> None:
        _positive("validation.solvability", self, "attempts", "min_wins", "judge_max_tokens")
        _require(self.min_wins <= self.attempts, "validation.solvability.min_wins",
                 f"must be <= validation.solvability.attempts ({self.attempts}), got {self.min_wins}")
        _require(self.temperature >= 0.0, "validation.solvability.temperature",
                 f"must be >= 0, got {self.temperature}")


@dataclass
class ValidationConfig:
    """What an environment program must pass before it is used (spade_mega/envs/validate.py)."""

    reward_min: float = -1.0  # every reward must lie in [reward_min, reward_max]
    reward_max: float = 1.0
    max_turns_limit: int = 100  # the largest max_turns a program may declare
    seed: int = 0  # seed of the determinism check and of the random-action policy
    random_episodes: int = 2  # episodes played with random actions (each must end within max_turns)
    concurrency: int = 4  # programs validated at once
    # Wall-clock seconds all of one program's validation episodes may take together (sandbox.call_timeout_s bounds
    # only each call: 100 turns of slow steps would hold a validator for minutes). Checked after every call, so a
    # program is stopped within one call of it; loading it is bounded apart, by sandbox.load_timeout_s. 30 s is six
    # call deadlines; each library program validates in about a second at most, worker start-up included.
    time_budget_s: float = 30.0
    solvability: SolvabilityConfig = field(default_factory=SolvabilityConfig)

    def check(self) -> None:
        self.solvability.check()
        _require(self.reward_min < self.reward_max, "validation.reward_max",
                 f"must be > validation.reward_min ({self.reward_min}), got {self.reward_max}")
        _positive("validation", self, "max_turns_limit", "random_episodes", "concurrency", "time_budget_s")
        # episodes run from seed to seed + random_episodes, and the sandbox takes seeds that fit in 64 bits
        _require(-2**63 <= self.seed <= 2**64 - 1 - self.random_episodes, "validation.seed",
                 f"must be in [-2**63, 2**64 - 1 - validation.random_episodes], got {self.seed}")
        played = self.solvability.enabled and self.solvability.mode == "play"
        _require(not played or self.seed <= 2**64 - self.solvability.attempts, "validation.seed",
                 f"must be <= 2**64 - validation.solvability.attempts ({self.solvability.attempts}): the check's "
                 f"attempts reset from seed to seed + attempts - 1, in 64 bits; got {self.seed}")


@dataclass
class KernelsConfig:
    """Triton kernels for the GRPO hot spots (spade_mega.kernels). Enabled, they run on CUDA tensors (and on CPU under
    TRITON_INTERPRET=1); elsewhere, and when disabled, the plain-torch references run. Off by default: the CPU demo and
    tests gain nothing from the interpreter."""

    enabled: bool = False

    def check(self) -> None:
        """A single switch: nothing to check against."""


@dataclass
class BridgeConfig:
    """Weight transfer from the trainer to the rollout engines (spade_mega/bridge): full Hugging Face tensors streamed
    in buckets, so neither side ever holds a second copy of the whole model."""

    bucket_mb: int = 512  # largest bucket (MiB) of one weight update; a single larger tensor goes alone

    def check(self) -> None:
        _positive("bridge", self, "bucket_mb")


def slurm_time_seconds(text: str) -> Optional[int]:
    """Seconds of a SLURM time limit (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``); None if malformed."""
    days, sep, rest = text.partition("-")
    if not sep:
        days, rest = "0", text
    parts = rest.split(":")
    if not days.isdigit() or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts]
    if sep:  # D-H, D-H:M, D-H:M:S
        h, m, s = (numbers + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        h, m, s = ([0] + numbers + [0])[:3] if len(numbers) < 3 else numbers
    return ((int(days) * 24 + h) * 60 + m) * 60 + s


@dataclass
class LaunchConfig:
    """The SLURM job that runs this config (spade_mega/launch, ``spade-mega launch slurm``): its shape, its
    environment, and where the inference engines run. The trainer's world is ``nodes x gpus_per_node`` processes."""

    nodes: int = 1  # nodes of the trainer (placement 'separate' adds engine_nodes on top)
    gpus_per_node: int = 8
    launcher: Literal["torchrun", "srun"] = "torchrun"  # one torchrun per node, or one srun task per GPU
    partition: Optional[str] = None  # None: the cluster's default
    account: Optional[str] = None
    qos: Optional[str] = None
    time: Union[str, int] = "24:00:00"  # SLURM time limit, quoted: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S
    job_name: Optional[str] = None  # None: run.name
    cpus_per_task: Optional[int] = None  # per srun task (a node's torchrun, or one rank under launcher srun)
    sbatch_extra: list[str] = field(default_factory=list)  # more directives, e.g. "--constraint=h100", "--exclusive"
    setup: list[str] = field(default_factory=list)  # shell lines run first: module load, source .venv/bin/activate
    container_image: Optional[str] = None  # pyxis/enroot image every srun step runs in
    container_mounts: list[str] = field(default_factory=list)  # SRC:DST pairs for --container-mounts
    workdir: Optional[str] = None  # where the job runs; None: the directory sbatch was called from
    log_dir: str = "logs"  # job, engine and resolved-config files; relative to workdir
    python: str = "python"  # interpreter (after setup) that has spade-mega installed
    env: dict[str, str] = field(default_factory=dict)  # exported to every process: NCCL_*, HF_HOME, ...
    master_port: Optional[int] = None  # None: 20000 + job id % 10000, so jobs sharing a node do not collide
    # Where the rollout engines run. in_process: rollout.engine hf inside global rank 0. colocated: servers on the
    # trainer's GPUs (the SPADE recipe: SGLang EP8 on the same 8 GPUs). separate: servers on engine_nodes more nodes.
    # auto: in_process for hf, colocated for sglang and vllm.
    engine_placement: Literal["auto", "in_process", "colocated", "separate"] = "auto"
    engine_nodes: int = 0  # placement separate: nodes given to the engine servers
    engine_gpus: Optional[int] = None  # GPUs of one server (its tensor/expert parallel size); None: a whole node
    # The servers' command is the engine's own (spade_mega/inference): they serve inference.hf_weights with
    # inference.server_args; a colocated server frees its GPU memory while the trainer steps.
    engine_port: int = 30000  # first server of a node; the next ones count up
    engine_start_timeout_s: int = 1800  # the trainer waits this long for every server's /health
    requeue: bool = True  # checkpoint before the time limit and requeue the job (needs run.resume auto)
    signal_before_s: int = 600  # the trainer gets SIGUSR1 this long before the time limit

    def check(self) -> None:
        _positive("launch", self, "nodes", "gpus_per_node", "cpus_per_task", "engine_gpus", "engine_start_timeout_s",
                  "signal_before_s")
        _require(isinstance(self.time, str), "launch.time",
                 f"must be quoted, like time: \"24:00:00\" (YAML reads an unquoted 24:00:00 as the number 86400, "
                 f"and 30 as a number too), got {self.time!r}")
        limit = slurm_time_seconds(self.time)
        _require(limit is not None and limit > 0, "launch.time",
                 f"must be a SLURM time limit (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S), got {self.time!r}")
        if self.requeue:
            _require(limit > self.signal_before_s + 60, "launch.signal_before_s",
                     f"must leave at least a minute of launch.time ({self.time}) before the checkpoint signal, "
                     f"got {self.signal_before_s} s")
        for name in ("job_name", "partition", "account", "qos"):
            value = getattr(self, name)
            _require(value is None or (bool(value) and not any(c.isspace() for c in value)), f"launch.{name}",
                     f"must be a non-empty word without spaces, got {value!r}")
        for i, directive in enumerate(self.sbatch_extra):
            _require(directive.startswith("--") and "\n" not in directive, f"launch.sbatch_extra[{i}]",
                     f"must be one sbatch option like '--constraint=h100', got {directive!r}")
        for i, line in enumerate(self.setup):
            _require("\n" not in line, f"launch.setup[{i}]", "must be one shell line (give several lines as a list)")
        for key in self.env:
            _require(key.isidentifier(), f"launch.env.{key}", "must be an environment variable name")
            # launch.env is written into the sbatch script, RUN_DIR/config.yaml, report.html and the W&B run's config
            _require(not key.upper().endswith(_SECRET_SUFFIXES), f"launch.env.{key}",
                     "looks like a secret, and launch.env is written into the sbatch script, the run's config.yaml, "
                     "its report and its W&B config: export it in the shell that submits the job instead (sbatch "
                     "hands the submitter's environment to every step), or for W&B run `wandb login` once")
        for name in ("master_port", "engine_port"):
            value = getattr(self, name)
            _require(value is None or 1024 <= value <= 65535, f"launch.{name}", f"must be in [1024, 65535], "
                                                                                  f"got {value}")
        _require(bool(self.log_dir) and bool(self.python), "launch.log_dir" if not self.log_dir else "launch.python",
                 "must not be empty")
        _require(self.engine_nodes >= 0, "launch.engine_nodes", f"must be >= 0, got {self.engine_nodes}")
        _require((self.engine_placement == "separate") == (self.engine_nodes > 0), "launch.engine_nodes",
                 f"must be > 0 exactly when launch.engine_placement is 'separate', got {self.engine_nodes} "
                 f"with placement {self.engine_placement!r}")
        _require(self.engine_gpus is None or self.gpus_per_node % self.engine_gpus == 0, "launch.engine_gpus",
                 f"must divide launch.gpus_per_node ({self.gpus_per_node}), got {self.engine_gpus}")


_SUITE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class EvalSuiteConfig:
    """One held-out evaluation suite (docs/evaluation.md). ``kind: qa``: question-answer items from ``path`` (a JSONL
    or Parquet file, or ``builtin:arithmetic``), each asked ``samples`` times through ``prompt_template`` (its
    ``{question}`` and ``{choices}`` are replaced; other braces stay as written) and scored by ``scorer``.
    ``kind: env``: the named library ``environments`` played ``episodes`` times each by the agent."""

    name: str = ""
    kind: Literal["qa", "env"] = "qa"
    path: str = "builtin:arithmetic"
    format: Literal["auto", "jsonl", "parquet", "builtin"] = "auto"
    question_field: str = "question"  # field names may be dotted (meta.question)
    answer_field: str = "answer"
    choices_field: Optional[str] = None  # a list of options, rendered as "A. ...", "B. ..." into {choices}
    id_field: Optional[str] = None  # None = the item's position in the file
    scorer: Literal["boxed", "choice", "exact", "code"] = "boxed"  # code: answer_field holds stdin/stdout tests
    prompt_template: str = "{question}\n\nPut your final answer within \\boxed{}."
    system_prompt: Optional[str] = None
    samples: int = 1  # completions per item (k of avg@k and pass@k)
    max_items: Optional[int] = None  # the first N items; None = all
    temperature: float = 0.6
    top_p: float = 1.0
    max_response_tokens: int = 1024
    environments: list[str] = field(default_factory=list)  # kind env: library environment names
    episodes: int = 4  # kind env: episodes per environment

    def check(self, path: str = "eval.suites") -> None:
        _require(bool(_SUITE_NAME.fullmatch(self.name)), f"{path}.name",
                 f"must be letters, digits, '_', '.' or '-' (it names the metrics eval/<name>/...), got {self.name!r}")
        _positive(path, self, "samples", "max_items", "max_response_tokens", "episodes")
        _require(0.0 <= self.temperature < float("inf"), f"{path}.temperature",
                 f"must be a finite number >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"{path}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.kind == "qa":
            _require(bool(self.path), f"{path}.path", "must name a JSONL or Parquet file, or builtin:arithmetic")
            _require("{question}" in self.prompt_template, f"{path}.prompt_template",
                     "must contain {question}, where each item's question goes")
            _require(bool(self.question_field) and bool(self.answer_field), f"{path}.question_field",
                     "question_field and answer_field must not be empty")
        else:
            _require(bool(self.environments), f"{path}.environments",
                     "an env suite needs at least one library environment name (spade-mega env list)")


@dataclass
class EvalConfig:
    """Held-out evaluation during training (every ``interval`` rollouts, after the weight sync; ``before_train``
    also before the first) and by ``spade-mega eval``. Metrics are logged as ``eval/<suite>/<metric>``."""

    interval: int = 0  # rollouts between evaluations; 0 = never during training
    before_train: bool = False
    suites: list[EvalSuiteConfig] = field(default_factory=list)

    def check(self) -> None:
        _require(self.interval >= 0, "eval.interval", f"must be >= 0 (0 = off), got {self.interval}")
        _require(bool(self.suites) or (self.interval == 0 and not self.before_train), "eval.suites",
                 "needs at least one suite when eval.interval > 0 or eval.before_train is true")
        seen: set[str] = set()
        for i, suite in enumerate(self.suites):
            suite.check(f"eval.suites[{i}]")
            _require(suite.name not in seen, f"eval.suites[{i}].name", f"duplicate suite {suite.name!r}")
            seen.add(suite.name)


@dataclass
class SpadeConfig:
    """The whole run configuration, as resolved from YAML files and command-line overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    selfplay: SelfPlayConfig = field(default_factory=SelfPlayConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check(self) -> None:
        """Check every section, then the constraints that span sections."""
        for name in self.__dataclass_fields__:
            getattr(self, name).check()
        m, p = self.model, self.parallel
        _require(m.num_attention_heads % p.tensor == 0, "parallel.tensor",
                 f"must divide model.num_attention_heads ({m.num_attention_heads}), got {p.tensor}")
        _require(m.num_query_groups % p.tensor == 0, "parallel.tensor",
                 f"must divide model.num_query_groups ({m.num_query_groups}), got {p.tensor}")
        _require(m.num_layers % p.pipeline == 0, "parallel.pipeline",
                 f"must divide model.num_layers ({m.num_layers}), got {p.pipeline}")
        if p.expert > 1:
            _require(m.num_experts > 0, "parallel.expert", "needs a mixture-of-experts model (model.num_experts > 0)")
            _require(m.num_experts % p.expert == 0, "parallel.expert",
                     f"must divide model.num_experts ({m.num_experts}), got {p.expert}")
        if m.num_experts and p.tensor > 1:
            _require(p.sequence_parallel, "parallel.sequence_parallel",
                     "must be true when a mixture-of-experts model uses parallel.tensor > 1 (Megatron-Core requires it)")
        if m.hf_config is None:  # with a config.json, its value wins (the engine refuses a request past it)
            _require(self.rollout.max_context_tokens <= m.max_position_embeddings, "rollout.max_context_tokens",
                     f"must be <= model.max_position_embeddings ({m.max_position_embeddings}): every episode and "
                     f"designer sample grows up to it; got {self.rollout.max_context_tokens}")
        if m.hf_config is None:  # else the trainer checks the model its config.json describes
            self.rl.check_routing_replay(m.num_experts)
        _require(not self.rl.filter_zero_std_groups or self.rollout.agent_trajectories_per_env > 1,
                 "rl.filter_zero_std_groups", "true needs rollout.agent_trajectories_per_env > 1: a group of one play "
                 "has no spread of rewards, so every agent sample would be dropped and the agent never trained")
        r, fixed = self.rewards, self.selfplay.environments
        if fixed:
            _require(self.rollout.envs_per_rollout == len(fixed), "rollout.envs_per_rollout",
                     f"must equal the number of selfplay.environments ({len(fixed)}), which every rollout plays; got "
                     f"{self.rollout.envs_per_rollout}")
            for i, env in enumerate(fixed):  # a hint play without a hint is one more plain play: its regret is noise
                _require(bool(env.hint) or self.rollout.hint_plays_per_env == 0, f"selfplay.environments[{i}].hint",
                         f"must be given: rollout.hint_plays_per_env ({self.rollout.hint_plays_per_env}) plays every "
                         "environment with its hint (or set it to 0)")
        elif r.variant == "regret" or (r.variant == "blend" and r.regret_weight > 0):  # a designer to pay
            _require(self.rollout.hint_plays_per_env > 0, "rollout.hint_plays_per_env",
                     f"must be > 0: rewards.variant {r.variant!r} measures regret with hint plays")
        if r.variant == "micro_lp":
            _require(self.selfplay.designer_delay >= 2, "selfplay.designer_delay",
                     "must be >= 2 for rewards.variant 'micro_lp' (a slope needs plays at two steps or more), "
                     f"got {self.selfplay.designer_delay}")
        placement, engine = self.launch.engine_placement, self.rollout.engine
        _require(placement in ("auto", "in_process") or engine != "hf", "launch.engine_placement",
                 f"{placement!r} starts engine servers: needs rollout.engine sglang or vllm, got 'hf' (which runs "
                 "in-process on global rank 0; use placement 'in_process' or 'auto')")
        _require(self.inference.release_memory is not True or engine != "hf", "inference.release_memory",
                 "true needs a server engine (rollout.engine sglang or vllm): the hf engine runs inside the trainer's "
                 "process, with no server to release memory (use auto or false)")
        _require(placement != "in_process" or engine == "hf", "launch.engine_placement",
                 f"'in_process' needs rollout.engine 'hf', got {engine!r} (a server engine is 'colocated' or "
                 "'separate')")
        if self.selfplay.async_rollouts:  # the engine would be asleep (its memory released) while the trainer steps
            releases = self.inference.release_memory is True or (
                self.inference.release_memory == "auto" and engine != "hf" and placement in ("auto", "colocated"))
            _require(not releases, "selfplay.async_rollouts",
                     "true overlaps the next rollout with the trainer's steps, but the engine servers release their "
                     "GPU memory while the trainer steps (inference.release_memory "
                     f"{self.inference.release_memory!r}, launch.engine_placement {placement!r}: colocated servers "
                     "sleep during training). Put the servers on their own GPUs (launch.engine_placement separate), "
                     "or keep their memory (inference.release_memory false, if the trainer and the servers both fit "
                     "on the GPUs), or set selfplay.async_rollouts false")
            _require(self.parallel.offload_trainer is not True, "parallel.offload_trainer",
                     "true releases the trainer's memory while the engine generates, but with selfplay.async_rollouts "
                     "the trainer steps while the engine generates: set it to auto or false")
        _require(not self.launch.requeue or self.run.resume == "auto", "launch.requeue",
                 f"needs run.resume 'auto' (a requeued job resumes from its checkpoint), got {self.run.resume!r}")
