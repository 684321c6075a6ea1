"""Memory probes: free bytes now and measured peaks, for the device the engine runs on."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from typing import Protocol, runtime_checkable

_ALLOCATION_FAILURES = ("out of memory", "oom", "alloc_failed", "failed to allocate", "resource exhausted",
                        "cudnn_status_alloc_failed", "cublas_status_alloc_failed")


def is_out_of_memory(err: BaseException) -> bool:
    """``ResourceExhaustedError``, or an allocation failure that cuBLAS/cuDNN surface as ``InternalError``."""
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the engine runs with TensorFlow
        return False
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return True
    if isinstance(err, tf.errors.InternalError):
        text = str(err).lower()
        return any(marker in text for marker in _ALLOCATION_FAILURES)
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


class TFMemoryProbe:
    """Peaks from TensorFlow's allocator stats; free bytes from NVML (GPU) or /proc (CPU)."""

    def __init__(self, device: str | None = None, *, host_reserve_bytes: int = 1 << 30) -> None:
        import tensorflow as tf

        if device is None:
            device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        self.device = device
        self.host_reserve_bytes = host_reserve_bytes
        self._nvml_handle = None

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("GPU")

    def _tf_info(self) -> dict[str, int]:
        import tensorflow as tf

        try:
            return tf.config.experimental.get_memory_info(self.device)
        except (ValueError, RuntimeError):
            return {"current": 0, "peak": 0}

    def free_bytes(self) -> int:
        if not self.is_gpu:
            free = _meminfo_available() - self.host_reserve_bytes
            cg = _cgroup_free()
            if cg is not None:
                free = min(free, cg - self.host_reserve_bytes)
            return max(0, free)
        return self._gpu_free_bytes()

    def _gpu_free_bytes(self) -> int:
        """NVML free memory plus what TensorFlow's own pool holds but does not use now.

        With memory growth on, the pool grows to about the peak so far; its unused part is
        ``peak - current``. Other processes on the GPU are seen through NVML.
        """
        import pynvml

        if self._nvml_handle is None:
            pynvml.nvmlInit()
            index = int(self.device.split(":")[1])
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                index = int(visible.split(",")[index])
            self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        nvml_free = int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).free)
        info = self._tf_info()
        return nvml_free + max(0, int(info["peak"]) - int(info["current"]))

    def reset_peak(self) -> None:
        import tensorflow as tf

        try:
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError):
            pass
        self._base = int(self._tf_info()["current"])

    def peak_bytes(self) -> int:
        """What the work since ``reset_peak`` added at its peak: tensors alive before (model
        weights, inputs, results the caller still holds) are not the job's to budget."""
        return max(0, int(self._tf_info()["peak"]) - getattr(self, "_base", 0))

    def before_chunk(self, rows: int) -> None:
        return None
