"""One settings object for API, worker and CLI, read from ``JACOBIAN_*`` environment variables."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.quotas import QuotaLimits
from contracts.webhook_allow import WebhookAllow
from contracts.webhooks import parse_secret

_DEFAULT_HOME = Path.cwd() / "var"


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class ApiKey(BaseModel):
    """One API key of ``JACOBIAN_API_KEYS``: the bearer ``key``, the ``name`` records and logs use instead
    of it (default ``key-`` and 8 hex digits of its SHA-256), and the ``webhook_secret`` its jobs' webhooks
    are signed with (``whsec_<base64>``; none: its jobs cannot ask for ``notify``), and ``quotas`` overriding
    the ``JACOBIAN_QUOTA_*`` defaults for it (``contracts.quotas.QuotaLimits``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str = Field(min_length=1)
    name: str = ""
    webhook_secret: str | None = None
    quotas: QuotaLimits | None = None

    @model_validator(mode="after")
    def _check(self) -> ApiKey:
        if not self.name:
            object.__setattr__(self, "name", "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:8])
        if self.webhook_secret is not None:
            parse_secret(self.webhook_secret, field=f"JACOBIAN_API_KEYS: key {self.name!r}: webhook_secret")
        return self


def _api_keys(value: object) -> object:
    """``JACOBIAN_API_KEYS`` as comma-separated keys, or JSON: a list of keys and ``{"key", "name",
    "webhook_secret"}`` objects."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"JACOBIAN_API_KEYS: starts with '[' but is not JSON ({exc}); give comma-separated "
                             'keys or a JSON list such as [{"key": "...", "webhook_secret": "whsec_..."}]') from None
    value = _split_csv(value)
    if isinstance(value, list):
        return [{"key": item} if isinstance(item, str) else item for item in value]
    return value


class Settings(BaseSettings):
    """Every knob of the service; units are in the names."""

    model_config = SettingsConfigDict(env_prefix="JACOBIAN_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    results_url: str = str(_DEFAULT_HOME / "results")
    model_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [str(_DEFAULT_HOME / "models")], description="folders and s3://bucket/prefix "
        "entries under which model paths are allowed (comma-separated)")
    api_keys: Annotated[list[ApiKey], NoDecode] = Field(
        default_factory=list, description="accepted bearer keys: comma-separated, or a JSON list of keys and "
        '{"key", "name", "webhook_secret", "quotas"} objects; empty: no auth')
    memory_budget_bytes: int | None = None
    precision_probes: int = Field(3, ge=0, le=64, description="float64 probes of every result's error estimate "
                                  "(README 'Precision'); 0: no estimate, and precision 'auto' warns that it could "
                                  "not check")
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
    webhook_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts (hooks.example.com, *.example.com), IP addresses and CIDR "
        "networks webhooks may go to; empty: webhooks off (see contracts/webhook_allow.py)")
    webhook_secret: str | None = Field(None, description="whsec_<base64> secret webhooks are signed with when "
                                       "no API keys are set")
    webhook_timeout_s: float = Field(10.0, gt=0, description="one delivery attempt's limit (connect and answer)")
    webhook_retry_base_s: float = Field(5.0, gt=0, description="delay after the first failed attempt; doubled "
                                        "after each further one (with jitter), up to webhook_retry_max_s")
    webhook_retry_max_s: float = Field(3600.0, gt=0, description="the longest delay between two attempts")
    webhook_retry_window_s: float = Field(24 * 3600.0, gt=0, description="a delivery is retried until this long "
                                          "after it was first due, then given up")
    webhook_progress_s: float = Field(10.0, ge=0, description="at most one 'progress' delivery per job this often "
                                      "(0: one per new row count the notifier reads)")
    notifier_poll_s: float = Field(0.5, gt=0, description="how often the notifier reads the jobs it watches and "
                                   "the outbox")
    notifier_concurrency: int = Field(8, ge=1, description="deliveries a notifier process makes at once")
    quota_max_concurrent: int | None = Field(None, ge=0, description="jobs of one API key queued or running at "
                                             "once; beyond: 429 (unset: no limit)")
    quota_max_queued: int | None = Field(None, ge=0, description="jobs of one API key waiting for a worker")
    quota_max_result_bytes_per_day: int | None = Field(None, ge=0, description="result bytes of one API key's "
                                                       "jobs that succeeded in a UTC day")
    quota_requests_per_s: float | None = Field(None, gt=0, description="requests of one API key per second "
                                               "(token bucket)")
    quota_burst: int | None = Field(None, ge=1, description="the token bucket's size (default: the rate rounded up)")
    log_format: str = Field("json", description="json (one object a line), text, or none (logging left alone)")
    log_level: str = Field("INFO", description="the root logger's level")
    malloc_arenas: int = Field(2, ge=0, description="glibc malloc arenas of a worker (0: glibc's default)")

    @field_validator("model_roots", "keras_unsafe_roots", "webhook_allow", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, value: object) -> object:
        return _api_keys(value)

    @field_validator("api_keys")
    @classmethod
    def _unique_names(cls, keys: list[ApiKey]) -> list[ApiKey]:
        names = [k.name for k in keys]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"JACOBIAN_API_KEYS: the name {twice[0]!r} is given to two keys; name each key once")
        return keys

    @field_validator("webhook_allow")
    @classmethod
    def _allow(cls, value: list[str]) -> list[str]:
        WebhookAllow.parse(value)  # a malformed entry fails at start, not at the first POST
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        if value:
            parse_secret(value, field="JACOBIAN_WEBHOOK_SECRET")
        return value or None

    @property
    def api_key_values(self) -> list[str]:
        """The bearer keys alone."""
        return [k.key for k in self.api_keys]

    def quota_limits(self, api_key: ApiKey | None) -> QuotaLimits:
        """The limits of ``api_key`` (None: the anonymous bucket): the ``quota_*`` defaults, then its overrides."""
        defaults = QuotaLimits(max_concurrent=self.quota_max_concurrent, max_queued=self.quota_max_queued,
                               max_result_bytes_per_day=self.quota_max_result_bytes_per_day,
                               requests_per_s=self.quota_requests_per_s, burst=self.quota_burst)
        return defaults.overridden(api_key.quotas if api_key is not None else None)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; tests call ``get_settings.cache_clear()``)."""
    return Settings()
