"""GPU memory as the engine reads it, against fake TensorFlow and NVML readings (no GPU here): free bytes
(NVML plus TensorFlow's idle pool, a logical memory limit, the device CUDA uses by UUID, MIG id or PCI bus
id, NVML failures), and memory growth and TensorFloat-32 set wherever the engine runs."""

from __future__ import annotations

import logging
import sys

import pytest

from tests.unit.fake_gpu import GB, Device, FakeNVML, FakeTF, LogicalDeviceConfiguration
from worker.engine import devices, memory

A = Device(uuid="GPU-aaaaaaaa-1111-2222-3333-444444444444", bus_id="00000000:1A:00.0", free=10 * GB)
B = Device(uuid="GPU-bbbbbbbb-1111-2222-3333-444444444444", bus_id="00000000:3B:00.0", free=30 * GB)


def mig_gpu() -> Device:
    return Device(uuid="GPU-cccccccc-1111-2222-3333-444444444444", bus_id="00000000:5C:00.0", free=60 * GB,
                  mig_mode=True, mig=[Device(uuid="MIG-11111111-2222-3333-4444-555555555555", bus_id="", free=9 * GB),
                                      Device(uuid="MIG-66666666-2222-3333-4444-555555555555", bus_id="", free=4 * GB)])


@pytest.fixture
def gpu(monkeypatch):
    """Install fakes: ``gpu(tf=..., nvml=...)`` -> (FakeTF, FakeNVML); a fresh process state each time."""
    monkeypatch.setattr(memory, "_POOL_HIGH_WATER", {}, raising=False)
    monkeypatch.setattr(devices, "_PREPARED", False)
    monkeypatch.setattr(devices, "cuda_pci_bus_id", lambda index: None)
    for name in ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH", "TF_CPP_MIN_LOG_LEVEL"):
        monkeypatch.setenv(name, "")  # so that teardown restores it, also when code under test sets it
        monkeypatch.delenv(name)

    def install(tf: FakeTF | None = None, nvml: FakeNVML | None = None) -> tuple[FakeTF, FakeNVML]:
        from worker.engine import loop_handles, resize_grads

        # load_model's gradient patches import tensorflow.python, which the fake has not (run alone, no real
        # TensorFlow was imported before): as if installed already
        monkeypatch.setattr(loop_handles, "_INSTALLED", True)
        monkeypatch.setattr(resize_grads, "_INSTALLED", True)
        tf = tf or FakeTF(growth=True)
        nvml = nvml or FakeNVML([A, B])
        monkeypatch.setitem(sys.modules, "tensorflow", tf)
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        return tf, nvml

    return install


# -- free bytes -------------------------------------------------------------------------------------


def test_the_pools_idle_part_counts_although_the_peak_was_reset(gpu):
    """A chunk peaked at 6 GB in TensorFlow's pool; by the next reading the statistics were reset (before
    the next chunk) and read only the 1 GB of weights: the 6 GB the pool holds are still the process's."""
    tf, _ = gpu()
    probe = memory.TFMemoryProbe("GPU:0")
    tf.alloc(1 * GB)             # weights
    probe.reset_peak()           # before a chunk
    tf.alloc(6 * GB)
    tf.release(6 * GB)           # the chunk is done; its memory stays in TensorFlow's pool (growth never shrinks)
    probe.reset_peak()           # before the next chunk
    assert probe.free_bytes() == A.free + 6 * GB


