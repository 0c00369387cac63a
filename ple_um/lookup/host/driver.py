"""The few CUDA driver calls of the host path, bound through ctypes on libcuda.

Each call is a stream operation (captured like any other) or a query; none takes the GIL back while
it runs. A copy, launch, wait, event creation or context call that fails raises ``HostNodeError``
naming the call and the driver's error; ``query`` and ``done`` hand the stream's or event's state
back. One ``CudaDriver`` per process (``CudaDriver.get()``).
"""

from __future__ import annotations

import ctypes
import threading

from ple_um.errors import PleUmError

_PTR, _I32, _U32, _U64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint64
_SIGNATURES = {
    "cuMemcpyDtoHAsync_v2": [_PTR, _U64, ctypes.c_size_t, _PTR],
    "cuMemcpyHtoDAsync_v2": [_U64, _PTR, ctypes.c_size_t, _PTR],
    "cuLaunchHostFunc": [_PTR, _PTR, _PTR],
    "cuEventCreate": [ctypes.POINTER(_PTR), ctypes.c_uint],
    "cuEventRecord": [_PTR, _PTR],
    "cuEventQuery": [_PTR],
    "cuEventDestroy_v2": [_PTR],
    "cuStreamWaitEvent": [_PTR, _PTR, ctypes.c_uint],
    "cuGetErrorName": [_I32, ctypes.POINTER(ctypes.c_char_p)],
    "cuStreamQuery": [_PTR],
    "cuCtxGetCurrent": [ctypes.POINTER(_PTR)],
    "cuCtxSetCurrent": [_PTR],
    "cuDeviceGet": [ctypes.POINTER(_I32), _I32],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_PTR), _I32],
}
# Stream memory operations: the dispatcher's signals (CUDA 11.7+ drivers have the _v2 calls).
_MEM_OPS = {
    "cuStreamWriteValue32_v2": [_PTR, _U64, _U32, _U32],
    "cuStreamWaitValue32_v2": [_PTR, _U64, _U32, _U32],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_U64), _PTR, _U32],
}
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600


class HostNodeError(PleUmError, RuntimeError):
    """The CUDA driver refused a call of the host path (the message names the call and the error)."""


class CudaDriver:
    """libcuda's calls of the host path: copies, host functions, events, stream memory operations."""

    _instance: CudaDriver | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        lib = self.lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _I32
        self.mem_ops = all(hasattr(lib, name) for name in _MEM_OPS)
        if self.mem_ops:
            for name, argtypes in _MEM_OPS.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, _I32
            self.write_value = self._checked(
                lambda stream, address, value: lib.cuStreamWriteValue32_v2(stream, address, value, 0),
                "cuStreamWriteValue32",
            )
            self.wait_value = self._checked(  # flags 0: CU_STREAM_WAIT_VALUE_GEQ (cyclic)
                lambda stream, address, value: lib.cuStreamWaitValue32_v2(stream, address, value, 0),
                "cuStreamWaitValue32",
            )
        self._thread = threading.local()
        self.d2h = self._checked(lib.cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync")
        self.h2d = self._checked(lib.cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync")
        self.launch_host_func = self._checked(lib.cuLaunchHostFunc, "cuLaunchHostFunc")
        self.record = self._checked(lib.cuEventRecord, "cuEventRecord")
        self.wait = self._checked(
            lambda stream, event: lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent"
        )

    @classmethod
    def get(cls) -> CudaDriver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _checked(self, fn, name: str):
        def call(*args) -> None:
            rc = fn(*args)
            if rc != CUDA_SUCCESS:
                raise HostNodeError(f"{name} failed: {self.error_name(rc)}")

        return call

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        return f"{(name.value or b'?').decode()} ({rc})"

    def query(self, stream: int) -> int:
        """cuStreamQuery's code: CUDA_SUCCESS (idle), CUDA_ERROR_NOT_READY (busy), or an error."""
        return self.lib.cuStreamQuery(stream)

    def ensure_context(self, index: int) -> None:
        """Make device ``index``'s primary context current in this thread where none is (a thread
        that has made no CUDA call yet: the calls here need one). Once per thread. The caller has
        made ``index`` torch's current device (whose context is then current)."""
        if getattr(self._thread, "index", None) == index:
            return
        current = ctypes.c_void_p()
        if self.lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and not current.value:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            for rc in (
                self.lib.cuDeviceGet(ctypes.byref(device), index),
                self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                self.lib.cuCtxSetCurrent(context),
            ):
                if rc != CUDA_SUCCESS:
                    raise HostNodeError(
                        f"making device {index}'s context current failed: {self.error_name(rc)}"
                    )
        self._thread.index = index

    def device_pointer(self, host: int) -> int:
        """The device address of pinned host memory at ``host`` (the same address under UVA)."""
        address = ctypes.c_uint64()
        rc = self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(address), host, 0)
        if rc != CUDA_SUCCESS:
            raise HostNodeError(f"cuMemHostGetDevicePointer failed: {self.error_name(rc)}")
        return address.value

    def event(self) -> int:
        """A new event without timing (destroy with ``destroy``)."""
        handle = ctypes.c_void_p()
        rc = self.lib.cuEventCreate(ctypes.byref(handle), 2)  # CU_EVENT_DISABLE_TIMING
        if rc != CUDA_SUCCESS:
            raise HostNodeError(f"cuEventCreate failed: {self.error_name(rc)}")
        return handle.value

    def done(self, event: int) -> bool:
        return self.lib.cuEventQuery(event) == CUDA_SUCCESS

    def destroy(self, event: int) -> None:
        self.lib.cuEventDestroy_v2(event)
