"""Memory probes for engine tests: TensorFlow's real CPU probe with what a test must control injected.

Planning tests read ``per_row`` bytes a row, as allocator statistics that are on would: TensorFlow 2.21 keeps
none on the CPU (the real probe reads 0), and a host job's chunks are then measured by the process's RSS delta,
which varies 2x from job to job in a process that has run other tests (CI planned 64 rows for one job and 128
for the next, read 13.5 MiB under a 12 MiB budget). A ``per_row`` reading at or above a row's result bytes is
the job's measure: the RSS delta is not taken (``worker.engine.host_peak.HostPeaks``)."""

from __future__ import annotations

from worker.engine import TFMemoryProbe


def oom(kind: str = "resource"):
    import tensorflow as tf

    if kind == "cublas":
        return tf.errors.InternalError(None, None, "Blas xGEMM launch failed: CUBLAS_STATUS_ALLOC_FAILED")
    return tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[4096,512]")


class Probe(TFMemoryProbe):
    """The real CPU probe; OOMs above ``oom_above_rows`` rows or while ``failing``; ``is_gpu`` as told;
    ``free_bytes`` as told; the first ``blind_chunks`` peaks read 0; with ``per_row`` the others read
    ``fixed + per_row * rows`` bytes (allocator statistics that are on)."""

    def __init__(self, *, oom_above_rows: int | None = None, is_gpu: bool = False, free_bytes: int | None = None,
                 blind_chunks: int = 0, per_row: int | None = None, fixed: int = 0):
        super().__init__("CPU:0")
        self.oom_above_rows, self.failing, self._gpu, self._free = oom_above_rows, None, is_gpu, free_bytes
        self.blind_chunks = blind_chunks  # the next chunks' peaks read 0, as memory the statistics miss
        self.per_row, self.fixed = per_row, fixed
        self.chunks: list[int] = []

    def peak_bytes(self) -> int:
        if self.blind_chunks > 0:
            self.blind_chunks -= 1
            return 0
        return self.fixed + self.per_row * self.chunks[-1] if self.per_row is not None else super().peak_bytes()

    @property
    def is_gpu(self) -> bool:
        return self._gpu

    def free_bytes(self) -> int:
        return self._free if self._free is not None else super().free_bytes()

    def before_chunk(self, rows: int) -> None:
        self.chunks.append(rows)
        if self.failing or (self.oom_above_rows is not None and rows > self.oom_above_rows):
            raise oom(self.failing or "resource")
