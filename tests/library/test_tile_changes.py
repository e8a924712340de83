"""Every tile of the forward+JVP kernel, launched one after another in one process, as the
autotuner launches them on the first call at a new shape.

On the H200 (Triton 3.6.0) this faults at head dims whose second column tile is only partly
used (40 = 32 + 8 of 16, 72 = 64 + 8 of 16): "an illegal memory access", reported by
compute-sanitizer as an out-of-range shared-memory address in the probability product, once a
second tile runs after another (each tile alone does not fault; see docs/limitations.md,
"Known issue"). A fault poisons the process's CUDA context, so each case runs in a
subprocess. The two failing cases are strict xfails: when the fault is fixed they fail, and
the marks must go.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

# Runs in a fresh process: each tile of the forward+JVP kernel in turn (the autotuner forced
# onto it), each checked by test_forward's accuracy contract against the float64 reference.
SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {library!r}]
import torch
from helpers import Spec
from test_forward import check_forward
import jvp_attention.forward as forward

tuner = forward._attention_forward_jvp
for config in list(tuner.configs):
    tuner.configs, tuner.tuned, tuner.cache = [config], {{}}, {{}}
    check_forward(Spec(batch=1, hq=2, hkv=2, nq=33, nk=33, d={d}), getattr(torch, {dtype!r}),
                  device="cuda", with_plain=False)
    torch.cuda.synchronize()
    print("ok", config, flush=True)
"""

KNOWN_FAULT = pytest.mark.xfail(strict=True, reason="Known issue on the H200: a fault once "
                                "the tile changes at a partly used second column tile "
                                "(docs/limitations.md)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, d", [
    ("float16", 48), ("bfloat16", 64), ("bfloat16", 80),
    pytest.param("float16", 40, marks=KNOWN_FAULT),
    pytest.param("bfloat16", 72, marks=KNOWN_FAULT),
], ids=lambda value: str(value))
def test_every_forward_jvp_tile_in_one_process(dtype: str, d: int) -> None:
    script = SCRIPT.format(tests=str(TESTS), library=str(TESTS / "library"), d=d, dtype=dtype)
    env = {**os.environ, "JVP_ATTENTION_AUTOTUNE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=600, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.count("ok ") == len(_tiles()), result.stdout


def _tiles() -> list:
    import jvp_attention.forward as forward

    return forward._attention_forward_jvp.configs

