"""The device memory an engine asks for before JAX's backend starts, and what the CUDA driver says about it.

request_device_memory sets JAX's allocator fraction (vLLM's gpu_memory_utilization is a fraction of the whole
device) and allocator, then check_free_device_memory fails early, as vLLM, when another process holds too much of
a GPU; gpu_device / allocator_fraction tell setup.py the device's size and the fraction JAX was given. Separate from
setup.py because it runs before anything touches a device (server/serve.py calls it before jax.distributed starts)
and asks the driver directly (ctypes, libcuda), not JAX.
"""

from __future__ import annotations

import os

_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jax's name, and its old one
_JAX_DEFAULT_FRACTION = 0.75
_ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"


def request_device_memory(
    gpu_memory_utilization: float, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1
) -> None:
    """JAX's GPU allocator may use XLA_CLIENT_MEM_FRACTION of each GPU's memory, read when the backend
    starts: 0.75 unless set. vLLM's gpu_memory_utilization is a fraction of the whole device (weights,
    activations and KV cache), so, before the backend starts and unless the user set the variable, ask for that
    fraction. (At 0.75 the 500 x 462/256 benchmark's 500 sequences did not fit an H100's KV cache at once: 24
    preemptions, ~5% of the run.) Called before anything touches a device (serve calls it first too).

    An engine without pipeline stages also asks for the stream-ordered allocator (XLA_PYTHON_CLIENT_ALLOCATOR=
    cuda_async, unless set). With the default BFC allocator a decode step's temporary buffer moved between steps
    at some batch sizes, and XLA then re-recorded the step's CUDA graph before launching it: 1.0 ms per step at
    batch 64 with Triton GEMMs, 2.5 ms with cuBLAS (traced commands), against 0.15-0.2 ms when only the step's
    inputs and outputs moved (H100, XLA's command-buffer log; XLA's SKIP_TEMP mode, which pins temporaries, gave
    ~0.2 ms too, on a slow VMM allocator). Engine A/Bs: one H100 (h100_allocator_cublas_ab_1c6c1b4_vs_e104111.json)
    batch-64 ITL 7.20 / 7.56 -> 6.95 / 6.95 ms, batch 128 9.61 -> 9.01, batch 1 unchanged; tp 2 on two H200s
    (h200x2_tp2_allocator_ab_6d5184f.json) batch 1 4.41 / 4.54 -> 4.17 / 4.29 ms, batch 64 8.29 / 7.42 -> 6.30 /
    6.62, batch 128 8.80 / 7.69 -> 7.60 / 7.78. Pipeline stages keep the default: not measured there.

    Then, as vLLM, startup fails with a clear error if another process holds so much of a GPU the engine will
    use that the fraction is not free (check_free_device_memory)."""
    from jax._src import xla_bridge

    if not 0.0 < gpu_memory_utilization <= 1.0:  # EngineArgs.validate() says what is wrong
        return
    if xla_bridge.backends_are_initialized():
        return
    if pipeline_parallel_size == 1:
        os.environ.setdefault(_ALLOCATOR_VAR, "cuda_async")
    if not any(v in os.environ for v in _FRACTION_VARS):
        os.environ[_FRACTION_VARS[0]] = f"{gpu_memory_utilization:.4f}"
    check_free_device_memory(allocator_fraction(), tensor_parallel_size * pipeline_parallel_size)


_free_memory_checked = False


def check_free_device_memory(fraction: float, num_devices: int) -> None:
    """ValueError (vLLM's message) if one of the first num_devices GPUs has less than fraction of its memory
    free: jax's allocator would then fail, or the KV cache sized for that fraction would not fit, later and
    less clearly. Before the backend starts, once per process; nothing without CUDA, with JAX_PLATFORMS
    naming no GPU platform, or with several processes (JAX_NUM_PROCESSES: which GPUs are whose is not known
    yet)."""
    global _free_memory_checked
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if (
        _free_memory_checked
        or platforms
        and not any(p in platforms for p in ("cuda", "gpu"))
        or os.environ.get("JAX_NUM_PROCESSES", "1") != "1"
        or num_devices < 1
    ):
        return
    _free_memory_checked = True
    for free, total in _cuda_free_memory(num_devices) or []:
        if free < fraction * total:
            gib = lambda b: round(b / 2**30, 2)  # noqa: E731
            raise ValueError(
                f"Free memory on device ({gib(free)}/{gib(total)} GiB) on startup is less than desired GPU memory "
                f"utilization ({round(fraction, 4)}, {gib(fraction * total)} GiB). Decrease GPU memory utilization "
                f"or reduce GPU memory used by other processes."
            )


def _libcuda():
    """The CUDA driver library, initialized; None without one."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def gpu_device() -> tuple[int, str] | None:
    """(total memory in bytes, name) of the first GPU jax uses (the driver's cuDeviceTotalMem for the bytes);
    None when the driver cannot say."""
    import ctypes

    import jax

    cuda = _libcuda()
    dev, total = ctypes.c_int(), ctypes.c_size_t()
    if (
        cuda is None
        or cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0
        or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) != 0
    ):
        return None
    return total.value, jax.local_devices()[0].device_kind


def _cuda_free_memory(num_devices: int) -> list[tuple[int, int]] | None:
    """(free, total) bytes of the first num_devices visible CUDA devices, from the driver (libcuda's
    cuMemGetInfo in each device's primary context, which is released again: jax retains it later); None
    without a CUDA driver or when a call fails."""
    import ctypes

    cuda = _libcuda()
    count = ctypes.c_int()
    if cuda is None or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    out = []
    for i in range(min(num_devices, count.value)):
        dev, ctx, prev = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cuda.cuDeviceGet(ctypes.byref(dev), i) != 0 or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return None
        try:
            if cuda.cuCtxPushCurrent_v2(ctx) != 0:
                return None
            rc = cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            cuda.cuCtxPopCurrent_v2(ctypes.byref(prev))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(dev)
        if rc != 0:
            return None
        out.append((free.value, total.value))
    return out


def allocator_fraction() -> float:
    for v in _FRACTION_VARS:
        if os.environ.get(v):
            return float(os.environ[v])
    return _JAX_DEFAULT_FRACTION
