#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
(
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 tools/gpu_probe.py --skip-accuracy --variants accurate,fast \
    --shapes "4,16,4096,128" --out $OUT/timing_d128.json > $OUT/timing.log 2>&1
) &
CUDA_VISIBLE_DEVICES=1,0 JVP_ATTENTION_AUTOTUNE=0 timeout 150 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider \
  tests/test_forward.py tests/test_backward.py tests/test_second_order.py tests/test_api.py tests/test_tma.py > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
CUDA_VISIBLE_DEVICES=1 JVP_ATTENTION_AUTOTUNE=0 timeout 60 python3 tools/gpu_probe.py --skip-timing --out $OUT/accuracy.json 2>&1 | tail -n 8
wait
cat $OUT/timing.log
