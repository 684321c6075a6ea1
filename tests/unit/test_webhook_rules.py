"""Webhooks without services: signatures against the reference verification, secrets, the allowlist, the retry
schedule, the request's ``notify`` and the API key settings, and when the notifier emits an event."""

from __future__ import annotations

import ipaddress
import random
import time

import pytest
from pydantic import ValidationError

from app.notifier import due_event
from contracts.jobspec import JobOptions, JobStatus
from contracts.jobstore import JobRecord
from contracts.settings import Settings
from contracts.webhook_allow import WebhookAllow, WebhookRefused
from contracts.webhooks import parse_secret, retry_delay_s, signed_headers
from tests.webhook_receiver import verify

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OTHER = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="


def test_signed_headers_verify_with_the_reference_and_nothing_else():
    body = b'{"type":"job.succeeded","data":{"id":"x"}}'
    now = int(time.time())
    headers = signed_headers(parse_secret(SECRET, field="s"), "msg_1", now, body)
    assert headers["webhook-id"] == "msg_1" and headers["webhook-timestamp"] == str(now)
    assert headers["webhook-signature"].startswith("v1,")
    assert verify(SECRET, headers, body)
    assert not verify(OTHER, headers, body)                                   # another key's secret
    assert not verify(SECRET, headers, body + b" ")                           # the body changed
    assert not verify(SECRET, {**headers, "webhook-id": "msg_2"}, body)       # another delivery's id
    assert not verify(SECRET, headers, body, now=now + 301)                   # a replay, too late


def test_the_standard_webhooks_example_signature():
    """The example of the Standard Webhooks specification (its secret, id, timestamp and payload)."""
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    headers = signed_headers(parse_secret(secret, field="s"), "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert headers["webhook-signature"] == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize("secret, words", [("abc", "does not start with 'whsec_'"),
                                           ("whsec_not base64!", "not valid base64"),
                                           ("whsec_YWJj", "decodes to 3 bytes")])
def test_malformed_secrets_are_refused_naming_the_field_and_how_to_make_one(secret, words):
    with pytest.raises(ValueError) as err:
        parse_secret(secret, field="JACOBIAN_WEBHOOK_SECRET")
    assert str(err.value).startswith("JACOBIAN_WEBHOOK_SECRET: ") and words in str(err.value)
    assert "os.urandom(32)" in str(err.value)


def test_api_keys_are_comma_separated_or_json_with_names_and_secrets():
    plain = Settings(api_keys="k1, k2")
    assert [k.key for k in plain.api_keys] == ["k1", "k2"] and plain.api_keys[0].name.startswith("key-")
    assert plain.api_key_values == ["k1", "k2"]
    rich = Settings(api_keys=f'[{{"key": "k1", "name": "team-a", "webhook_secret": "{SECRET}"}}, "k2"]')
    assert rich.api_keys[0].name == "team-a" and rich.api_keys[0].webhook_secret == SECRET
    assert rich.api_keys[1].webhook_secret is None
    with pytest.raises(ValidationError, match="webhook_secret: does not start with 'whsec_'"):
        Settings(api_keys='[{"key": "k1", "webhook_secret": "plain"}]')
    with pytest.raises(ValidationError, match="name 'a' is given to two keys"):
        Settings(api_keys='[{"key": "k1", "name": "a"}, {"key": "k2", "name": "a"}]')
    with pytest.raises(ValidationError, match="JACOBIAN_WEBHOOK_ALLOW: '10.0.0.0/33'"):
        Settings(webhook_allow="10.0.0.0/33")


def test_notify_is_checked_naming_the_field():
    assert JobOptions(notify={"url": "https://h.example.com/x"}).notify.events == ["succeeded", "failed", "canceled"]
    for notify, words in [({"url": "ftp://h.example.com/"}, "notify.url: 'ftp://h.example.com/' is not an http(s)"),
                          ({"url": "https://u:p@h.example.com/"}, "user:password@"),
                          ({"url": "https://h.example.com/", "events": ["done"]}, "notify.events.0"),
                          ({"url": "https://h.example.com/", "events": ["failed", "failed"]}, "twice"),
                          ({"url": "https://h.example.com/", "secret": "x"}, "notify.secret")]:
        with pytest.raises(ValidationError) as err:
            JobOptions(notify=notify)
        from app.errors import validation_message

        assert words in validation_message(err.value.errors()), validation_message(err.value.errors())


ALLOW = WebhookAllow.parse(["hooks.example.com", "*.corp.example", "127.0.0.1", "10.0.0.0/8", "169.254.10.1"])


