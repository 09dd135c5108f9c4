"""Bytes a rollout transcript takes on disk at the 30B recipe's size, against two baselines measured in the same run.

    python -m tools.bench transcripts [--envs 24] [--plays 32] [--turns 6] [--reply-tokens 500] [--max-chars 16000]
    python tools/bench/transcripts.py ...

A synthetic rollout shaped like examples/configs/qwen3_30b_a3b_games.yaml (24 environments x (16 + 16 hint) plays,
24 designer outputs) goes through the loop's own path: :class:`RolloutTranscript` builds the records (decoding, clipping
to ``logging.transcript_max_chars``) and ``write_rollout`` writes the gzip file. Text comes from the built-in corpus
(maths and science prose for replies and observations, standard-library source for designer programs), so it
compresses like model text, not like random bytes. Characters stand for tokens at ``--chars-per-token`` (about 4 for
English with a BPE vocabulary); the byte tokenizer used here has one token per character.

Baselines: the same records as plain JSON lines (gzip off), and the token ids the trainer receives for the rollout
(int32, what a rollout dump of ids alone would hold).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spade_mega.config.loader import load_config  # noqa: E402
from spade_mega.curriculum.default_corpus import builtin_documents  # noqa: E402
from spade_mega.envs import library  # noqa: E402
from spade_mega.envs.program import EnvProgram  # noqa: E402
from spade_mega.rl.delayed import DesignerSample  # noqa: E402
from spade_mega.rollout.records import AgentEpisode, DesignerOutcome, DesignerSlot, TokenSequence  # noqa: E402
from spade_mega.selfplay.state import ActiveEnv  # noqa: E402
from spade_mega.selfplay.transcripts import RolloutTranscript  # noqa: E402
from spade_mega.tokenizer import byte_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class _Text:
    """Consecutive slices of the built-in corpus, as long as asked."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.stream = itertools.cycle([text for kind in kinds for _, text in
                                       itertools.islice(builtin_documents(kind), 1000)])
        self.buffer = ""

    def take(self, chars: int) -> str:
        while len(self.buffer) < chars:
            self.buffer += next(self.stream) + "\n"
        out, self.buffer = self.buffer[:chars], self.buffer[chars:]
        return out


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # the byte tokenizer's ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench transcripts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=24, help="rollout.envs_per_rollout (designer outputs too)")
    parser.add_argument("--plays", type=int, default=32, help="plays per environment (agent + hint)")
    parser.add_argument("--turns", type=int, default=6, help="turns per episode")
    parser.add_argument("--reply-tokens", type=int, default=500, help="tokens of each agent reply")
    parser.add_argument("--prompt-tokens", type=int, default=600, help="tokens of an agent's first prompt")
    parser.add_argument("--observation-tokens", type=int, default=100, help="tokens of each observation")
    parser.add_argument("--designer-prompt-tokens", type=int, default=6000)
    parser.add_argument("--designer-reply-tokens", type=int, default=3000)
    parser.add_argument("--chars-per-token", type=float, default=4.0)
    parser.add_argument("--max-chars", type=int, default=16000, help="logging.transcript_max_chars")
    args = parser.parse_args(argv)
    c = args.chars_per_token

    cfg = load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml",
                      [f"logging.transcript_max_chars={args.max_chars}"])
    tokenizer = byte_tokenizer()
    prose, code = _Text(("maths", "science")), _Text(("code",))
    base = library.get("grid_maze").program()
    envs = [ActiveEnv(EnvProgram(base.source + f"\n# variant {e}\n", base.hint, base.skill), "designer", e, 1)
            for e in range(args.envs)]
    transcript = RolloutTranscript(cfg, 1, tokenizer)
    token_count = 0
    for e, env in enumerate(envs):
        reply = code.take(int(args.designer_reply_tokens * c))
        seq = TokenSequence()
        seq.append_context(_ids(prose.take(int(args.designer_prompt_tokens * c))))
        seq.append_generated(_ids(reply), [-0.5] * len(_ids(reply)), 0)
        token_count += len(seq)
        outcome = DesignerOutcome(env.skill, f"builtin:code:{e}", (), (), seq, reply, "stop", program=env.program)
        sample = DesignerSample(f"r1-s{e}", env.env_id, env.skill, 1, 0, seq.token_ids, seq.loss_mask,
                                seq.behaviour_logprobs, metadata={"slot": e})
        transcript.designer_output(outcome, sample, DesignerSlot(env.skill, sampling_seed=e))
    episodes = []
    for env in envs:
        prompt = prose.take(int(args.prompt_tokens * c))
        for k in range(args.plays):
            ep = AgentEpisode(env.env_id, env.skill, env.env_id, k >= args.plays // 2, seed=1, sampling_seed=k)
            ep.sequence.append_context(_ids(prompt))
            ep.observations.append(prompt)
            for _ in range(args.turns):
                start = len(ep.sequence)
                text = prose.take(int(args.reply_tokens * c))
                reply = _ids(text)
                ep.sequence.append_generated(reply, [-0.5] * len(reply), 0)
                ep.replies.append(text)
                ep.turn_spans.append((start, len(ep.sequence)))
                observation = prose.take(int(args.observation_tokens * c))
                ep.sequence.append_context(_ids(observation))
                ep.observations.append(observation)
                ep.actions.append("up")
                ep.finish_reasons.append("stop")
                ep.step_rewards.append(0.0)
            ep.terminated = True
            token_count += len(ep.sequence)
            episodes.append(ep)
    started = time.perf_counter()
    transcript.episodes(envs, episodes)
    built = time.perf_counter() - started

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = transcript.write(Path(tmp))
        written = time.perf_counter() - started
        assert path is not None
        size = path.stat().st_size
        with gzip.open(path, "rt", encoding="utf-8") as f:
            plain = sum(len(line.encode("utf-8")) for line in f)
    ids = 4 * token_count
    mean_tokens = token_count / (len(episodes) + len(envs)) / c
    print(f"rollout: {len(envs)} designer outputs, {len(episodes)} episodes of {args.turns} turns; "
          f"~{mean_tokens:,.0f} tokens per sequence at {c} chars/token; transcript_max_chars {args.max_chars}")
    print(f"transcript (gzip JSONL): {size / 2**20:8.2f} MiB; episodes decoded and clipped in {built:.2f} s, the "
          f"file written in {written:.2f} s")
    print(f"baseline: plain JSONL    {plain / 2**20:8.2f} MiB  -> gzip is x{plain / size:.1f} smaller")
    print(f"baseline: token ids      {ids / c / 2**20:8.2f} MiB (int32, {token_count / c:,.0f} tokens) -> transcript "
          f"is x{size / (ids / c):.2f} of it")
    print(json.dumps({"transcript_bytes": size, "plain_bytes": plain, "token_id_bytes": int(ids / c),
                      "episodes": len(episodes), "designer_outputs": len(envs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
