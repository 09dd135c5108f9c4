#!/usr/bin/env bash
# The GPU checks in one call, for a CUDA machine that has PyTorch and Triton but no package registry (the device
# machine). Stages, in order (STAGES="tests trainer aot kernels train_step" by default; name fewer to run fewer):
#   tests       the kernel tests, compiled on the GPU                              -> tests.txt   (limit 240 s)
#   trainer     a one-process Megatron trainer on the GPU (log-probs, a step on the distributed optimizer, a save),
#               every collective checked against its group's backends (tests/test_nccl_devices.py less its 2-rank
#               CPU test, which CI runs; megatron-core)                            -> trainer.txt (limit 120 s)
#   aot         the sm_90 compile report of the Triton found there                 -> aot.jsonl   (limit 120 s)
#   kernels     python -m tools.bench kernels [ARGS...]                            -> kernels.md  (limit 420 s)
#   train_step  python -m tools.bench train_step: GRPO step and MFU (megatron-core) -> train_step.md (limit 300 s)
# Results go under $OUT (default ./gpu-out), with env.txt. A failing stage is reported; the next one still runs.
# BUDGET_S (default 540) bounds the whole call, so it ends inside the device tool's 600 s: each stage gets the
# smaller of its own limit and what is left, and a stage with under 30 s left is skipped and said to be.
#
#   here:    make device-wheels        # liger-kernel (Liger baseline) and megatron-core (train_step) into .whl/
#   there:   bash tools/bench/gpu.sh   # carry .whl
#
# Nothing is installed into the machine's Python: the package is laid out in a scratch tree (kernels/ copied to
# spade_mega/kernels, as setup.py maps it), carried wheels are unpacked beside it, and everything runs from there
# with the machine's own torch and triton.
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/gpu-out}
py=${PYTHON:-python3}
tree=${SPADE_GPU_TREE:-/tmp/spade-gpu}
stages=" ${STAGES:-tests trainer aot kernels train_step} "
deadline=$((SECONDS + ${BUDGET_S:-540}))
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

stage() {  # stage KEY SECONDS FILE COMMAND...: run when KEY is in $stages, keep its output in $out/FILE
  local name=$1 limit=$2 file=$3
  shift 3
  [[ $stages == *" $name "* ]] || return 0
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name skipped: ${left}s of BUDGET_S left"; status=1; return 0; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (limit ${limit}s) -> $file"
  timeout "$limit" "$@" 2>&1 | tee "$out/$file"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== $name failed with exit code $rc"; status=1; }
}

rm -rf "$tree" && mkdir -p "$tree/_deps"
cp -rL "$repo/spade_mega" "$repo/tools" "$repo/tests" "$repo/examples" "$repo/pyproject.toml" "$tree/"
rm -rf "$tree/spade_mega/kernels" && cp -r "$repo/kernels" "$tree/spade_mega/kernels"
if compgen -G "$repo/.whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tree/_deps" "$repo"/.whl/*.whl \
    || { echo "== carried wheels did not install"; status=1; }
fi
export PYTHONPATH="$tree/_deps"
cd "$tree" || exit 1

{ date -u; nvidia-smi; "$py" -c 'import sys, torch, triton
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
try:
    import liger_kernel, importlib.metadata as md
    print("liger-kernel", md.version("liger-kernel"))
except ImportError:
    print("liger-kernel not installed: the bench leaves out its Liger column")'; } 2>&1 | tee "$out/env.txt"

stage tests 240 tests.txt \
  "$py" -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py tests/test_kernel_tis_logprob.py \
  tests/test_kernel_grpo_advantage.py tests/test_kernel_grpo_switch.py tests/test_kernel_aot.py
megatron=$("$py" -c "import megatron.core" 2>/dev/null && echo yes)
if [ -n "$megatron" ]; then
  stage trainer 120 trainer.txt "$py" -m pytest -q -p no:cacheprovider -rs -m "not multiproc" tests/test_nccl_devices.py
fi
stage aot 120 aot.jsonl "$py" -m spade_mega.kernels.aot
stage kernels 420 kernels.md "$py" -m tools.bench kernels "$@"
if [ -n "$megatron" ]; then
  stage train_step 300 train_step.md "$py" -m tools.bench train_step --layouts tp1 --steps 3
fi
for name in trainer train_step; do
  if [ -z "$megatron" ] && [[ $stages == *" $name "* ]]; then
    echo "== $name not run: megatron-core does not import here (make device-wheels, then carry .whl)"
    status=1
  fi
done
echo "== done: results in $out (exit $status)"
exit $status