@pytest.mark.parametrize("url", ["https://hooks.example.com/x", "https://a.b.corp.example:8443/",
                                 "http://127.0.0.1:9000/", "http://10.1.2.3/", "http://[::ffff:10.1.2.3]/",
                                 "http://169.254.10.1/"])
def test_allowed_urls(url):
    ALLOW.check_url(url, resolve=False)


@pytest.mark.parametrize("url, words", [
    ("https://evil.example.com/", "host 'evil.example.com' is not allowed"),
    ("https://corp.example/", "host 'corp.example' is not allowed"),      # the wildcard is its sub-domains only
    ("http://127.0.0.2/", "outside the networks allowed"),
    ("http://169.254.169.254/latest/meta-data/", "link-local or metadata"),
    ("http://[::ffff:169.254.169.254]/", "link-local or metadata"),
    ("http://[fd00:ec2::254]/", "link-local or metadata"),
    ("http://100.100.100.200/", "link-local or metadata"),
    ("http://0.0.0.0:8000/", "link-local or metadata"),
])
def test_refused_urls(url, words):
    with pytest.raises(WebhookRefused, match=words):
        ALLOW.check_url(url, resolve=False)


def test_everything_allowed_still_never_reaches_metadata_and_empty_means_off():
    everything = WebhookAllow.parse(["0.0.0.0/0", "::/0"])
    everything.check_url("http://203.0.113.9/", resolve=False)
    with pytest.raises(WebhookRefused, match="169.254.0.0/16"):
        everything.check_url("http://169.254.169.254/", resolve=False)
    with pytest.raises(WebhookRefused, match="fe80::/10"):
        everything.check_addresses("h", [ipaddress.ip_address("fe80::1")])
    with pytest.raises(WebhookRefused, match="webhooks are off on this service .JACOBIAN_WEBHOOK_ALLOW is empty"):
        WebhookAllow.parse([]).check_url("https://hooks.example.com/")


def test_a_listed_name_resolving_to_metadata_is_refused_at_delivery():
    with pytest.raises(WebhookRefused, match="'hooks.example.com' is 169.254.169.254"):
        ALLOW.check_addresses("hooks.example.com", [ipaddress.ip_address("203.0.113.9"),
                                                    ipaddress.ip_address("169.254.169.254")])
    with pytest.raises(WebhookRefused, match="resolves to no address"):
        ALLOW.check_addresses("hooks.example.com", [])
    ALLOW.check_addresses("hooks.example.com", [ipaddress.ip_address("203.0.113.9")])  # listed by name


def test_retry_delays_grow_exponentially_with_jitter_up_to_the_cap():
    rng = random.Random(0)
    for attempts in range(1, 30):
        full = min(3600.0, 5.0 * 2 ** (attempts - 1))
        delays = [retry_delay_s(attempts, base_s=5.0, max_s=3600.0, rng=rng) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full / 10  # jittered, not one value
    # the schedule: retried through 24 h in about 34 attempts (none more than an hour apart)
    elapsed, attempts = 0.0, 0
    while elapsed < 24 * 3600:
        attempts += 1
        elapsed += retry_delay_s(attempts, base_s=5.0, max_s=3600.0, rng=rng)
    assert 30 <= attempts <= 60


def _record(status: JobStatus, rows: int) -> JobRecord:
    return JobRecord(id="j", status=status, spec={}, created_at=0.0, progress={"rows_done": rows, "rows_total": 10})


def test_events_due():
    everything = {"succeeded", "failed", "canceled", "progress"}
    assert due_event(_record(JobStatus.queued, 0), {}, everything, now=100.0, progress_s=10) is None
    assert due_event(_record(JobStatus.running, 0), {}, everything, now=100.0, progress_s=10) is None
    event, seen, terminal = due_event(_record(JobStatus.running, 3), {}, everything, now=100.0, progress_s=10)
    assert (event, seen, terminal) == ("progress", {"status": "running", "rows": 3, "at": 100.0}, False)
    assert due_event(_record(JobStatus.running, 5), seen, everything, now=105.0, progress_s=10) is None  # too soon
    assert due_event(_record(JobStatus.running, 3), seen, everything, now=200.0, progress_s=10) is None  # no rows
    assert due_event(_record(JobStatus.running, 5), seen, everything, now=110.0, progress_s=10)[0] == "progress"
    assert due_event(_record(JobStatus.running, 5), {}, {"succeeded"}, now=100.0, progress_s=10) is None
    assert due_event(_record(JobStatus.failed, 5), seen, everything, now=101.0, progress_s=10)[::2] == ("failed", True)
    assert due_event(_record(JobStatus.canceled, 0), {}, {"succeeded"}, now=1.0, progress_s=10)[::2] == (None, True)
