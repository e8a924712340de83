"""Make Triton's interpreter skip work it repeats, in the tests and every Python process they start.

tests/conftest.py imports this module and puts this folder first on PYTHONPATH, where
sitecustomize.py imports it at the start-up of each process the tests start (notebook kernels,
benchmark smoke runs, context-parallel ranks). Outside `TRITON_INTERPRET=1` it does nothing.

Why: under the interpreter a kernel launch patches `triton.language` (every builtin of
`tl`, `tl.tensor` and `tl.math`, found through `inspect.getmembers`) and restores it when the
launch ends, and every call of a `@triton.jit` helper inside the kernel runs the same patching
again, finding everything patched already. Our kernels call small helpers thousands of times per
launch, so the repeats took about 45% of the interpreted tests' CPU time (profiled: one
second-order check 13.1 s, 7.1 s without them). Here a helper call whose language modules the
running launch has patched skips the repeat; a launch, or a helper that sees a module the launch
did not patch, patches as before, so the kernels compute exactly what they did.
"""

import importlib.abc
import importlib.util
import inspect
import os
import sys

INTERPRETER = "triton.runtime.interpreter"


def skip_repeated_patching(interpreter) -> None:
    """Wrap `interpreter._patch_lang` so that it patches only what the running launch has not
    (nothing, when this Triton has no such function)."""
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    import triton.language as tl

    patched: set[int] = set()  # the language modules the running launch has patched

    def patch_lang(fn):
        modules = {id(value) for value in fn.__globals__.values()
                   if inspect.ismodule(value) and value in (tl, tl.core)}
        if patched and modules <= patched:
            return interpreter._LangPatchScope()  # a helper call: nothing left to patch
        launch = not patched
        scope = original(fn)
        patched.update(modules)
        if launch:  # the launch restores everything when it ends, and so starts afresh
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: patch the interpreter module when Triton imports it (lazily, when the first
    kernel is defined), so that processes that never define one pay nothing."""

    def find_spec(self, name, path, target=None):
        if name != INTERPRETER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            skip_repeated_patching(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    if INTERPRETER in sys.modules:
        skip_repeated_patching(sys.modules[INTERPRETER])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
