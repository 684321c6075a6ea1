"""Fakes of the GPU's readings: the parts of ``tf.config`` the engine reads, and ``pynvml``.

This machine has no GPU, so the probe's arithmetic and the device lookups are tested against these,
installed as ``sys.modules["tensorflow"]`` and ``sys.modules["pynvml"]`` for the length of a test. They
behave as the real ones are documented to: ``get_memory_info`` gives ``current`` and ``peak`` only (in
use by TensorFlow's allocator, not what its pool holds), ``reset_memory_stats`` sets the peak to the
current use, ``set_memory_growth`` is refused once the runtime has created its GPU devices (unless it
changes nothing) and when virtual devices are configured, NVML finds devices by index, UUID, PCI bus id
and MIG index, and a MIG device reports its own memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

GB = 1 << 30


@dataclass(frozen=True)
class PhysicalDevice:
    name: str
    device_type: str = "GPU"


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    memory_limit: int | None = None  # MB, as TensorFlow's


class FakeTF:
    """``tf.config`` of a process with ``gpus`` GPUs; ``alloc``/``release`` move the allocator's figures."""

    def __init__(self, *, gpus: int = 1, initialised: bool = False, growth: bool = False,
                 configs: dict[str, list[LogicalDeviceConfiguration]] | None = None,
                 details: dict[str, dict[str, Any]] | None = None) -> None:
        self.gpus = [PhysicalDevice(f"/physical_device:GPU:{i}") for i in range(gpus)]
        self.visible = list(self.gpus)
        self.initialised = initialised
        self.growth = {g.name: growth for g in self.gpus}
        self.configs = configs or {}
        self.details = details or {}
        self.tf32: bool | None = None
        self.current = 0
        self.peak = 0
        self.loads: list[dict[str, Any]] = []
        experimental = SimpleNamespace(
            get_memory_info=self._memory_info, reset_memory_stats=self._reset,
            get_device_details=lambda gpu: dict(self.details.get(gpu.name, {})),
            set_memory_growth=self._set_growth, get_memory_growth=lambda gpu: self.growth[gpu.name],
            enable_tensor_float_32_execution=self._set_tf32)
        self.config = SimpleNamespace(
            experimental=experimental, list_physical_devices=self._physical, get_visible_devices=self._visible,
            set_visible_devices=self._set_visible, list_logical_devices=self._logical,
            get_logical_device_configuration=lambda gpu: self.configs.get(gpu.name))
        self.saved_model = SimpleNamespace(load=self._load)
        self.errors = SimpleNamespace(OpError=type("OpError", (Exception,), {}))

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def release(self, n: int) -> None:
        self.current -= n

    def _memory_info(self, device: str) -> dict[str, int]:
        if not device.startswith("GPU"):
            raise ValueError(f"no allocator stats for {device}")
        self.initialised = True
        return {"current": self.current, "peak": self.peak}

    def _reset(self, device: str) -> None:
        self.peak = self.current

    def _physical(self, kind: str | None = None) -> list[PhysicalDevice]:
        return list(self.gpus) if kind in (None, "GPU") else []

    def _visible(self, kind: str | None = None) -> list[PhysicalDevice]:
        return list(self.visible) if kind in (None, "GPU") else []

    def _set_visible(self, devices: Any, kind: str | None = None) -> None:
        if self.initialised:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = list(devices) if isinstance(devices, list) else [devices]

    def _logical(self, kind: str | None = None) -> list[SimpleNamespace]:
        n = sum(len(self.configs.get(g.name) or [None]) for g in self.visible)
        return [SimpleNamespace(name=f"/device:GPU:{i}", device_type="GPU") for i in range(n)]

    def _set_growth(self, gpu: PhysicalDevice, enable: bool) -> None:
        if self.configs.get(gpu.name):
            raise ValueError("Cannot set memory growth on device when virtual devices configured")
        if self.growth[gpu.name] == enable:
            return
        if self.initialised:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.growth[gpu.name] = enable

    def _set_tf32(self, enabled: bool) -> None:
        self.tf32 = enabled

    def _load(self, path: str) -> Any:
        """Loading a model initialises the runtime; what was set by then is recorded."""
        self.initialised = True
        self.loads.append({"growth": dict(self.growth), "tf32": self.tf32})
        raise OSError(f"SavedModel file does not exist at: {path}")


class NVMLError(Exception):
    pass


@dataclass
class Device:
    uuid: str
    bus_id: str
    free: int
    total: int = 80 * GB
    mig: list[Device] = field(default_factory=list)
    mig_mode: bool = False


def _bus(text: str) -> tuple[int, ...]:
    """``"00000000:3B:00.0"`` and ``"0000:3b:00.0"`` name the same device."""
    domain, bus, rest = text.split(":")
    device, function = rest.split(".")
    return tuple(int(part, 16) for part in (domain, bus, device, function))


class FakeNVML:
    """``pynvml`` over ``devices`` (in NVML's order: by PCI bus id); ``broken`` makes memory reads fail."""

    NVMLError = NVMLError

    def __init__(self, devices: list[Device], *, broken: bool = False) -> None:
        self.devices = devices
        self.broken = broken
        self.reads: list[str] = []

    def nvmlInit(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Device:
        if not 0 <= index < len(self.devices):
            raise NVMLError("Invalid Argument")
        return self.devices[index]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Device:
        for device in self.devices:
            if _bus(device.bus_id) == _bus(bus_id):
                return device
        raise NVMLError("Not Found")

    def _all(self) -> list[Device]:
        return [h for d in self.devices for h in (d, *d.mig)]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Device:
        for device in self._all():
            if device.uuid == uuid:
                return device
        raise NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: Device) -> str:
        return handle.uuid

    def nvmlDeviceIsMigDeviceHandle(self, handle: Device) -> bool:
        return handle.uuid.startswith("MIG-")

    def nvmlDeviceGetMigMode(self, handle: Device) -> list[int]:
        if not handle.mig_mode and not handle.mig:
            raise NVMLError("Not Supported")
        return [int(handle.mig_mode), int(handle.mig_mode)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Device) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Device, index: int) -> Device:
        if index >= len(handle.mig):
            raise NVMLError("Not Found")
        return handle.mig[index]

    def nvmlDeviceGetMemoryInfo(self, handle: Device) -> SimpleNamespace:
        if self.broken:
            raise NVMLError("Insufficient Permissions")
        self.reads.append(handle.uuid)
        return SimpleNamespace(free=handle.free, total=handle.total, used=handle.total - handle.free)
