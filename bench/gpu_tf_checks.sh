#!/usr/bin/env bash
# TensorFlow on a lent GPU machine (docs/BENCHMARKS.md, "GPU: TensorFlow on an H100"). That machine reaches no
# package index and a call carries 64 MiB, so TensorFlow travels in parts made by bench/gpu_carry.py (stripped of
# symbol tables, headers and the profiler plugin; CUDA kernels for sm_90 alone, the other architectures' zeroed
# in place; xz): earlier calls copy the parts to /tmp/parts and unpack them into /tmp/site (see bench/gpu_carry.py).
# TensorFlow 2.21 is built for CUDA 12; the machine's CUDA libraries are CUDA 13's (PyTorch's wheels). The CUDA 12
# runtime travels (3.5 MB); cuBLAS, cuFFT, cuSOLVER, cuSPARSE and cuDNN are the machine's, under the names
# TensorFlow opens (libcublas.so.12 -> libcublas.so.13, ...). Then: a smoke test, bench/bench_gpu.py (GPU_ARGS, e.g.
# "--skip-tape --jobs 2"), bench/bench_gpu_kinds.py (KINDS_ARGS, e.g. --skip-kinds), and bench_cold over COLD_MODELS
# (default mobilenet_softmax). Logs and JSON to $OUT. STAGES="smoke gpu kinds cold" (default all). The machine goes
# back 30 s after a call: issue the calls back to back.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
log() { echo "[gpu_tf_checks] $*" | tee -a "$OUT/steps.log"; }

if [ ! -d /tmp/site/tensorflow ]; then
  log "unpacking TensorFlow from /tmp/parts"; mkdir -p /tmp/site
  cat /tmp/parts/tfpart.* | xz -d -T0 | tar x -C /tmp/site || exit 3
fi
if [ ! -d /tmp/site/pydantic ]; then
  log "installing the carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .gpucarry/whl/*.whl | grep -v nvidia_cuda_runtime) || exit 3
  mkdir -p /tmp/cudart12 && python3 -m zipfile -e .gpucarry/whl/nvidia_cuda_runtime_cu12-*.whl /tmp/cudart12
fi
LIBS=$(python3 - <<'PY'
import glob, os, re
import nvidia
libs = {}
for root in nvidia.__path__:
    for f in glob.glob(root + "/**/lib*.so*", recursive=True):
        libs.setdefault(os.path.basename(f), f)
dirs = sorted({os.path.dirname(f) for f in libs.values()})
os.makedirs("/tmp/cuda12", exist_ok=True)
for want in ["libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11", "libcusolver.so.11", "libcusparse.so.12",
             "libcudnn.so.9", "libnvJitLink.so.12", "libcurand.so.10", "libcupti.so.12", "libnvrtc.so.12",
             "libnccl.so.2"]:
    prefix = want.rsplit(".", 1)[0] + "."
    have = sorted((n for n in libs if re.fullmatch(re.escape(prefix) + r"\d+", n)), key=lambda n: int(n.rsplit(".", 1)[1]))
    link = "/tmp/cuda12/" + want
    if want not in libs and have and not os.path.lexists(link):
        os.symlink(libs[have[-1]], link)
print(":".join(["/tmp/cuda12", "/tmp/cudart12/nvidia/cuda_runtime/lib"] + dirs))
PY
)
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/site:$PWD
ls -la /tmp/cuda12 >> "$OUT/steps.log"
STAGES=${STAGES:-smoke gpu kinds cold}

if [[ " $STAGES " == *" smoke "* ]]; then
  log "smoke"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv; nproc; python3 --version; } \
    > "$OUT/machine.log" 2>&1
  TF_CPP_MIN_LOG_LEVEL=0 timeout 180 python3 - <<'PY' > "$OUT/smoke.log" 2>&1
import time
t0 = time.perf_counter()
import numpy as np
import tensorflow as tf
print("import", round(time.perf_counter() - t0, 2), "s; tf", tf.__version__, "numpy", np.__version__, flush=True)
info = tf.sysconfig.get_build_info()
print({k: info.get(k) for k in ("cuda_version", "cudnn_version", "cuda_compute_capabilities")}, flush=True)
gpus = tf.config.list_physical_devices("GPU")
print("GPUs", gpus, flush=True)
if not gpus:
    raise SystemExit(4)
print(tf.config.experimental.get_device_details(gpus[0]), flush=True)
tf.config.experimental.enable_tensor_float_32_execution(False)
rng = np.random.default_rng(0)
a = rng.standard_normal((512, 512)).astype("float32")
with tf.device("GPU:0"):
    r = tf.matmul(a, a).numpy()
print("matmul max err vs numpy", float(np.abs(r - a @ a).max()), flush=True)
x = rng.standard_normal((2, 32, 32, 8)).astype("float32")
k = rng.standard_normal((3, 3, 8, 16)).astype("float32")
with tf.device("GPU:0"):
    g = tf.nn.conv2d(x, k, 1, "SAME").numpy()
    d = tf.nn.depthwise_conv2d(x, k[..., :1], [1, 1, 1, 1], "SAME").numpy()
with tf.device("CPU:0"):
    c = tf.nn.conv2d(x, k, 1, "SAME").numpy()
    dc = tf.nn.depthwise_conv2d(x, k[..., :1], [1, 1, 1, 1], "SAME").numpy()
print("conv2d max err GPU vs CPU", float(np.abs(g - c).max()), "depthwise", float(np.abs(d - dc).max()), flush=True)
print("memory info", tf.config.experimental.get_memory_info("GPU:0"), flush=True)
PY
  rc=$?; log "smoke rc=$rc"; tail -5 "$OUT/smoke.log"
  [ $rc -eq 0 ] || exit 4
fi
if [[ " $STAGES " == *" gpu "* ]]; then
  log "bench_gpu"; timeout ${GPU_TIMEOUT:-300} python3 -m bench.bench_gpu --repeats 5 --loop-rows 20 ${GPU_ARGS:-} --out "$OUT" \
    > "$OUT/bench_gpu.log" 2>&1; log "bench_gpu rc=$?"; grep -v -E '^(I|W)0000|^WARNING' "$OUT/bench_gpu.log" | tail -40
fi
if [[ " $STAGES " == *" kinds "* ]]; then
  log "bench_gpu_kinds"; timeout ${KINDS_TIMEOUT:-240} python3 -m bench.bench_gpu_kinds ${KINDS_ARGS:-} --out "$OUT" \
    > "$OUT/kinds.log" 2>&1; log "kinds rc=$?"; grep '^{' "$OUT/kinds.log" | cut -c1-600; tail -3 "$OUT/kinds.log"
fi
if [[ " $STAGES " == *" cold "* ]]; then
  for model in ${COLD_MODELS:-mobilenet_softmax}; do
    log "bench_cold $model"; timeout ${COLD_TIMEOUT:-300} python3 -m bench.bench_cold --model "$model" --runs 1 \
      ${COLD_ARGS:---jax} --out "$OUT" > "$OUT/cold_$model.log" 2>&1; rc=$?; log "cold $model rc=$rc"
    grep -E '^  (run|ratio|check)=' "$OUT/cold_$model.log" | cut -c1-400
    [ $rc -eq 0 ] || grep -v -E '^(I|W|E)0000|^WARNING|^ ' "$OUT/cold_$model.log" | tail -15   # why it failed
  done
fi
