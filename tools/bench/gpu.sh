#!/usr/bin/env bash
# The GPU checks in one call, for a CUDA machine that has PyTorch and Triton but no package registry (the device
# machine): the kernel tests compiled on the GPU, the sm_90 compile report of the Triton found there, and
# `python -m tools.bench kernels`. Results go under $OUT (default ./gpu-out): env.txt, tests.txt, aot.jsonl,
# kernels.md. Each stage has its own time limit; a failing stage is reported and the next one still runs.
#
#   here:    make device-wheels        # liger-kernel into .whl/ for the bench's Liger baseline (optional)
#   there:   bash tools/bench/gpu.sh   # carry .whl; about 5 minutes on an H200
#
# Nothing is installed into the machine's Python: the package is laid out in a scratch tree (kernels/ copied to
# spade_mega/kernels, as setup.py maps it), carried wheels are unpacked beside it, and everything runs from there
# with the machine's own torch and triton.
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/gpu-out}
py=${PYTHON:-python3}
tree=${SPADE_GPU_TREE:-/tmp/spade-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

stage() {  # stage NAME SECONDS FILE COMMAND...: run, keep its output in $out/FILE, remember a failure
  local name=$1 limit=$2 file=$3
  shift 3
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

stage "kernel tests, compiled on the GPU" 240 tests.txt \
  "$py" -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py tests/test_kernel_tis_logprob.py \
  tests/test_kernel_grpo_advantage.py tests/test_kernel_grpo_switch.py tests/test_kernel_aot.py
stage "sm_90 compile report (this machine's triton)" 120 aot.jsonl "$py" -m spade_mega.kernels.aot
stage "kernels benchmark" 420 kernels.md "$py" -m tools.bench kernels "$@"
echo "== done: results in $out (exit $status)"
exit $status
