"""Every tile of the forward+JVP kernel, launched one after another in one process, as the
autotuner launches them on the first call at a new shape.

On the H200 with the ptxas that Triton 3.6 bundles for Hopper (12.8) this faulted at head
dims whose second column tile is only partly used (40 = 32 + 8 of 16, 72 = 64 + 8 of 16):
"an illegal memory access", an out-of-range shared-memory address in the probability
product by compute-sanitizer, once a second tile ran after another. With one pipeline stage
the same kernels returned wrong tangents instead. The library now compiles its kernels with
a ptxas that does not miscompile them (`jvp_attention.launch.sound_ptxas`); these cases
check that, each tile against the float64 reference. A fault poisons the process's CUDA
context, so each case runs in a subprocess.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

# Runs in a fresh process: each tile of the forward+JVP kernel in turn (the autotuner forced
# onto it), each checked by test_forward's accuracy contract against the float64 reference.
SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {library!r}]
import torch
import triton
from helpers import Spec
from test_forward import check_forward
import jvp_attention.forward as forward

tuner = forward._attention_forward_jvp
for config in list(tuner.configs):
    if {stages}:
        config = triton.Config(dict(config.kwargs), num_warps=config.num_warps,
                               num_stages={stages})
    # a new tile list: forget the tuned tiles and the launches remembered with them
    tuner.configs, tuner.tuned, tuner.cache, tuner.launches = [config], {{}}, {{}}, {{}}
    check_forward(Spec(batch=1, hq=2, hkv=2, nq=33, nk=33, d={d}), getattr(torch, {dtype!r}),
                  device="cuda", with_plain=False)
    torch.cuda.synchronize()
    print("ok", config, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, d, stages", [
    ("float16", 48, 0), ("bfloat16", 64, 0), ("bfloat16", 80, 0),
    ("float16", 40, 0), ("bfloat16", 72, 0), ("float16", 40, 1), ("bfloat16", 72, 1),
], ids=lambda value: str(value))
def test_every_forward_jvp_tile_in_one_process(dtype: str, d: int, stages: int) -> None:
    """Each tile as listed (stages 0) or with one pipeline stage (stages 1), compiled with
    the ptxas the library picks."""
    script = SCRIPT.format(tests=str(TESTS), library=str(TESTS / "library"), d=d, dtype=dtype,
                           stages=stages)
    with tempfile.TemporaryDirectory() as cache:  # nothing compiled before is reused
        env = {**os.environ, "JVP_ATTENTION_AUTOTUNE": "1", "TRITON_CACHE_DIR": cache}
        env.pop("TRITON_PTXAS_PATH", None)  # the library's choice of ptxas
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.count("ok ") == len(_tiles()), result.stdout


def _tiles() -> list:
    import jvp_attention.forward as forward

    return forward._attention_forward_jvp.configs

