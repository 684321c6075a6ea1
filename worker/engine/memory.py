"""Memory probes: free bytes now and measured peaks, for the device the engine runs on."""

from __future__ import annotations

import logging
import os
import platform
import re
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from worker.engine import devices

log = logging.getLogger(__name__)

# What cuBLAS, cuDNN, XLA and TensorFlow's allocators say when an allocation fails, as whole words: "oom"
# inside "room" or "zoom" is no allocation failure, and taking one for it would halve a chunk down to one
# row and blame memory for an unrelated internal error.
_ALLOCATION_FAILURE = re.compile(r"out of memory|\boom\b|alloc_failed|failed to allocate|resource[ _]exhausted"
                                 r"|cannot allocate|allocation failed", re.IGNORECASE)


def is_allocation_failure(message: str) -> bool:
    """Whether an error message says that an allocation failed (``CUBLAS_STATUS_ALLOC_FAILED``, ...)."""
    return bool(_ALLOCATION_FAILURE.search(message))


def is_out_of_memory(err: BaseException) -> bool:
    """``ResourceExhaustedError``, or an allocation failure that cuBLAS/cuDNN surface as ``InternalError``
    (or ``UnknownError``): "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "failed to allocate"."""
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the engine runs with TensorFlow
        return False
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return True
    if isinstance(err, (tf.errors.InternalError, tf.errors.UnknownError)):
        return is_allocation_failure(str(err))
    return False


