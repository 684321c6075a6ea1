#!/usr/bin/env bash
# The checks that run on a lent GPU machine without TensorFlow (see docs/BENCHMARKS.md, "GPU"): the engine's
# NVML/CUDA-driver memory readings (bench/bench_gpu_nvml.py) and the JAX peer of bench_cold on the GPU, as whole
# processes. Needs the wheels in .whl/ (pydantic, keras and their needs for Python 3.12) and the weights and inputs
# in .gpu/ (written by bench/archs.py's build on the CPU). Writes its logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi; python3 --version; python3 -c "import tensorflow" 2>&1 | tail -1; nproc; } 2>&1 | tee "$OUT/machine.log"
python3 -m bench.bench_gpu_nvml --out "$OUT" 2>&1 | tee "$OUT/nvml.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/smi.log 2>&1 &
SMI=$!
for arch in ${ARCHS:-mobilenet_softmax mobilenet_softmax efficientnet transformer lstm conv1d}; do
  python3 - "$arch" <<'PY' 2>&1 | tee -a "$OUT/jax.log"
import json, resource, subprocess, sys, time
arch = sys.argv[1]
mark = sum(1 for _ in open("/tmp/smi.log"))
t0 = time.perf_counter()
p = subprocess.run([sys.executable, "bench/peer_jax_jacobian.py", arch, f".gpu/{arch}.weights.h5", f".gpu/{arch}.npz",
                    "/tmp/jac.npy"], capture_output=True, text=True)
wall = time.perf_counter() - t0
used = [int(v) for v in list(open("/tmp/smi.log"))[mark:] if v.strip().isdigit()]
line = (p.stdout.strip().splitlines() or [""])[-1]
print(json.dumps({"arch": arch, "rc": p.returncode, "wall_s": round(wall, 2),
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
                  "gpu_used_peak_mib": max(used, default=None), "peer": line,
                  "err": p.stderr.strip().splitlines()[-3:] if p.returncode else None}))
PY
done
kill $SMI
