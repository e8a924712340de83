"""tools/kernel_resources.py's reading of PTX: the bytes each global load moves. (Compiling
the kernels takes minutes, so that part runs by hand; the tool imports Triton in GPU mode,
hence the subprocess.)"""

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
