#!/usr/bin/env bash
# One device session's GPU measurements in a single command (a session is lent ~15 minutes of device time, one
# command at most 10): the parts of benchmarks/gpu/suite.py by priority, each with its own time budget and results file,
# so a part that runs long or fails leaves the others' results. Run on the GPU machine from the repository root with
# .whl/ carried (bash benchmarks/gpu/wheels.sh builds it here):
#
#   bash benchmarks/gpu/session.sh $OUT          # ~9 minutes on an H200; results and a log under $OUT
#
# Parts (each file $OUT/gpu-<part>.md): moe (Qwen3-30B-A3B-shaped, 4 layers: MFU on active parameters), kernels
# (every Triton kernel compiled and checked, timings vs eager and Liger, the fused linear CE), decoder (the ~1B decoder
# end to end with torch vs Triton kernels), attention-sft / -long / -gqa (packed SFT rows and a 32k-token row: dense
# mask vs flash varlen; GQA without repeated keys/values).
set -uo pipefail
OUT="${1:?usage: session.sh OUT_DIR}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/session.log"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/session.log"
run() {  # $1 = part name, $2 = hard limit (s), rest: gpu.py arguments (its own budget below the limit)
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 benchmarks/gpu/suite.py --out "$OUT/gpu-$name.md" "$@" >>"$OUT/session.log" 2>&1
  echo "part $name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/session.log"
}
run moe 140 --only moe --time-budget-s 120 --e2e-steps 8 --e2e-warmup 3 --run-timeout-s 120
run kernels 130 --only kernels --only flce --providers triton eager liger --time-budget-s 115
run decoder 110 --only e2e-decoder --time-budget-s 100 --e2e-steps 8 --e2e-warmup 3 --run-timeout-s 50
run attention-sft 80 --only attention-sft --time-budget-s 70
run attention-long 70 --only attention-long --time-budget-s 60
run attention-gqa 25 --only attention-gqa --time-budget-s 20
