"""Compile every autotuning configuration of the library's kernels for Hopper (sm_90), on a
machine without a GPU, and report what each one needs: registers per thread, spilled bytes,
shared memory, how tiles reach shared memory (`copies`) and how many bytes each global load
moves (`loads`: 2-byte loads are tiles read one element at a time), and its tensor-core
products (`wgmma`: the Hopper warpgroup instructions by shape; `wgmma_groups`: how many
groups of them are committed together; `wgmma_waits`: how many times the kernel waits for
every group in flight to finish, `wgmma.wait_group 0`). A configuration over the 227 KiB of
shared memory a Hopper block may take cannot launch; one with spills is slow.

    python tools/kernel_resources.py [--dtype bfloat16] [--head-dim 128] [--json out.json]
    python tools/kernel_resources.py --kernels forward_jvp --head-dim 64 72 --tokens 1024
    python tools/kernel_resources.py --kernels _tangent --tokens 4096 --key-layout transposed
    JVP_ATTENTION_TMA=1 python tools/kernel_resources.py ...   # the descriptor (TMA) variants

benchmarks/results/kernel_resources_sm90.json (read by chapter 4) holds both runs for bf16,
d = 128, no mask: `python tools/kernel_resources.py --json a.json` with JVP_ATTENTION_TMA=0
and =1, concatenated (the kernels that never take descriptors once).
benchmarks/results/kernel_resources_sm90_triton3.9.json is the same with Triton 3.9.0 (each
row says which Triton compiled it).

How: each public launcher runs with CPU tensors while the autotuned kernels are replaced by
recorders that keep the launch's arguments; each configuration is then compiled with
`triton.compile` for `GPUTarget("cuda", 90, 128)` (ptxas ships with Triton). This is the
`-Xptxas -v` report of the CUDA world, for Triton kernels.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the GPU configurations, not the interpreter's one

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jvp_attention import backward, forward, launch  # noqa: E402
from jvp_attention.launch import sound_compiler  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 128)
SHARED_LIMIT = 232448  # bytes a block may take on sm_90 (227 KiB)


class Recorder:
    """Stands in for a triton.autotune object: records (kernel, configs, args) per launch."""

    def __init__(self, tuned, name: str, launches: list):
        self.tuned, self.name, self.launches = tuned, name, launches

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **kwargs):
        names = self.tuned.fn.arg_names
        bound = dict(zip(names, args, strict=False)) | kwargs
        prune = self.tuned.early_config_prune
        configs = prune(self.tuned.configs, bound, **bound) if prune else self.tuned.configs
        self.launches.append((self.name, self.tuned.fn, configs, bound))


def compile_report(kernel, bound: dict, config: triton.Config, float_type: str = "fp32") -> dict:
    """Compile one launch under one configuration for sm_90, specialised as a launch on a GPU
    would be (16-byte alignment of pointers and strides, ints equal to 1), since alignment
    decides vectorised and asynchronous copies and so the shared memory taken. The float
    arguments are typed `float_type`: fp32 as Triton's launch types them, fp64 as Inductor's
    launch of a user's kernel (`torch.library.triton_op`) does."""
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**{k: v for k, v in bound.items() if k in constexpr_names(kernel)},
              **config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
              "debug": False}
    args = [bound[name] for name in kernel.arg_names if name not in kwargs]
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    for name, value in bound.items():
        if isinstance(value, float) and signature.get(name) == "fp32":
            signature[name] = float_type
    with sound_compiler(HOPPER.arch):  # the ptxas the library compiles with on a GPU
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=HOPPER, options=options.__dict__)
        ptx = compiled.asm["ptx"]
        report = ptxas_report(ptx)
    return {**report, "shared": compiled.metadata.shared,
            "copies": copy_instructions(ptx), "load_bytes": global_load_widths(ptx),
            **wgmma_report(ptx), "unfenced_wgmma": unfenced_wgmma(ptx)}


def unfenced_wgmma(ptx: str) -> bool:
    """Whether the kernel multiplies on `wgmma` (which reads shared memory through the
    async proxy) after its threads store to shared memory (`st.shared`, `stmatrix`: the
    generic proxy) with no `fence.proxy.async` anywhere in its code. Hopper orders the two
    proxies only through that fence, so such a kernel may read stale operands: the tile
    of chapter 5's second-order key side that returned varying gradients had this pattern,
    and no other tile of the library's lists did (every kernel, d = 64 and 128)."""
    stores = re.search(r"\b(?:st\.shared|stmatrix)", ptx)
    return bool(stores and re.search(r"\bwgmma\.mma_async", ptx)
                and not re.search(r"\bfence\.proxy\.async", ptx))


