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


def printed_by_tool(expression: str) -> str:
    """The last line that printing `expression` writes, with tools/kernel_resources.py
    imported as `kr` in a subprocess (it imports Triton in GPU mode)."""
    code = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import kernel_resources as kr; "
            f"import torch; print({expression})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_global_load_widths_counts_loads_and_copies_by_bytes() -> None:
    assert printed_by_tool(f"kr.global_load_widths({PTX!r})") == "{16: 2, 8: 1, 4: 1, 2: 2}"


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


WGMMA_PTX = """
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 1;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd3, %rd4, p, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.wait_group.sync.aligned 0;
    wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%r2}, %rd5, %rd6, p, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    wgmma.wait_group.sync.aligned 1;
    wgmma.wait_group.sync.aligned 0;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r3}, {%r4}, {%f1};
"""


def test_wgmma_report_counts_shapes_groups_and_full_waits() -> None:
    """Instructions by shape, committed groups, only the waits for every group (0), and
    Ampere's mma.sync."""
    assert printed_by_tool(f"sorted(kr.wgmma_report({WGMMA_PTX!r}).items())") == (
        "[('mma_sync', 1), ('wgmma', {'m64n16k16': 1, 'm64n64k16': 2}), ('wgmma_groups', 2), "
        "('wgmma_waits', 2)]")


def test_long_calls_record_the_carried_launch() -> None:
    """At 1024 tokens a bf16 "accurate" call carries: the copies are not launched (nor
    compiled), and the attention kernel it records has CARRY on; at 256 it splits."""
    assert printed_by_tool(
        "[(n, b['CARRY'], b['SPLIT']) for t in (256, 1024) for n, _, _, b in "
        "kr.launches_for(torch.bfloat16, 72, False, 'none', tokens=t) "
        "if n == '_attention_forward_jvp']") == (
        "[('_attention_forward_jvp', False, True), ('_attention_forward_jvp', True, False)]")


def test_key_layout_overrides_the_key_sides_accumulators_only() -> None:
    """--key-layout: the second order's key-side passes, whose tiles carry their layout
    (chapter 5's `laid_out`), compile in each tile's own ("library") or in the one asked
    for; the dQ kernel has none."""
    layouts = printed_by_tool(
        "sorted({(n, layout, kr.in_key_layout(f, b, c, layout)[0].get('TRANSPOSED')) "
        "for layout in ('library', 'transposed') for n, f, configs, b in "
        "kr.launches_for(torch.float16, 64, False, 'none', tokens=64) if 'tangent' in n "
        "for c in configs}, key=str)")
    assert layouts == str([
        ("_backward_dk_tangent", "library", False), ("_backward_dk_tangent", "library", True),
        ("_backward_dk_tangent", "transposed", True),
        ("_backward_dq_tangent", "library", None), ("_backward_dq_tangent", "transposed", None),
        ("_backward_dv_tangent", "library", False), ("_backward_dv_tangent", "library", True),
        ("_backward_dv_tangent", "transposed", True)])


def test_unfenced_wgmma_needs_shared_stores_wgmma_and_no_proxy_fence() -> None:
    """`unfenced_wgmma`: wgmma after generic-proxy stores to shared memory (st.shared or
    stmatrix) with no fence.proxy.async in the code."""
    wgmma = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2;\n"
    store = "st.shared.v4.b32 [%r2], {%r3, %r4, %r5, %r6};\n"
    fence = "fence.proxy.async.shared::cta;\n"
    cases = {"store + wgmma": store + wgmma, "stmatrix + wgmma": "stmatrix.sync.aligned.x4"
             ".m8n8.shared.b16 [%r1], {%r2, %r3, %r4, %r5};\n" + wgmma,
             "fenced": store + fence + wgmma, "no wgmma": store, "no store": wgmma}
    assert printed_by_tool(f"{{k: kr.unfenced_wgmma(v) for k, v in {cases!r}.items()}}") == (
        "{'store + wgmma': True, 'stmatrix + wgmma': True, 'fenced': False, "
        "'no wgmma': False, 'no store': False}")


def test_no_tile_reads_unfenced_shared_memory() -> None:
    """Every tile of every kernel's list (forward, forward+JVP, first- and second-order
    backward), compiled for sm_90 at d = 128, 72 (two column tiles) and 64, fences the async
    proxy before wgmma reads what its threads stored (the pattern of the tile that returned
    varying gradients, chapter 6), so that a tile added to a list cannot bring it back."""
    result = subprocess.run(
        [sys.executable, str(TOOLS / "kernel_resources.py"), "--head-dim", "128", "72", "64"],
        capture_output=True, text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "regs=" in line]
    kernels = {row.split()[0] for row in rows}
    assert len(rows) > 100 and len(kernels) == 7, result.stdout[-2000:]
    assert not [row for row in rows if "UNFENCED WGMMA" in row]
