"""The GPU the engine runs on: memory growth and TensorFloat-32 set before TensorFlow reserves memory, the
logical device's memory limit, and the NVML device that CUDA runs it on (by UUID, MIG id or PCI bus id).

TensorFlow and pynvml are reached through ``tensorflow()`` and ``nvml()``, so unit tests can put fakes there.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from worker.engine.errors import GPUMemoryReserved

log = logging.getLogger(__name__)

MIB = 1 << 20
_NVML_READY = False
_PREPARED = False


def tensorflow() -> Any:
    import tensorflow as tf

    return tf


def nvml() -> Any:
    """The ``pynvml`` module, initialised once per process; raises ImportError or ``pynvml.NVMLError``."""
    global _NVML_READY
    import pynvml

    if not _NVML_READY:
        pynvml.nvmlInit()
        _NVML_READY = True
    return pynvml


def growth_env() -> str | None:
    """``TF_FORCE_GPU_ALLOW_GROWTH`` as TensorFlow's GPU allocator reads it: "true", "false" or None (unset).
    It overrides ``set_memory_growth`` either way when TensorFlow creates its GPU devices."""
    value = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower()
    return value if value in ("true", "false") else None


def _reserved(gpu: Any, why: str) -> GPUMemoryReserved:
    return GPUMemoryReserved(
        f"{gpu.name}: {why}, so TensorFlow has reserved nearly all of the GPU's memory for itself: free memory "
        "reads near zero and no chunk plan can hold. Turn memory growth on before TensorFlow first uses the GPU: "
        "set TF_FORCE_GPU_ALLOW_GROWTH=true in the environment, or call "
        "tf.config.experimental.set_memory_growth(gpu, True) (or give the GPU a memory_limit with "
        "tf.config.set_logical_device_configuration) before anything else touches it, e.g. load the model with "
        "worker.engine.load_model first", field=None)


@contextlib.contextmanager
def tensor_float_32(enabled: bool) -> Iterator[None]:
    """TensorFloat-32 on (``enabled``) or off for the duration, as it was after: a job's ``precision``.
    The setting is TensorFlow's, for the whole process: a worker runs one job at a time."""
    tf = tensorflow()
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(enabled)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


def prepare_gpus() -> None:
    """Memory growth on every visible GPU without an explicit ``memory_limit``, and TensorFloat-32 off.

    Call before TensorFlow first uses a GPU (``load_model`` and ``run_problem`` do; so does the worker's
    ``configure_devices``). Once TensorFlow has created its GPU devices, growth can no longer change: that
    is fine when it was on already (``set_memory_growth``, ``TF_FORCE_GPU_ALLOW_GROWTH=true``) or the
    logical device has a ``memory_limit``; otherwise TensorFlow reserved nearly the whole GPU and this
    raises ``GPUMemoryReserved`` naming the fix. TF32 rounds matmul and convolution inputs to 10 bits of
    mantissa on Ampere and later GPUs: Jacobians would miss the CPU's tolerances, so it is off.
    No GPU: only TF32 is set. Idempotent once it succeeded.
    """
    global _PREPARED
    if _PREPARED:
        return
    tf = tensorflow()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    env = growth_env()
    for gpu in tf.config.get_visible_devices("GPU"):
        configs = tf.config.get_logical_device_configuration(gpu) or []
        if configs and all(getattr(c, "memory_limit", None) for c in configs):
            continue  # an explicit per-process limit: TensorFlow never takes more than that
        if env == "false":
            raise _reserved(gpu, "TF_FORCE_GPU_ALLOW_GROWTH=false turns memory growth off")
        try:
            tf.config.experimental.set_memory_growth(gpu, True)  # a no-op when already on
        except RuntimeError:  # TensorFlow has created its GPU devices: growth stays as it was (off)
            if env != "true":
                raise _reserved(gpu, "TensorFlow initialised the GPU before memory growth was turned on") from None
        except ValueError as err:  # virtual devices configured by the caller: their settings stand
            log.warning("%s: memory growth not set: %s", gpu.name, err)
    _PREPARED = True


@dataclass(frozen=True)
class Placement:
    """Where a logical GPU (``"GPU:1"``) lives: the physical device, its CUDA ordinal (after
    ``CUDA_VISIBLE_DEVICES``), the logical device's ``memory_limit`` in bytes and whether TF's pool grows."""

    physical: Any
    cuda_index: int
    memory_limit_bytes: int | None
    grows: bool


def placement(device: str) -> Placement | None:
    """The placement of logical ``device``; None when TensorFlow has no such GPU. Logical GPUs are numbered
    over the visible physical GPUs in order, each split into its configured logical devices (if any)."""
    tf = tensorflow()
    index = int(device.split(":")[1]) if ":" in device else 0
    entries: list[tuple[Any, Any]] = []
    for gpu in tf.config.get_visible_devices("GPU"):
        configs = tf.config.get_logical_device_configuration(gpu) or [None]
        entries += [(gpu, config) for config in configs]
    if index >= len(entries):
        return None
    gpu, config = entries[index]
    limit_mb = getattr(config, "memory_limit", None)
    env = growth_env()
    try:
        grows = env == "true" or (env is None and bool(tf.config.experimental.get_memory_growth(gpu)))
    except (ValueError, RuntimeError):
        grows = env == "true"
    return Placement(physical=gpu, cuda_index=int(str(gpu.name).rsplit(":", 1)[-1]),
                     memory_limit_bytes=int(limit_mb) * MIB if limit_mb else None, grows=grows)


