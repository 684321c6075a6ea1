"""Devices before and after TensorFlow starts, from the settings: one GPU pinned, malloc arenas capped, growth on
and TensorFloat-32 off. Its own module so that ``jacobian compute`` sets devices up without importing the worker's
queue (``worker.main`` imports redis and rq: 0.07 s of a process whose import and load take 2-3 s)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contracts.settings import Settings

log = logging.getLogger(__name__)


def configure_devices(settings: Settings) -> None:
    """Pin one GPU (``settings.gpu``, an index), cap malloc arenas (``settings.malloc_arenas``), turn on
    memory growth and turn off TensorFloat-32; call before TF starts.

    Before TensorFlow is imported: ``CUDA_VISIBLE_DEVICES`` and ``TF_FORCE_GPU_ALLOW_GROWTH=true`` (unless
    set), and ``load_model`` turns TF32 off when it imports TensorFlow. After: ``tf.config.set_visible_devices``
    and ``worker.engine.devices.prepare_gpus``. Errors from an initialised runtime are logged, not raised
    (``load_model`` raises them again, as the job's error).
    """
    import sys

    from worker.engine.errors import EngineError
    from worker.engine.memory import limit_malloc_arenas

    limit_malloc_arenas(settings.malloc_arenas)
    gpu = settings.gpu
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if gpu is not None and "tensorflow" not in sys.modules:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        return
    if "tensorflow" not in sys.modules:
        return
    import tensorflow as tf

    from worker.engine.devices import prepare_gpus

    try:
        gpus = tf.config.list_physical_devices("GPU")
        if gpu is not None and gpus:
            tf.config.set_visible_devices(gpus[int(gpu)], "GPU")
    except (RuntimeError, IndexError, ValueError) as err:
        log.warning("JACOBIAN_GPU=%s could not be applied: %s", gpu, err)
    try:
        prepare_gpus()
    except EngineError as err:
        log.warning("%s", err)
