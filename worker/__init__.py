"""rq workers: task wiring, model cache, storage writer; ``worker.engine`` is the pure math."""
