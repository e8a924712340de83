"""tools/kernel_resources.py: its reading of PTX (the bytes each global load moves), and that
every kernel compiles for sm_90 with its float arguments typed fp64, as Inductor launches a
user's kernel. (Compiling every tile takes minutes, so that runs by hand; the tool imports
Triton in GPU mode, hence the subprocesses.)"""

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"

PTX = """
    ld.global.b16 { %rs1 }, [ %rd1 + 0 ];
    ld.global.b16 { %rs2 }, [ %rd2 + 0 ];
    ld.global.L1::evict_last.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];
    ld.global.v2.b32 { %r5, %r6 }, [ %rd4 + 0 ];
    cp.async.cg.shared.global [ %r7 + 0 ], [ %rd5 + 0 ], 0x10, %r8;
    cp.async.ca.shared.global [ %r9 + 0 ], [ %rd6 + 0 ], 4, %r10;
    st.global.v4.b32 [ %rd7 + 0 ], { %r1, %r2, %r3, %r4 };
"""


def test_global_load_widths_counts_loads_and_copies_by_bytes() -> None:
    code = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import kernel_resources as kr; "
            f"print(kr.global_load_widths({PTX!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "{16: 2, 8: 1, 4: 1, 2: 2}"


def test_every_kernel_compiles_with_fp64_float_arguments() -> None:
    """Inductor (`torch.library.triton_op`) passes a Python float as fp64 where Triton's launch
    passes fp32; the kernels take theirs through `in_fp32`, or fp64 would reach the
    accumulators and fail to compile. One tile per kernel, d = 72 (two column tiles, paired)."""
    result = subprocess.run(
        [sys.executable, str(TOOLS / "kernel_resources.py"), "--first-only", "--head-dim", "72",
         "--float-args", "fp64"], capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = {line.split()[0] for line in result.stdout.splitlines() if "regs=" in line}
    assert kernels == {"_attention_forward", "_attention_forward_jvp", "_backward_dq",
                       "_backward_dkdv", "_backward_dq_tangent", "_backward_dv_tangent",
                       "_backward_dk_tangent"}
