#!/bin/bash
# One device call that validates and measures the library on an H200 machine (one or two
# GPUs) and brings the evidence back through $OUT (the device tool returns at most 8 files):
#   gpu_tests.log    the GPU-marked tests (N = 1000 .. 16384, every transform, cuda:1)  TESTS=1
#   accuracy.json    tools/gpu_probe.py accuracy ratios (ours / PyTorch math vs float64) TESTS=1
#   bench.json/.log  benchmarks/bench.py $BENCH_ARGS, alone on GPU 0, autotuning on  BENCH_ARGS
#   ddp.tar.gz       the 1-rank vs 2-rank MeanFlow check (two GPUs)                   DDP=1
#   executed.tar.gz  executed notebooks for the docs, the files notebook 09 writes under
#                    examples/results/ and the plots notebook 08 writes (docs/assets/benchmarks)
# Notebooks: NOTEBOOKS_TIMED run alone on the last GPU after the tests; NOTEBOOKS_UNTIMED
# after them, with one tile per kernel (JVP_ATTENTION_AUTOTUNE=0); NOTEBOOKS_AFTER_BENCH on GPU 0 once the benchmark has written its results.
# Usage (repository root, .whl carried; docs/install.md has the details):
#   TESTS=1 DDP=1 BENCH_ARGS="--max-seconds 420" NOTEBOOKS_TIMED="notebooks/09_*.py" \
#     NOTEBOOKS_AFTER_BENCH=notebooks/08_benchmarks.py bash tools/gpu_validate.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
LAST=$((NGPU - 1))
BUDGET=${BUDGET:-540}
START=$SECONDS
STAMP=$(date -u +%F)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpus.txt"
mkdir -p /tmp/executed /tmp/ddp

run_notebooks() {  # GPU, log name, notebooks...
  local gpu=$1 log=$2
  shift 2
  [ $# -eq 0 ] && return 0
  CUDA_VISIBLE_DEVICES=$gpu timeout $((BUDGET - (SECONDS - START) - 15)) \
    python3 tools/execute_notebooks.py /tmp/executed "$@" >>"/tmp/executed/$log" 2>&1
}

bench_then_notebooks() {  # the benchmark times kernels: it has GPU 0 to itself
  local result=benchmarks/results/h200_$STAMP.json
  if [ -z "${BENCH_ARGS:-}" ]; then  # only the notebooks, on the saved results
    # shellcheck disable=SC2086
    run_notebooks 0 after_bench.log ${NOTEBOOKS_AFTER_BENCH:-}
    return
  fi
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout $((BUDGET - 60)) python3 benchmarks/bench.py $BENCH_ARGS \
    --out "$result" >"$OUT/bench.log" 2>&1
  echo "bench rc=$? after $((SECONDS - START)) s" >>"$OUT/bench.log"
  cp "$result" "$OUT/bench.json"
  # shellcheck disable=SC2086
  run_notebooks 0 after_bench.log ${NOTEBOOKS_AFTER_BENCH:-}
}

# Tests and accuracy check numbers, not speed: one tile per kernel (autotuning every test's
# key would spend most of the call compiling). The benchmark and the notebooks autotune.
validate() {
  set -o pipefail
  # The last GPU is cuda:0 for the tests, so they leave GPU 0 to the benchmark (only the
  # cuda:1 placement test touches it, briefly).
  CUDA_VISIBLE_DEVICES=$(seq -s, "$LAST" -1 0) JVP_ATTENTION_AUTOTUNE=0 timeout 240 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider \
    tests/test_forward.py tests/test_backward.py tests/test_second_order.py tests/test_api.py tests/test_tma.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  echo "tests done after $((SECONDS - START)) s" | tee -a "$OUT/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=$LAST JVP_ATTENTION_AUTOTUNE=0 timeout 120 python3 tools/gpu_probe.py \
    --skip-timing --out "$OUT/accuracy.json" 2>&1 | tail -n 20
}

[ -n "${BENCH_ARGS:-}${NOTEBOOKS_AFTER_BENCH:-}" ] && { bench_then_notebooks & }
[ "${TESTS:-0}" = 1 ] && validate
# shellcheck disable=SC2086
run_notebooks "$LAST" timed.log ${NOTEBOOKS_TIMED:-}
# Notebooks that only check numbers need no autotuning either.
# shellcheck disable=SC2086
JVP_ATTENTION_AUTOTUNE=0 run_notebooks "$LAST" untimed.log ${NOTEBOOKS_UNTIMED:-}
if [ "${DDP:-0}" = 1 ] && [ "$NGPU" -ge 2 ]; then
  for dtype in bfloat16 float32; do
    timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
      examples/meanflow_dit.py --ddp --steps 30 --batch-size 64 --dtype $dtype \
      --out /tmp/ddp/ddp_h200x2_$dtype.json >>/tmp/ddp/ddp_h200x2.log 2>&1
    echo "ddp $dtype rc=$?" | tee -a /tmp/ddp/ddp_h200x2.log
  done
  tar -C /tmp -czf "$OUT/ddp.tar.gz" ddp
fi
wait
python3 - <<'EOF'
import datetime, json, pathlib, torch, triton
run = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__,
       "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
for path in pathlib.Path("/tmp/executed").glob("*.ipynb"):
    notebook = json.loads(path.read_text())
    notebook["metadata"]["jvp_attention"].update(run)
    path.write_text(json.dumps(notebook, indent=1) + "\n")
EOF
tail -n 5 /tmp/executed/*.log 2>/dev/null
mkdir -p examples/results docs/assets/benchmarks
cp -r examples/results /tmp/executed/examples_results
cp -r docs/assets/benchmarks /tmp/executed/benchmark_plots
tar -C /tmp -czf "$OUT/executed.tar.gz" executed
echo "call took $((SECONDS - START)) s"
