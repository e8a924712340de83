#!/bin/bash
# One device call that validates the library on an H200 machine (one or two GPUs) and brings
# the evidence back through $OUT (at most eight files):
#   gpu_tests.log   the GPU-marked tests (tests at N = 1000 .. 16384, every transform, cuda:1)
#   accuracy.json   tools/gpu_probe.py accuracy ratios (ours / PyTorch math, both vs float64)
#   ddp.tar.gz      the 1-rank vs 2-rank MeanFlow check (two GPUs only)
#   executed.tar.gz executed notebooks for the docs (outputs from this GPU) and the
#                   files notebook 09 writes under examples/results/
# Usage (repository root, .whl carried; see docs/install.md):
#   NOTEBOOKS_TIMED="notebooks/09_*.py ..." NOTEBOOKS_UNTIMED="..." bash tools/gpu_validate.sh
# Notebooks that time things run on the last GPU, alone; the rest share GPU 0 with the tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# One tile per kernel: the tests check numbers, and autotuning every test's key would spend
# most of the call compiling configurations.
export JVP_ATTENTION_AUTOTUNE=${JVP_ATTENTION_AUTOTUNE:-0}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
LAST=$((NGPU - 1))
BUDGET=${BUDGET:-540}
START=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpus.txt"
mkdir -p /tmp/executed /tmp/ddp

run_notebooks() {  # GPU, log name, notebooks...
  local gpu=$1 log=$2
  shift 2
  [ $# -eq 0 ] && return 0
  CUDA_VISIBLE_DEVICES=$gpu timeout $((BUDGET - 20)) python3 tools/execute_notebooks.py \
    /tmp/executed "$@" >"/tmp/executed/$log" 2>&1
}
# shellcheck disable=SC2086
run_notebooks "$LAST" timed.log ${NOTEBOOKS_TIMED:-} &
TIMED=$!

set -o pipefail
# shellcheck disable=SC2086
timeout $((BUDGET / 2)) python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider -o addopts="" \
  tests/test_forward.py tests/test_backward.py tests/test_second_order.py tests/test_api.py \
  2>&1 | tee "$OUT/gpu_tests.log"
echo "tests took $((SECONDS - START)) s" | tee -a "$OUT/gpu_tests.log"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 tools/gpu_probe.py --skip-timing \
  --out "$OUT/accuracy.json" 2>&1 | tail -n 20
# shellcheck disable=SC2086
run_notebooks 0 untimed.log ${NOTEBOOKS_UNTIMED:-} &
UNTIMED=$!
if [ "$NGPU" -ge 2 ]; then
  for dtype in bfloat16 float32; do
    timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
      examples/meanflow_dit.py --ddp --steps 30 --batch-size 64 --dtype $dtype \
      --out /tmp/ddp/ddp_h200x2_$dtype.json >>/tmp/ddp/ddp_h200x2.log 2>&1
    echo "ddp $dtype rc=$?" | tee -a /tmp/ddp/ddp_h200x2.log
  done
  tar -C /tmp -czf "$OUT/ddp.tar.gz" ddp
fi
wait $TIMED $UNTIMED
python3 - <<'EOF'
import datetime, json, os, pathlib, torch, triton
run = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__,
       "autotune": os.environ.get("JVP_ATTENTION_AUTOTUNE", "1") != "0",
       "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
for path in pathlib.Path("/tmp/executed").glob("*.ipynb"):
    notebook = json.loads(path.read_text())
    notebook["metadata"]["jvp_attention"].update(run)
    path.write_text(json.dumps(notebook, indent=1) + "\n")
EOF
tail -n 5 /tmp/executed/*.log
mkdir -p examples/results && cp -r examples/results /tmp/executed/examples_results
tar -C /tmp -czf "$OUT/executed.tar.gz" executed
echo "call took $((SECONDS - START)) s"
