"""One settings object for API, worker and CLI, read from ``JACOBIAN_*`` environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_DEFAULT_HOME = Path.cwd() / "var"


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Every knob of the service; units are in the names."""

    model_config = SettingsConfigDict(env_prefix="JACOBIAN_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    results_url: str = str(_DEFAULT_HOME / "results")
    model_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [str(_DEFAULT_HOME / "models")], description="folders and s3://bucket/prefix "
        "entries under which model paths are allowed (comma-separated)")
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    memory_budget_bytes: int | None = None
    queue_name: str = "jacobian"
    max_body_bytes: int = 256 * 1024 * 1024
    max_json_body_bytes: int = Field(4 * 1024 * 1024, description="a JSON body costs 8 to 25 times its size "
                                     "while parsed: larger inputs go as an .npz body or inputs_uri")
    max_input_elements: int = 64 * 1024 * 1024
    body_read_timeout_s: float = Field(30.0, gt=0, description="a request body that sends nothing for this long "
                                       "is answered 408")
    max_input_bytes: int = Field(512 * 1024 * 1024, description="bytes of all input tensors of a job together, "
                                 "decoded (itemsize x elements), however they are sent")
    max_result_bytes: int = 1 << 40
    job_timeout_s: int = Field(24 * 3600, ge=1, description="a job's wall-clock limit (seconds) when its request "
                               "sets no timeout_s")
    max_job_timeout_s: int = Field(7 * 24 * 3600, ge=1, description="the largest timeout_s a request may ask for")
    job_max_worker_deaths: int = Field(2, ge=1, description="a job whose worker died this many times while running "
                                       "it fails as WorkerDied instead of running again")
    result_ttl_s: int = 7 * 24 * 3600
    job_retries: int = 2
    worker_heartbeat_s: int = Field(10, ge=1, description="worker heartbeat interval while a job runs")
    worker_heartbeat_ttl_factor: int = Field(3, ge=2, description="a job's heartbeat expires after this many "
                                             "missed intervals: its worker is then taken for dead")
    worker_maintenance_s: int = Field(15, ge=1, description="how often an idle worker cleans rq's registries "
                                      "(requeues jobs of dead workers, enqueues due retries)")
    worker_metrics_port: int | None = None
    gpu: str | None = Field(None, description="GPU index this worker pins (sets CUDA_VISIBLE_DEVICES)")
    block_bytes: int | None = Field(None, description="target bytes per Zarr storage chunk (default 32 MiB)")
    shard_min_seconds: float = Field(10.0, ge=0, description="least estimated compute per shard when a job is "
                                     "split automatically")
    model_cache_size: int = 4
    max_model_read_bytes: int = Field(256 * 1024 * 1024, ge=1, description="the most the API reads of a model "
                                      "under an S3 root to check it: its saved_model.pb, or a .keras file's "
                                      "config.json (422 above)")
    model_download_cache_bytes: int = Field(20 * 1024 ** 3, ge=1, description="size bound of a worker's local "
                                            "copies of models under S3 roots (JACOBIAN_CACHE_DIR/models): the "
                                            "least recently used are removed beyond it; a larger model is refused")
    model_op_allow: dict[str, list[str]] = Field(
        default_factory=dict, description="graph ops allowed beyond contracts/op_allowlist.txt, per model root "
        "(or any folder or s3:// prefix: a model gets the ops of every one it lies in), as JSON: "
        "'{\"/srv/models/legacy\": [\"PyFunc\"]}'; see docs/MODEL_SAFETY.md")
    keras_custom_objects: str | None = Field(None, description="an importable module whose CUSTOM_OBJECTS dict "
                                             "(or whose classes registered with keras.saving."
                                             "register_keras_serializable) .keras models may use")
    keras_unsafe_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="folders (or s3:// prefixes) whose .keras files load with "
        "safe_mode=False (Lambda layers allowed: they run arbitrary Python code); see docs/MODEL_SAFETY.md")
    try_xla: bool = Field(True, description="let strategy trials try XLA variants")
    cache_dir: str | None = Field(None, description="folder for plans (default ~/.cache/jacobian); workers "
                                  "share plans through Redis and keep them here too")
    api_url: str = "http://127.0.0.1:8000"
    max_event_streams: int = Field(100, ge=0, description="open GET /v1/jobs/{id}/events streams per API process; "
                                   "beyond: 503 with Retry-After")
    event_poll_s: float = Field(0.5, gt=0, description="how often an event stream reads its job's record")
    event_heartbeat_s: float = Field(15.0, gt=0, description="a comment line after this long without an event "
                                     "keeps proxies from closing an event stream")
    log_format: str = Field("json", description="json (one object a line), text, or none (logging left alone)")
    log_level: str = Field("INFO", description="the root logger's level")
    malloc_arenas: int = Field(2, ge=0, description="glibc malloc arenas of a worker (0: glibc's default)")

    @field_validator("model_roots", "api_keys", "keras_unsafe_roots", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; tests call ``get_settings.cache_clear()``)."""
    return Settings()