def test_a_logical_memory_limit_caps_free_bytes(gpu, monkeypatch):
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    limited = {"/physical_device:GPU:0": [LogicalDeviceConfiguration(memory_limit=2048)]}
    tf, _ = gpu(tf=FakeTF(configs=limited))
    tf.alloc(GB // 2)
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == 2 * GB - GB // 2  # NVML says 10 GB free: the limit wins


def test_a_memory_limit_without_growth_is_reserved_whole_and_exact(gpu):
    """Without growth TensorFlow took the whole limit at start: NVML counts it as used, the limit is exact."""
    limited = {"/physical_device:GPU:0": [LogicalDeviceConfiguration(memory_limit=4096)]}
    tf, _ = gpu(tf=FakeTF(configs=limited), nvml=FakeNVML([Device(uuid=A.uuid, bus_id=A.bus_id, free=0)]))
    tf.alloc(1 * GB)
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == 3 * GB


def test_logical_devices_split_from_one_gpu_have_their_own_limits(gpu, monkeypatch):
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    split = {"/physical_device:GPU:0": [LogicalDeviceConfiguration(1024), LogicalDeviceConfiguration(3072)]}
    gpu(tf=FakeTF(configs=split))
    assert memory.TFMemoryProbe("GPU:1").free_bytes() == 3 * GB


@pytest.mark.parametrize("visible", [B.uuid, B.uuid[:12], f"{B.uuid},{A.uuid}"])
def test_cuda_visible_devices_as_gpu_uuids(gpu, monkeypatch, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu()
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == B.free


def test_a_mig_id_reads_the_instances_own_memory(gpu, monkeypatch):
    parent = mig_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent.mig[0].uuid)
    gpu(nvml=FakeNVML([A, parent]))
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == 9 * GB  # not the parent's 60 GB


def test_a_gpu_in_mig_mode_without_a_mig_id_reads_an_instance_and_never_the_whole_gpu(gpu, monkeypatch, caplog):
    parent = mig_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu(nvml=FakeNVML([parent]))
    with caplog.at_level(logging.WARNING):
        assert memory.TFMemoryProbe("GPU:0").free_bytes() == 4 * GB  # of several instances, the least free
    assert "CUDA_VISIBLE_DEVICES=MIG-" in caplog.text


def test_the_nvml_device_is_the_one_cuda_uses_by_pci_bus_id(gpu, monkeypatch):
    """CUDA orders GPUs fastest first, NVML by PCI bus id: CUDA's device 0 may be NVML's device 1."""
    details = {"/physical_device:GPU:0": {"device_name": "H100", "pci_bus_id": "0000:3b:00.0"}}
    gpu(tf=FakeTF(growth=True, details=details))
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == B.free


def test_the_pci_bus_id_comes_from_the_cuda_driver_when_tensorflow_gives_none(gpu, monkeypatch):
    gpu()
    monkeypatch.setattr(devices, "cuda_pci_bus_id", lambda index: {0: "0000:3b:00.0"}[index])
    assert memory.TFMemoryProbe("GPU:0").free_bytes() == B.free


def test_nvml_errors_fall_back_on_tensorflows_numbers_with_a_warning(gpu, caplog):
    tf, nvml = gpu(nvml=FakeNVML([A], broken=True))
    probe = memory.TFMemoryProbe("GPU:0")
    tf.alloc(3 * GB)
    tf.release(2 * GB)
    with caplog.at_level(logging.WARNING):
        assert probe.free_bytes() == 2 * GB  # the idle pool: all TensorFlow can tell without NVML
        assert probe.free_bytes() == 2 * GB
    warnings = [r for r in caplog.records if "NVML cannot read free GPU memory" in r.getMessage()]
    assert len(warnings) == 1 and "memory_limit" in warnings[0].getMessage()


def test_an_unknown_uuid_falls_back_with_a_warning(gpu, monkeypatch, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffffffff")
    limited = {"/physical_device:GPU:0": [LogicalDeviceConfiguration(memory_limit=1024)]}
    gpu(tf=FakeTF(configs=limited, growth=True))
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    with caplog.at_level(logging.WARNING):
        assert memory.TFMemoryProbe("GPU:0").free_bytes() == 1 * GB
    assert "GPU-ffffffff" in caplog.text


def test_peaks_are_above_what_was_allocated_at_the_reset(gpu):
    tf, _ = gpu()
    probe = memory.TFMemoryProbe("GPU:0")
    tf.alloc(5 * GB)
    probe.reset_peak()
    tf.alloc(2 * GB)
    tf.release(2 * GB)
    assert probe.peak_bytes() == 2 * GB


# -- memory growth and TensorFloat-32 ---------------------------------------------------------------


def test_prepare_gpus_turns_growth_on_and_tf32_off_before_tensorflow_starts(gpu):
    tf, _ = gpu(tf=FakeTF(gpus=2))
    devices.prepare_gpus()
    assert tf.growth == {"/physical_device:GPU:0": True, "/physical_device:GPU:1": True}
    assert tf.tf32 is False


def test_prepare_gpus_refuses_a_gpu_tensorflow_already_reserved(gpu):
    gpu(tf=FakeTF(initialised=True, growth=False))
    with pytest.raises(devices.GPUMemoryReserved, match="TF_FORCE_GPU_ALLOW_GROWTH=true") as err:
        devices.prepare_gpus()
    assert "set_memory_growth" in str(err.value)


@pytest.mark.parametrize("case", ["growth already on", "env growth", "memory limit"])
def test_prepare_gpus_accepts_an_initialised_gpu_that_cannot_take_it_all(gpu, monkeypatch, case):
    limit = [LogicalDeviceConfiguration(memory_limit=1024)]
    configs = {"/physical_device:GPU:0": limit} if case == "memory limit" else {}
    if case == "env growth":
        monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    gpu(tf=FakeTF(initialised=True, growth=case == "growth already on", configs=configs))
    devices.prepare_gpus()


def test_growth_turned_off_in_the_environment_is_refused(gpu, monkeypatch):
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")
    gpu(tf=FakeTF())
    with pytest.raises(devices.GPUMemoryReserved, match="TF_FORCE_GPU_ALLOW_GROWTH=false"):
        devices.prepare_gpus()


def test_no_gpu_sets_only_tf32(gpu):
    tf, _ = gpu(tf=FakeTF(gpus=0))
    devices.prepare_gpus()
    assert tf.tf32 is False


def test_load_model_sets_growth_and_tf32_before_tensorflow_touches_the_gpu(gpu):
    from worker.engine import InvalidRequest, load_model

    tf, _ = gpu(tf=FakeTF())
    with pytest.raises(InvalidRequest, match="model.path"):
        load_model("/nowhere/model")
    assert tf.loads == [{"growth": {"/physical_device:GPU:0": True}, "tf32": False}]


def test_load_model_refuses_when_tensorflow_already_holds_the_gpu(gpu):
    from worker.engine import load_model

    tf, _ = gpu(tf=FakeTF(initialised=True))
    with pytest.raises(devices.GPUMemoryReserved, match="memory growth"):
        load_model("/nowhere/model")
    assert tf.loads == []


def test_configure_devices_turns_tf32_off_when_tensorflow_is_imported(gpu):
    from contracts.settings import Settings
    from worker.main import configure_devices

    tf, _ = gpu(tf=FakeTF(gpus=2))
    configure_devices(Settings(gpu="1", malloc_arenas=0))
    assert tf.visible == [tf.gpus[1]]
    assert tf.growth["/physical_device:GPU:1"] is True and tf.tf32 is False
