"""spade-mega without Triton (macOS, clusters without it): with kernels.enabled false the GRPO ops the trainer calls
(spade_mega.kernels.grpo, the switch point) import and run their plain-torch references; enabled, the first use of
either op says which package to install. Triton is hidden from a fresh process by a meta-path blocker (it stays
installed for the rest of the suite), so an op module that imports it unguarded fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_TRITON = """
import importlib.abc, json, sys

class HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTriton())
try:
    import triton
    sys.exit("triton is still importable")
except ModuleNotFoundError:
    pass

import torch
from spade_mega.config.schema import KernelsConfig, RLConfig
from spade_mega.errors import SpadeError
from spade_mega.kernels import grpo
import spade_mega.megatron.objective, spade_mega.selfplay.batch  # the trainer's callers of the switch

off, on = KernelsConfig(enabled=False), KernelsConfig(enabled=True)
torch.manual_seed(0)
logits = torch.randn(2, 6, 17, requires_grad=True)
tokens = torch.randint(0, 17, (2, 6))
mask = torch.rand(2, 6) > 0.3
logprobs, entropy = grpo.token_logprobs(logits, tokens, off, temperature=0.7, loss_mask=mask, with_entropy=True)
(logprobs.sum() + entropy.sum()).backward()
expected = torch.log_softmax(logits.detach() / 0.7, dim=-1).gather(-1, tokens[..., None])[..., 0]
rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0])
groups = torch.tensor([0, 0, 1, 1, 2, 2])
roles = torch.tensor([0, 0, 0, 0, 1, 1])  # two agent groups, one designer skill
advantages = grpo.sample_advantages(rewards, groups, roles, groups, 2.0, RLConfig(), off).samples
enabled_errors = []
for use in (lambda: grpo.token_logprobs(logits, tokens, on, temperature=0.7),
            lambda: grpo.sample_advantages(rewards, groups, roles, groups, 2.0, RLConfig(), on)):
    try:
        use()
        enabled_errors.append(None)
    except SpadeError as exc:
        enabled_errors.append(str(exc))
print(json.dumps({
    "logprobs_match": bool(torch.allclose(torch.where(mask, expected, 0.0), logprobs, atol=1e-5)),
    "grad": bool(logits.grad is not None and logits.grad.abs().sum() > 0),
    "advantages": [round(a, 4) for a in advantages.tolist()],
    "enabled_errors": enabled_errors,
    "triton_modules": sorted(m for m in sys.modules if m.split(".")[0] == "triton"),
}))
"""


def test_disabled_kernels_run_without_triton_and_enabled_ones_name_the_package() -> None:
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["logprobs_match"] and out["grad"]
    assert out["advantages"] == [0.7071, -0.7071, 0.0, 0.0, 1.0, -1.0]  # (r - mean) / std; designer: centred x 2
    assert out["triton_modules"] == []
    assert len(out["enabled_errors"]) == 2  # the log-prob op, then the advantage op
    for error in out["enabled_errors"]:
        assert error is not None and "kernels.enabled is true but Triton is not installed" in error and \
            "pip install triton" in error and "kernels.enabled: false" in error