_ARENAS_DECIDED = False


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (0: leave glibc's default) before TensorFlow's threads start;
    the first call of a process decides (the worker and the CLI pass ``Settings.malloc_arenas``).

    Each thread that allocates may get an arena of its own, and memory freed in one arena serves no
    other: TensorFlow's thread pools then hold gigabytes of freed tensor memory (peak RSS of
    ``jacobian compute`` on MobileNetV3Small: 2.57 GB with glibc's default, 1.79 GB with 2 arenas).
    A ``MALLOC_ARENA_MAX`` the user set wins. Returns whether the cap was applied.
    """
    global _ARENAS_DECIDED
    if _ARENAS_DECIDED or os.environ.get("MALLOC_ARENA_MAX") or platform.system() != "Linux":
        return False
    _ARENAS_DECIDED = True
    if arenas <= 0:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-8, arenas))  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to cap
        return False


@lru_cache(maxsize=8)
def device_kind(device: str) -> str:
    """What a plan's measurements depend on: ``"GPU/<name>/cc<major.minor>"`` or ``"CPU/<model>/<cores>"``."""
    import tensorflow as tf

    if device.startswith("GPU"):
        gpus = tf.config.list_physical_devices("GPU")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index < len(gpus):
            details = tf.config.experimental.get_device_details(gpus[index])
            cc = details.get("compute_capability")
            return f"GPU/{details.get('device_name', 'unknown')}/cc{'.'.join(map(str, cc)) if cc else '?'}"
        return "GPU/unknown"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU/{model}/{os.cpu_count()}"


@runtime_checkable
class MemoryProbe(Protocol):
    """What the planner needs to know about memory; tests inject readings and OOMs through it."""

    device: str

    def free_bytes(self) -> int:
        """Bytes this process may still use now (other tenants included)."""

    def reset_peak(self) -> None:
        """Start a new peak measurement."""

    def peak_bytes(self) -> int:
        """Peak bytes allocated on ``device`` since ``reset_peak``, above what was allocated then."""

    def before_chunk(self, rows: int) -> None:
        """Called before each chunk; a test probe raises ``tf.errors.ResourceExhaustedError`` here."""


def _meminfo_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _cgroup_free() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as fh:
            return int(limit) - int(fh.read().strip())
    except (OSError, ValueError):
        return None


def host_free_bytes(reserve_bytes: int = 0) -> int:
    """Host memory this process may still use: /proc's MemAvailable, within the cgroup's limit (containers),
    less ``reserve_bytes``."""
    free = _meminfo_available() - reserve_bytes
    cg = _cgroup_free()
    if cg is not None:
        free = min(free, cg - reserve_bytes)
    return max(0, free)


_POOL_HIGH_WATER: dict[str, int] = {}  # per device: the largest allocator peak this process has seen


class TFMemoryProbe:
    """Peaks from TensorFlow's allocator stats; free bytes from NVML and TensorFlow's pool (GPU) or /proc (CPU)."""

    def __init__(self, device: str | None = None, *, host_reserve_bytes: int = 1 << 30) -> None:
        tf = devices.tensorflow()
        if device is None:
            device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        self.device = device
        self.host_reserve_bytes = host_reserve_bytes
        self._base = 0
        self._nvml_handle: Any = None
        self._placement: devices.Placement | None = None
        self._warned = False

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("GPU")

    def _tf_info(self) -> dict[str, int]:
        """TensorFlow's ``current`` and ``peak``; the peak joins the pool's high-water mark as it is read."""
        try:
            info = devices.tensorflow().config.experimental.get_memory_info(self.device)
        except (ValueError, RuntimeError):
            return {"current": 0, "peak": 0}
        _POOL_HIGH_WATER[self.device] = max(_POOL_HIGH_WATER.get(self.device, 0), int(info["peak"]))
        return info

    def free_bytes(self) -> int:
        if not self.is_gpu:
            return self.host_free_bytes()
        return max(0, self._gpu_free_bytes())

    def host_free_bytes(self) -> int:
        """Host memory free now (``host_free_bytes`` less the probe's reserve): on a GPU, where each chunk's
        rows land and the result writer's blocks wait (``ChunkRun`` caps chunks by it)."""
        return host_free_bytes(self.host_reserve_bytes)

    def _gpu_free_bytes(self) -> int:
        """What this process may still use on the GPU now: NVML's free memory (other tenants seen) plus the
        idle part of TensorFlow's own pool, within the logical device's ``memory_limit``.

        TensorFlow reports what its allocator has in use and the peak since the last ``reset_memory_stats``,
        not what its pool holds. With memory growth the pool never gives memory back, so the largest peak
        this process has seen (read before every reset) is a lower bound of it, and ``that - current`` is
        idle pool that NVML counts as used. With a ``memory_limit`` and no growth TensorFlow reserved the
        whole limit at start: ``limit - current`` is exact. When NVML fails (no library, no permission, a
        device it cannot find) TensorFlow's numbers stand alone, with a warning: the limit, else the idle pool.
        """
        if self._placement is None:
            self._placement = devices.placement(self.device)
        where = self._placement
        current = int(self._tf_info()["current"])
        idle = max(0, _POOL_HIGH_WATER.get(self.device, 0) - current)
        own = None
        if where is not None and where.memory_limit_bytes is not None:
            own = max(0, where.memory_limit_bytes - current)
            if not where.grows:
                return own
        nvml_free = self._nvml_free(where)
        if nvml_free is not None:
            return nvml_free + idle if own is None else min(nvml_free + idle, own)
        return own if own is not None else idle

    def _nvml_free(self, where: devices.Placement | None) -> int | None:
        """NVML's free bytes of the device CUDA runs this logical GPU on; None (warned once) when NVML fails."""
        try:
            nv = devices.nvml()
            if self._nvml_handle is None:
                cuda_index = where.cuda_index if where is not None else int(self.device.split(":")[1])
                bus_id = devices.pci_bus_id(where) if where is not None else None
                self._nvml_handle, how = devices.nvml_handle(
                    nv, cuda_index, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), bus_id=bus_id)
                log.info("%s: free memory from the NVML device found by %s", self.device, how)
            return int(nv.nvmlDeviceGetMemoryInfo(self._nvml_handle).free)
        except Exception as err:  # noqa: BLE001 - NVML missing, not permitted, no such device: TensorFlow's numbers
            if not self._warned:
                self._warned = True
                log.warning("%s: NVML cannot read free GPU memory (%s: %s); planning from TensorFlow's own "
                            "numbers (the logical device's memory_limit, else its idle pool). Give the GPU a "
                            "memory_limit (tf.config.set_logical_device_configuration) for a plan that holds "
                            "without NVML", self.device, type(err).__name__, err)
            return None

    def reset_peak(self) -> None:
        self._tf_info()  # the peak so far joins the pool's high-water mark before the reset forgets it
        try:
            devices.tensorflow().config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError):
            pass
        self._base = int(self._tf_info()["current"])

    def peak_bytes(self) -> int:
        """What the work since ``reset_peak`` added at its peak: tensors alive before (model
        weights, inputs, results the caller still holds) are not the job's to budget."""
        return max(0, int(self._tf_info()["peak"]) - self._base)

    def before_chunk(self, rows: int) -> None:
        return None
