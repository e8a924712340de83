"""benchmarks/warp_specialized_jvp.py, the experiment that carries the tangent into chapter
11's schedule: its candidate for d = 128 compiles for sm_90 within the budget the design
counts on (no spill at 240 registers a compute thread, within a block's shared memory).
Triton in GPU mode, not the interpreter the CPU tests run under: hence the subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_jvp_candidate_compiles_for_hopper_without_spills() -> None:
    code = (f"import sys, json; sys.path.insert(0, {str(BENCHMARKS)!r}); "
            f"from warp_specialized_jvp import compile_for_hopper; "
            f"print(json.dumps(compile_for_hopper('d128_n64_s2', causal=True)))")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["spills"] == 0
    assert report["shared"] <= 232448
    assert {("inc", "240"), ("dec", "24")} <= {tuple(b) for b in report["setmaxnreg"]}
