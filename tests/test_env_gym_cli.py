"""The gymnasium adapter under gymnasium's own checker, and the ``spade-mega env`` commands as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from spade_mega.envs.gym import ENV_ID, SandboxEnv
from spade_mega.envs.program import EnvProgram

from sandbox_support import GUESS_NUMBER, TEST_UID, strict_missing, strict_pool

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("spade-mega")
KNOWN_BAD = ROOT / "tests" / "data" / "known_bad"
STRICT_TEST_USER = ["-s", f"sandbox.uid={TEST_UID}", "-s", f"sandbox.gid={TEST_UID}"]


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def guess_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("programs") / "guess_number.py"
    path.write_text(GUESS_NUMBER)
    return path


@pytest.fixture(autouse=True)
def _needs_strict_isolation() -> None:
    if strict_missing():
        pytest.skip(f"strict sandbox isolation unavailable: {strict_missing()}")


def test_gymnasium_env_checker_accepts_a_sandboxed_program() -> None:
    with strict_pool(warm_workers=1) as pool:
        env = SandboxEnv(EnvProgram(GUESS_NUMBER, "binary search", "arithmetic"), pool=pool, render_mode="ansi")
        check_env(env, skip_render_check=False)
        observation, info = env.reset(seed=5)
        assert env.observation_space.contains(observation) and info == {"seed": 5}
        assert env.reset(seed=5)[0] == observation and env.render() == observation
        env.close()
        env.close()  # idempotent, as gymnasium expects


def test_gymnasium_env_checker_accepts_observations_in_any_script() -> None:
    # An observation is any str (the contract); one in Japanese, with an emoji or a carriage return failed
    # gymnasium's checker ('not within the observation space'), whose charset stopped below U+3000
    source = ("class Weather:\n    max_turns = 2\n    def reset(self, seed):\n"
              "        return '\u6c17\u6e29\u306f 21 \u5ea6 \\U0001f321\\r\\n'\n"
              "    def step(self, action):\n        return '\u2713 \\x1b[1mdone\\x1b[0m', 1.0, True, False, {}\n")
    with strict_pool(warm_workers=1) as pool:
        env = SandboxEnv(source, pool=pool)
        try:
            check_env(env, skip_render_check=True)
            observation, _ = env.reset(seed=0)
            assert observation == "\u6c17\u6e29\u306f 21 \u5ea6 \U0001f321\r\n"
            assert env.observation_space.contains(observation)
            assert env.observation_space.contains(env.step("x")[0])
            assert not env.observation_space.contains(b"bytes") and not env.observation_space.contains(7)
            assert env.observation_space.contains(env.observation_space.sample())
        finally:
            env.close()


def test_gymnasium_make_builds_one_with_its_own_pool_and_truncates_at_max_turns() -> None:
    source = "class Forever:\n    max_turns = 3\n    def reset(self, seed):\n        return 'go'\n" \
             "    def step(self, action):\n        return 'again', 0.0, False, False, {}\n"
    env = gymnasium.make(ENV_ID, program=source, sandbox=None)
    try:
        env.reset(seed=0)
        flags = [env.step("x")[2:4] for _ in range(3)]
        assert flags == [(False, False), (False, False), (False, True)]
    finally:
        env.close()


def test_env_validate_reports_each_file_and_exits_1_on_any_rejection(guess_file: Path) -> None:
    proc = cli("env", "validate", str(guess_file), str(KNOWN_BAD / "syntax.py"), *STRICT_TEST_USER)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("ok") and "GuessNumber, max_turns 8" in lines[0]
    assert lines[1].startswith("rejected") and "syntax: line 6: expected ':'" in lines[1]
    assert lines[2] == "1 ok, 1 rejected (syntax 1)"
    proc = cli("env", "validate", "--json", str(guess_file), *STRICT_TEST_USER)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True


def test_env_validate_plays_as_far_as_the_rollout_and_says_so(guess_file: Path) -> None:
    proc = cli("env", "validate", str(guess_file), "-s", "rollout.max_turns=5", *STRICT_TEST_USER)
    assert proc.returncode == 0, proc.stderr
    assert "GuessNumber, max_turns 8 (the rollout plays 5)," in proc.stdout.splitlines()[0]


def test_env_validate_reads_a_file_saved_with_a_byte_order_mark(tmp_path: Path) -> None:
    # Editors on Windows save UTF-8 with a BOM, and python runs such a file; it was rejected as a syntax error
    path = tmp_path / "guess_bom.py"
    path.write_bytes(b"\xef\xbb\xbf" + GUESS_NUMBER.encode())
    proc = cli("env", "validate", str(path), *STRICT_TEST_USER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok") and "GuessNumber, max_turns 8" in proc.stdout


def test_env_validate_missing_file_is_one_clear_error() -> None:
    proc = cli("env", "validate", "nowhere.py")
    assert proc.returncode == 2 and proc.stderr.strip() == "spade-mega: error: nowhere.py: no such file"


def test_env_play_seed_out_of_range_is_one_clear_error(guess_file: Path) -> None:
    proc = cli("env", "play", str(guess_file), "--seed", str(2**64), *STRICT_TEST_USER, stdin="50\n")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"spade-mega: error: --seed must be in [-2**63, 2**64 - 1] (the sandbox's 64-bit seeds), got {2**64}")


def test_env_play_reads_actions_and_prints_observations_and_rewards(guess_file: Path) -> None:
    # seed 1 hides 18, so 50 is wrong; the second action is not a number.
    proc = cli("env", "play", str(guess_file), "--seed", "1", *STRICT_TEST_USER, stdin="50\nnot a number\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "[GuessNumber, max_turns 8, seed 1; one action per line, end of input quits]"
    assert out[1].startswith("I picked a number")
    assert out[2:4] == ["[reward +0.000]", "50 is wrong, go lower."]
    assert out[4:6] == ["[reward +0.000]", "Reply with one integer."]
    assert out[6] == "[stopped after 2 turns, return +0.000]"


def test_env_play_stops_where_training_stops_an_episode(tmp_path: Path) -> None:
    # A program that never ends its episodes: play truncates it at its max_turns, or earlier at the rollout's limit,
    # as the gymnasium adapter and the rollout do, instead of reading actions past every turn an agent would get.
    path = tmp_path / "forever.py"
    path.write_text("class Forever:\n    max_turns = 3\n    def reset(self, seed):\n        return 'go'\n"
                    "    def step(self, action):\n        return 'again', 0.5, False, False, {}\n")
    proc = cli("env", "play", str(path), *STRICT_TEST_USER, stdin="a\nb\nc\nd\ne\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[-1] == "[episode truncated after 3 turns (max_turns), return +1.500]" and out.count("again") == 3
    proc = cli("env", "play", str(path), "-s", "rollout.max_turns=2", *STRICT_TEST_USER, stdin="a\nb\nc\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "[Forever, max_turns 3 (the rollout plays 2), seed 0; one action per line, end of input quits]"
    assert out[-1] == "[episode truncated after 2 turns (rollout.max_turns), return +1.000]"


def test_env_play_shows_what_a_failing_program_printed_and_where_it_failed(tmp_path: Path) -> None:
    path = tmp_path / "boom.py"
    path.write_text("class Boom:\n    max_turns = 3\n    def reset(self, seed):\n        return 'go'\n"
                    "    def step(self, action):\n        print('debug: got', action)\n"
                    "        if action == 'b':\n            raise ValueError('kaboom')\n"
                    "        return 'fine', 0.0, False, False, {}\n")
    proc = cli("env", "play", str(path), *STRICT_TEST_USER, stdin="a\nb\n")
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[-1] == "| debug: got b"  # the program's own trace of the failing call
    assert proc.stderr.strip() == (f"spade-mega: error: {path}: the program failed at step 2 (action 'b'): "
                                   "ValueError: kaboom (line 8, in step)")


def test_env_play_ends_with_the_episode_and_shows_program_output(tmp_path: Path) -> None:
    path = tmp_path / "echo.py"
    path.write_text("class Echo:\n    max_turns = 1\n    def reset(self, seed):\n        return 'say it'\n"
                    "    def step(self, action):\n        print('debug:', action)\n"
                    "        return action.upper(), 1.0, True, False, {'len': len(action)}\n")
    proc = cli("env", "play", str(path), *STRICT_TEST_USER, stdin="hello\nignored\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2:] == ["| debug: hello", '[reward +1.000, info {"len": 5}]', "HELLO",
                                            "[episode terminated after 1 turns, return +1.000]"]


def test_env_play_sums_the_return_as_training_does(tmp_path: Path) -> None:
    # 1e308 + 1e308 - 1e308: a running float total passes through +inf and stays there; the episode's exact sum
    # (envs.episode.episode_return, what the rollout and its transcript record) is 1e308.
    path = tmp_path / "huge.py"
    path.write_text("class Huge:\n    max_turns = 3\n    def reset(self, seed):\n        self.t = 0\n"
                    "        return 'go'\n    def step(self, action):\n        self.t += 1\n"
                    "        return 'o', -1e308 if action == 'down' else 1e308, self.t == 3, False, {}\n")
    proc = cli("env", "play", str(path), *STRICT_TEST_USER, stdin="up\nup\ndown\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"[episode terminated after 3 turns, return {1e308:+.3f}]"