def wgmma_report(ptx: str) -> dict:
    """The kernel's Hopper tensor-core instructions in its code (each copy of a loop body
    counts: a kernel whose key loop is split in two has two), by shape ("m64n64k16": count);
    the groups they are committed in, and the waits for all groups to finish; and its
    Ampere-style tensor-core instructions (`mma.sync`, which products of fewer than 64 rows
    a warpgroup fall back to). Triton waits for each product's group before its result is
    used unless the product accumulates across the loop's iterations, so a wait is a point
    where the tensor cores drain."""
    shapes = re.findall(r"wgmma\.mma_async\S*?\.(m\d+n\d+k\d+)\.", ptx)
    return {"wgmma": {shape: shapes.count(shape) for shape in sorted(set(shapes))},
            "wgmma_groups": len(re.findall(r"\bwgmma\.commit_group", ptx)),
            "wgmma_waits": len(re.findall(r"\bwgmma\.wait_group\S*\s+0\s*;", ptx)),
            "mma_sync": len(re.findall(r"\bmma\.sync\.", ptx))}


def copy_instructions(ptx: str) -> str:
    """How tiles reach shared memory: the bulk tensor copy engine (TMA), asynchronous copies
    (cp.async, Ampere's), or neither (plain loads through registers)."""
    kinds = [name for name, pattern in (("tma", "cp.async.bulk.tensor"), ("cp.async", "cp.async.ca"),
                                        ("cp.async", "cp.async.cg")) if pattern in ptx]
    return "+".join(dict.fromkeys(kinds)) or "ld.global"


def global_load_widths(ptx: str) -> dict[int, int]:
    """How many global loads and asynchronous copies move how many bytes each: {bytes:
    count}. Tiles whose rows Triton cannot prove 16-byte aligned (a row stride or head dim
    not a multiple of 16 elements, as Triton specialises integers) are read one element,
    2 bytes, at a time; aligned ones 16 bytes at a time."""
    sizes = []
    for op in re.findall(r"\bld\.global\S*", ptx):  # ld.global[.qualifiers][.vN].<type>
        parts = op.split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        sizes.append(vector * int(re.sub(r"\D", "", parts[-1])) // 8)
    copies = r"\bcp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(\w+)"
    sizes += [int(size, 0) for size in re.findall(copies, ptx)]
    return {size: sizes.count(size) for size in sorted(set(sizes), reverse=True)}


def ptxas_report(ptx: str) -> dict:
    """Registers and spills from `ptxas -v` on the kernel's PTX, assembled by the ptxas that
    Triton uses for sm_90 at the time of the call (within `sound_compiler`, the one the
    library's kernels compile with; TRITON_PTXAS_PATH overrides)."""
    ptxas = get_ptxas(HOPPER.arch).path
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(source),
                                 "-o", str(Path(folder) / "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    text = result.stderr + result.stdout
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"regs": int(registers.group(1)) if registers else None,
            "spills": int(spills.group(1)) if spills else None}


def constexpr_names(kernel) -> set:
    return {p.name for p in kernel.params if p.is_constexpr}


def launches_for(dtype: torch.dtype, head_dim: int, causal: bool, mask: str,
                 layout: str = "contiguous", tokens: int = 256) -> list:
    """Run the launchers on small CPU tensors (`tokens` queries and keys) with recorders in
    place of the kernels; with layout "bnhd", (B, N, H, D) storage seen as (B, H, N, D), as
    a fused projection makes. From `carry_min_keys` tokens bf16 "accurate" calls carry
    (their copy kernels, which only prepare operands, are not recorded)."""
    launches: list = []
    saved = {(forward, "_attention_forward"), (forward, "_attention_forward_jvp"),
             (backward, "_backward_dkdv"), (backward, "_backward_dkdv_tangent"),
             (backward, "_backward_dv_tangent"), (backward, "_backward_dk_tangent"),
             (backward, "_backward_dq"), (backward, "_backward_dq_tangent")}
    originals = {(m, n): getattr(m, n) for m, n in saved | LAUNCH_SITES}
    try:
        for module, name in saved:
            setattr(module, name, Recorder(originals[(module, name)], name, launches))
        for module, name in LAUNCH_SITES:
            setattr(module, name, recorded)
        shape = (1, 2, tokens, head_dim)
        q, k, v, tq, tk, tv, do, dto = (
            torch.randn(shape, dtype=dtype) if layout == "contiguous"
            else torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2)
            for _ in range(8))
        attn_mask = {"none": None, "bool": torch.ones(shape[2], shape[2], dtype=torch.bool),
                     "additive": torch.zeros(shape[2], shape[2], dtype=dtype)}[mask]
        for tangents in (None, (tq, tk, tv)):
            fwd = forward.flash_attention_forward(q, k, v, attn_mask, causal, None, tangents)
            lse = torch.zeros(shape[:3])
            backward_launch(q, k, v, fwd.out, lse, do, attn_mask, causal, tangents, dto)
    finally:
        for (module, name), tuned in originals.items():
            setattr(module, name, tuned)
    return launches


# The launchers run their kernels through `launchable(kernel, q)[grid](...)`.
LAUNCH_SITES = {(forward, "launchable"), (backward, "launchable"), (launch, "cached")}


def recorded(kernel, like=None):
    """`launchable` (and `cached`, the carry's launches) while recording: a recorder
    records, other kernels (the backward's row statistics, the carry's copies) do not run."""
    return kernel if isinstance(kernel, Recorder) else _NoLaunch()


