"""A job's ``notify`` checked at POST: the URL against ``JACOBIAN_WEBHOOK_ALLOW``, a secret to sign with."""

from __future__ import annotations

from app.errors import WebhookNotAllowed
from contracts.settings import ApiKey, Settings
from contracts.webhook_allow import WebhookAllow, WebhookRefused
from contracts.webhooks import Notify


def check_notify(notify: Notify | None, settings: Settings, api_key: ApiKey | None) -> None:
    """Refuse (``WebhookNotAllowed``, 403) a ``notify`` whose URL the allowlist does not allow (webhooks off
    when it is empty; an unlisted name is resolved and its addresses checked), or that no secret could sign:
    the API key's ``webhook_secret``, or ``JACOBIAN_WEBHOOK_SECRET`` when no keys are set."""
    if notify is None:
        return
    try:
        WebhookAllow.parse(settings.webhook_allow).check_url(notify.url)
    except WebhookRefused as exc:
        field = "notify.url" if str(exc).startswith("notify.url") else "notify"
        raise WebhookNotAllowed(str(exc), field=field) from None
    if settings.api_keys:
        if api_key is None or api_key.webhook_secret is None:
            name = api_key.name if api_key is not None else "?"
            raise WebhookNotAllowed(f"notify: the API key {name!r} has no webhook_secret to sign deliveries with; "
                                    "remove notify, or ask an operator to give the key one in JACOBIAN_API_KEYS "
                                    '([{"key": ..., "webhook_secret": "whsec_..."}])', field="notify")
    elif not settings.webhook_secret:
        raise WebhookNotAllowed("notify: no JACOBIAN_WEBHOOK_SECRET is set to sign deliveries with; remove notify, "
                                "or ask an operator to set it (whsec_ and base64 of 32 random bytes)", field="notify")