def pci_bus_id(where: Placement) -> str | None:
    """The PCI bus id of the GPU behind ``where``: from TensorFlow's device details where it gives one,
    else from the CUDA driver; None when neither can tell."""
    try:
        details = tensorflow().config.experimental.get_device_details(where.physical) or {}
    except (ValueError, RuntimeError):
        details = {}
    return details.get("pci_bus_id") or cuda_pci_bus_id(where.cuda_index)


def cuda_pci_bus_id(cuda_index: int) -> str | None:
    """``cuDeviceGetPCIBusId`` of CUDA device ``cuda_index`` (numbered after ``CUDA_VISIBLE_DEVICES``, as
    TensorFlow numbers its physical GPUs); None without a CUDA driver or on any error."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        buf = ctypes.create_string_buffer(64)
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), cuda_index):
            return None
        if cuda.cuDeviceGetPCIBusId(buf, len(buf), device):
            return None
        return buf.value.decode() or None
    except (OSError, AttributeError, UnicodeDecodeError):
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_devices(nv: Any, parent: Any) -> Iterator[Any]:
    """The MIG devices of ``parent``; none when it is not in MIG mode (or cannot be)."""
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(parent)
        count = int(nv.nvmlDeviceGetMaxMigDeviceCount(parent)) if current else 0
    except nv.NVMLError:  # not MIG-capable
        return
    for i in range(count):
        try:
            handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        except nv.NVMLError:  # an empty slot
            continue
        yield handle


def _by_uuid(nv: Any, uuid: str) -> Any:
    try:
        return nv.nvmlDeviceGetHandleByUUID(uuid)
    except nv.NVMLError:
        pass  # CUDA takes a unique prefix of a UUID; NVML wants the whole of it
    for i in range(int(nv.nvmlDeviceGetCount())):
        parent = nv.nvmlDeviceGetHandleByIndex(i)
        for handle in (parent, *mig_devices(nv, parent)):
            if _text(nv.nvmlDeviceGetUUID(handle)).startswith(uuid):
                return handle
    raise LookupError(f"CUDA_VISIBLE_DEVICES names {uuid!r}, which no NVML device has as its UUID")


def _mig_instance(nv: Any, handle: Any) -> Any:
    """``handle``, or for a GPU in MIG mode one of its MIG devices, whose memory is what CUDA may use: the
    only one, or of several the one with the least free memory now (safe; ``CUDA_VISIBLE_DEVICES=MIG-<uuid>``
    says exactly which)."""
    try:
        if nv.nvmlDeviceIsMigDeviceHandle(handle):
            return handle
    except nv.NVMLError:
        return handle
    instances = list(mig_devices(nv, handle))
    if len(instances) > 1:
        log.warning("the GPU is in MIG mode with %d instances and CUDA_VISIBLE_DEVICES names none: free memory "
                    "is read from the one with the least free; set CUDA_VISIBLE_DEVICES=MIG-<uuid>", len(instances))
        return min(instances, key=lambda h: int(nv.nvmlDeviceGetMemoryInfo(h).free))
    return instances[0] if instances else handle


def nvml_handle(nv: Any, cuda_index: int, *, visible: str | None, bus_id: str | None) -> tuple[Any, str]:
    """The NVML handle of the device CUDA runs as ``cuda_index``, and how it was found.

    ``visible`` is ``CUDA_VISIBLE_DEVICES``: an entry ``GPU-<uuid>`` or ``MIG-<uuid>`` (or a unique prefix)
    is looked up by UUID; otherwise by ``bus_id`` (CUDA may order GPUs fastest first, NVML always by PCI bus
    id, so indices can differ), else by index (the entry's number, or ``cuda_index``). A GPU in MIG mode gives
    way to its MIG instance, whose memory is its own. Raises ``nv.NVMLError`` or LookupError.
    """
    entries = [e.strip() for e in visible.split(",")] if visible else []
    entry = entries[cuda_index] if cuda_index < len(entries) else None
    if entry and entry.startswith(("GPU-", "MIG-")):
        handle, how = _by_uuid(nv, entry), f"UUID {entry}"
    elif bus_id:
        handle, how = nv.nvmlDeviceGetHandleByPciBusId(bus_id), f"PCI bus id {bus_id}"
    else:
        index = int(entry) if entry is not None and entry.isdigit() else cuda_index
        handle, how = nv.nvmlDeviceGetHandleByIndex(index), f"NVML index {index}"
    return _mig_instance(nv, handle), how
