"""DirectLaunch: a Triton kernel launched through its compiled handle once it has been compiled.

A Triton launch binds and specializes every argument on every call, then looks the compiled kernel
up by the resulting key: for the 19-argument gather kernel that costs several times the host time
of a trivial kernel's launch (docs/lab/PERF_NOTES.md). A table fixes all but three of those
arguments (the ids, the output, the batch size), and the kernels mark those three as never
specialized (``do_not_specialize``, ``do_not_specialize_on_alignment``), so one compiled kernel
serves every call of a kind (device, dtypes, word size, constexprs, 32- or 64-bit batch size). The
first call of a kind goes through Triton's own launch, which compiles and returns the kernel; the
next ones hand the same arguments straight to its launcher (``CompiledKernel.run``, the call
``CompiledKernel.__getitem__``'s runner makes, as Triton 3.6 to 3.8 define it: ``_VERSIONS``).

Used only where it is known to work: a real (not interpreted) kernel, a Triton version whose
launcher takes that call, no launch hooks set (a profiler's), and ``PLE_UM_DIRECT_LAUNCH`` on;
otherwise every call is Triton's own launch.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.jit import JITFunction

from ple_um import envs

# Triton versions whose CompiledKernel.run takes (grid x, y, z, stream, function, packed metadata,
# launch metadata, enter hook, exit hook, *every argument in signature order).
_VERSIONS = ((3, 6), (3, 7), (3, 8))


def hooks_set() -> bool:
    """Whether a Triton launch hook is set (a profiler's): then every call goes through Triton's
    launch. Triton 3.6+ keeps the hooks in a HookChain, which is never None but empty until a
    profiler adds one (so a chain counts as set only when it holds a call: read as set, it would
    keep every call off the direct launch); older Triton used None or the hook itself."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def _why_not_direct(kernel) -> str | None:
    """None when ``kernel`` can be launched directly here, else why not."""
    if not isinstance(kernel, JITFunction):
        return "the kernel is interpreted (TRITON_INTERPRET)"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if version not in _VERSIONS:
        return f"Triton {triton.__version__} is not one whose launcher was checked ({_VERSIONS})"
    if not envs.PLE_UM_DIRECT_LAUNCH:
        return "PLE_UM_DIRECT_LAUNCH=0"
    return None


# ``current_stream(device)``: the raw handle of CUDA device ``device``'s current stream, the one a
# kernel is launched on and an eager host-path lookup queued on. torch's private call (what Triton's
# own launcher reads), since the public ``torch.cuda.current_stream(device).cuda_stream`` builds a
# Stream object per call, a host cost of the size a direct launch and an eager lookup's queuing are
# kept to. The builtin itself, bound once: a call costs no Python frame. A torch built without CUDA
# lacks it (and has no stream to give): the public call stands in, and says so when called.
current_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda device: torch.cuda.current_stream(device).cuda_stream
)


class DirectLaunch:
    """Launches ``kernel`` (a ``triton.jit`` function) on the current stream of the current device.

    One instance per set of fixed arguments: every call must pass the same values for every
    argument that ``kind`` does not describe, except the three the kernel never specializes on (a
    table makes one instance per kernel and per kind of rows it reads). ``direct=False``: Triton's
    own launch at every call (for callers without fixed arguments)."""

    def __init__(self, kernel, *, direct: bool = True) -> None:
        self.kernel = kernel
        self.why_not = _why_not_direct(kernel) if direct else "a one-off launch"
        self._compiled: dict[tuple, object] = {}

    def __call__(self, kind: tuple, grid: int, args: tuple, num_warps: int):
        """Launch ``grid`` programs with ``args`` (every kernel argument, in signature order,
        constexprs included). ``kind``: whatever, besides the device, decides the compiled kernel.
        Returns the compiled kernel where it may be launched directly (see ``bind``), else None."""
        if self.why_not is not None:
            self.kernel[(grid,)](*args, num_warps=num_warps)
            return None
        device = torch.cuda.current_device()
        key = (device, num_warps, *kind)
        compiled = self._compiled.get(key)
        if compiled is None or hooks_set():
            compiled = self.kernel[(grid,)](*args, num_warps=num_warps)
            if compiled is not None:
                self._compiled[key] = compiled
            return compiled
        stream = current_stream(device)
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
        return compiled


def bind(compiled, args: tuple, *, ids_at: int, n_at: int, rows_per_program: int):
    """A launcher of ``compiled`` for one table and one kind of call: ``launch(ids_ptr, out_ptr, n)``
    queues the kernel on the current stream of the current device with ``args`` (the arguments of
    a call that compiled it, in signature order; tensors taken by address, so they must outlive the
    launcher) but the batch's ids and output addresses (at ``ids_at`` and the position after it)
    and size (at ``n_at``). No binding, no specialization, no view: what an eager lookup's host time
    is left with. The caller checks that no launch hook is set and the device is the one compiled
    for (``hooks_set``)."""
    fixed = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    head, middle, tail = fixed[:ids_at], fixed[ids_at + 2 : n_at], fixed[n_at + 1 :]
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    stream_of, device = current_stream, torch.cuda.current_device()

    def launch(ids_ptr: int, out_ptr: int, n: int) -> None:
        grid = (n + rows_per_program - 1) // rows_per_program
        run(
            grid,
            1,
            1,
            stream_of(device),
            function,
            metadata,
            None,
            None,
            None,
            *head,
            ids_ptr,
            out_ptr,
            *middle,
            n,
            *tail,
        )

    return launch
