"""The ptxas the library compiles its kernels with (`sound_ptxas`, `sound_compiler`): Triton
3.6 bundles ptxas 12.8 for Hopper, which miscompiles the forward with the tangent at head
dims 40 and 72 on the H200 (tests/library/test_tile_changes.py checks the kernels there);
its newer Blackwell ptxas (12.9) is used instead, for this library's kernels only."""

import json
import os
import subprocess
import sys

import pytest
import triton

from jvp_attention import launch

# Compiles a one-line kernel for sm_90 without a GPU, outside, inside and again outside
# `sound_compiler`: the PTX version Triton writes follows the ptxas it compiles with.
SCRIPT = '''
import json, os, re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from jvp_attention.launch import sound_compiler

@triton.jit
def copy(x_ptr, y_ptr):
    tl.store(y_ptr, tl.load(x_ptr))

def compiled_with():
    source = ASTSource(copy, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return {"ptx": re.search(r"\\.version (\\S+)", ptx).group(1),
            "ptxas": get_ptxas(90).version,
            "env": os.environ.get("TRITON_PTXAS_PATH")}

before = compiled_with()
with sound_compiler(90):
    inside = compiled_with()
print(json.dumps([before, inside, compiled_with()]))
'''


def triton_ptxas_version() -> str:
    """The version of the ptxas Triton assembles Hopper code with."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).version


def test_sound_ptxas_replaces_the_miscompiling_hopper_ptxas(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    choose = launch.sound_ptxas.__wrapped__
    if triton_ptxas_version() in launch.MISCOMPILING_PTXAS:
        assert choose(90) == triton.knobs.nvidia.ptxas_blackwell.path
    else:
        assert choose(90) is None
    assert choose(80) is None and choose(100) is None  # Ampere; Blackwell has its own


def test_sound_ptxas_keeps_a_ptxas_the_user_chose(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_PTXAS_PATH", triton.knobs.nvidia.ptxas_blackwell.path)
    assert launch.sound_ptxas.__wrapped__(90) is None


def test_sound_ptxas_keeps_triton_s_choice_when_a_ptxas_cannot_be_run(monkeypatch) -> None:
    """A ptxas that exists but cannot be run (Triton asks it for its version) is no reason
    to fail: Triton's choice stands."""
    from triton.backends.nvidia import compiler

    def unrunnable(arch):
        raise PermissionError(13, "Permission denied", "ptxas")

    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.setattr(compiler, "get_ptxas", unrunnable)
    assert launch.sound_ptxas.__wrapped__(90) is None


def test_the_pinned_triton_bundles_the_miscompiling_ptxas() -> None:
    """The case the workaround is for is the one CI runs (Triton 3.6.0)."""
    if triton.__version__ != "3.6.0":
        pytest.skip(f"Triton {triton.__version__}, not the pinned 3.6.0")
    assert triton_ptxas_version() == "12.8"
    assert launch.version_tuple(triton.knobs.nvidia.ptxas_blackwell.version) >= (12, 9)


def test_sound_compiler_compiles_with_the_newer_ptxas_and_restores_triton(tmp_path) -> None:
    script = tmp_path / "compile_copy.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_PTXAS_PATH", None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    before, inside, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert before == after and before["env"] is None
    if before["ptxas"] not in launch.MISCOMPILING_PTXAS:
        assert inside == before
        return
    newer = triton.knobs.nvidia.ptxas_blackwell.version
    assert inside["ptxas"] == newer and inside["env"] is not None
    assert launch.version_tuple(inside["ptx"]) > launch.version_tuple(before["ptx"])