def backward_launch(q, k, v, out, lse, do, attn_mask, causal, tangents, dto):
    """The backward's two tiled kernels, recorded (the row statistics kernel, which runs for
    real on CPU tensors only in the interpreter, is skipped: see `recorded`)."""
    if tangents is None:
        backward.flash_attention_backward(q, k, v, out, lse, do, attn_mask, causal)
    else:
        backward.flash_attention_backward(q, k, v, out, lse, do, attn_mask, causal, None,
                                          tangents, out, lse, dto)


def in_key_layout(kernel, bound: dict, config: triton.Config,
                  layout: str) -> tuple[dict, triton.Config]:
    """A dK/dV launch's arguments and tile with its accumulators keys x dims ("stored"), dims
    x keys ("transposed") or as the library lays them out ("library": the launch's layout,
    or the tile's where the autotuner chooses it, stored for a tile from --tiles); the
    layout moves into the arguments. Other kernels' unchanged."""
    if "TRANSPOSED" not in kernel.arg_names:
        return bound, config
    chosen = config.kwargs.get("TRANSPOSED", bound.get("TRANSPOSED", False))
    tile = triton.Config({k: v for k, v in config.kwargs.items() if k != "TRANSPOSED"},
                         num_warps=config.num_warps, num_stages=config.num_stages)
    transposed = chosen if layout == "library" else layout == "transposed"
    return {**bound, "TRANSPOSED": transposed}, tile


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--tokens", type=int, default=256,
                        help="queries and keys of the recorded calls (decides, e.g., the carry)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mask", default="none", choices=("none", "bool", "additive"))
    parser.add_argument("--kernels", default="", help="only kernels whose name contains this")
    parser.add_argument("--layout", choices=["contiguous", "bnhd"], default="contiguous",
                        help="the inputs' layout: (B, H, N, D), or (B, N, H, D) storage")
    parser.add_argument("--first-only", action="store_true",
                        help="only the tile JVP_ATTENTION_AUTOTUNE=0 runs with")
    parser.add_argument("--tiles", default="",
                        help="try these tiles instead of the pruned list: 'M,N,warps,stages;...'")
    parser.add_argument("--key-layout", choices=("library", "stored", "transposed"),
                        default="library",
                        help="the dK/dV kernels' accumulators: as the library lays them out "
                        "(the first order's by its keys, the second order's tuned with the "
                        "tile), keys x dims (stored) or dims x keys (transposed, `TRANSPOSED`, "
                        "chapter 5)")
    parser.add_argument("--float-args", choices=("fp32", "fp64"), default="fp32",
                        help="type the kernels' float arguments as Triton's launch does (fp32) "
                        "or as Inductor's launch of a user's kernel does (fp64)")
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args()
    os.environ["JVP_ATTENTION_AUTOTUNE"] = "0" if args.first_only else "1"
    rows = []
    for head_dim, (name, kernel, configs, bound) in (
            (d, launched) for d in args.head_dim
            for launched in launches_for(getattr(torch, args.dtype), d, args.causal, args.mask,
                                         args.layout, args.tokens)):
        if args.kernels not in name:
            continue
        tangent = bool(bound.get("HAS_TANGENT"))
        if args.tiles:
            configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                       for m, n, w, st in (map(int, t.split(",")) for t in args.tiles.split(";"))]
        seen = set()
        for config in configs:
            launch_args, config = in_key_layout(kernel, bound, config, args.key_layout)
            tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                    config.num_stages)
            if (tile, launch_args.get("TRANSPOSED")) in seen:  # a layout asked of both
                continue
            seen.add((tile, launch_args.get("TRANSPOSED")))
            report = compile_report(kernel, launch_args, config, args.float_args)
            row = {"kernel": name, "tangent": tangent, "tile": tile, "dtype": args.dtype,
                   "head_dim": head_dim, "tokens": args.tokens, "mask": args.mask,
                   "use_tma": bool(bound.get("USE_TMA")), **report,
                   **({"transposed": launch_args["TRANSPOSED"]}
                      if "TRANSPOSED" in launch_args else {}),
                   "fits": report["shared"] <= SHARED_LIMIT, "triton": triton.__version__}
            rows.append(row)
            print(f"{name:20} tangent={tangent!s:5} tile={tile!s:18} regs={report['regs']!s:4} "
                  f"spills={report['spills']!s:6} shared={report['shared']:7d} "
                  f"copies={report['copies']:8} loads="
                  f"{' '.join(f'{n}x{b}B' for b, n in report['load_bytes'].items()) or '-':14}"
                  f" d={head_dim} wgmma groups={report['wgmma_groups']} "
                  f"waits={report['wgmma_waits']} mma.sync={report['mma_sync']}"
                  f"{' transposed' if launch_args.get('TRANSPOSED') else ''}"
                  f"{'  UNFENCED WGMMA' if report['unfenced_wgmma'] else ''}"
                  f"{'' if row['fits'] else '  DOES NOT FIT'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
