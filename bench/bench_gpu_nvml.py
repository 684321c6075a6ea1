"""The engine's GPU memory readings on a real GPU, where TensorFlow cannot run.

The device machines this project is lent have no TensorFlow and reach no package index, and TensorFlow's
GPU build (546 MiB) with its CUDA 12 libraries (about 2.7 GiB) is far over what a call may carry (64 MiB).
What does run there is everything below TensorFlow that the free-memory planner reads: the CUDA driver
(``devices.cuda_pci_bus_id``), NVML (``devices.nvml_handle`` by PCI bus id, index, UUID and UUID prefix,
the MIG probes) and ``TFMemoryProbe``'s free bytes, with TensorFlow stood in by a stub whose pool is empty.

It reads the free memory as the worker does, against ``nvidia-smi``, alone and while another process (PyTorch,
a plain ``cudaMalloc``) holds 85 % and then 97 % of it, and plans a chunk from each reading with
``plan_chunk`` and a fixed memory line (the one given by ``--fixed-mib``/``--row-mib``, not measured here).

Run (needs pynvml and a GPU; PyTorch for the other tenant):
    python -m bench.bench_gpu_nvml [--hold 0.85 0.97] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.bench_gpu import other_tenant
from worker.engine import devices, memory
from worker.engine.planner import LinearFit, plan_chunk

MIB = 1 << 20
HOG = r"""
import sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(int(float(sys.argv[1]) * free), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("HELD", held.numel(), torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()
"""


class StubGPU:
    name = "/physical_device:GPU:0"
    device_type = "GPU"


def stub_tensorflow() -> Any:
    """TensorFlow as ``TFMemoryProbe`` sees it with one visible GPU, memory growth on and an empty pool; no
    device details, so the PCI bus id comes from the CUDA driver, as it does when TensorFlow gives none."""
    def no_details(_gpu: Any) -> dict:
        raise ValueError("stub: no device details")
    experimental = SimpleNamespace(get_memory_info=lambda _d: {"current": 0, "peak": 0},
                                   get_memory_growth=lambda _g: True, get_device_details=no_details,
                                   reset_memory_stats=lambda _d: None)
    config = SimpleNamespace(get_visible_devices=lambda _k="GPU": [StubGPU()], list_logical_devices=lambda _k: [1],
                             get_logical_device_configuration=lambda _g: None, experimental=experimental)
    return SimpleNamespace(config=config)


def smi() -> dict[str, Any]:
    fields = "name,driver_version,memory.total,memory.used,memory.free,pci.bus_id,uuid"
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[0]
    name, driver, total, used, free, bus, uuid = (v.strip() for v in out.split(","))
    return {"name": name, "driver": driver, "total_mib": int(total), "used_mib": int(used),
            "free_mib": int(free), "pci_bus_id": bus, "uuid": uuid}


def lookups(nv: Any, truth: dict[str, Any]) -> dict[str, Any]:
    """Every way ``nvml_handle`` finds the device, each checked against nvidia-smi's UUID."""
    bus = devices.cuda_pci_bus_id(0)
    found: dict[str, Any] = {"cuda_pci_bus_id": bus}
    ways = {"pci_bus_id": dict(visible=None, bus_id=bus), "index": dict(visible=None, bus_id=None),
            "visible_index": dict(visible="0", bus_id=None),
            "uuid": dict(visible=truth["uuid"], bus_id=None),
            "uuid_prefix": dict(visible=truth["uuid"][:12], bus_id=None)}
    for way, kwargs in ways.items():
        try:
            handle, how = devices.nvml_handle(nv, 0, **kwargs)
            uuid = devices._text(nv.nvmlDeviceGetUUID(handle))
            found[way] = {"how": how, "uuid": uuid, "same_device": uuid == truth["uuid"]}
        except Exception as err:  # noqa: BLE001 - every failure is a finding to report
            found[way] = {"error": f"{type(err).__name__}: {err}"}
    parent = nv.nvmlDeviceGetHandleByIndex(0)
    try:
        found["mig_mode"] = list(nv.nvmlDeviceGetMigMode(parent))
    except nv.NVMLError as err:
        found["mig_mode"] = f"NVMLError: {err}"
    found["mig_devices"] = len(list(devices.mig_devices(nv, parent)))
    return found


def reading(probe: memory.TFMemoryProbe, line: LinearFit, rows: int) -> dict[str, Any]:
    start = time.perf_counter()
    free = probe.free_bytes()
    took = time.perf_counter() - start
    truth = smi()
    chunk = plan_chunk(rows_total=rows, memory=line, free_bytes=free, largest_timed_rows=4096)
    return {"probe_free_mib": free // MIB, "smi_free_mib": truth["free_mib"],
            "probe_minus_smi_mib": free // MIB - truth["free_mib"], "read_ms": round(took * 1e3, 3),
            "planned_chunk": chunk, "predicted_peak_mib": int(line(chunk)) // MIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, nargs="*", default=[0.85, 0.97])
    parser.add_argument("--fixed-mib", type=float, default=512.0)
    parser.add_argument("--row-mib", type=float, default=14.0, help="MobileNetV3Small's per row on a CPU")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()

    truth = smi()
    report: dict[str, Any] = {"gpu": truth, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    nv = devices.nvml()
    report["lookups"] = lookups(nv, truth)
    devices.tensorflow = stub_tensorflow  # type: ignore[assignment] - no TensorFlow on the device machine
    probe = memory.TFMemoryProbe("GPU:0")
    line = LinearFit(fixed=args.fixed_mib * MIB, per_row=args.row_mib * MIB)
    report["memory_line_mib"] = {"fixed": args.fixed_mib, "per_row": args.row_mib}
    report["readings"] = {"alone": reading(probe, line, args.rows)}
    for fraction in args.hold:
        with other_tenant(fraction, script=HOG) as (held, _free_after):
            report["readings"][f"held_{fraction}"] = {"held_mib": held // MIB, **reading(probe, line, args.rows)}
    time.sleep(1.0)
    report["readings"]["after"] = reading(probe, line, args.rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_nvml.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = all(v.get("same_device") for k, v in report["lookups"].items() if isinstance(v, dict))
    ok = ok and all(abs(r["probe_minus_smi_mib"]) <= 64 for r in report["readings"].values())
    print("CHECK", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
