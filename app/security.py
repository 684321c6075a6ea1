"""Model paths confined to the allowed roots, and optional bearer API keys compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path, PurePath

from app.errors import InvalidApiKey, InvalidRequest, ModelNotFound, ModelPathNotAllowed
from contracts.savedmodel import SAVED_MODEL_FILE


def _roots_text(roots: Sequence[Path]) -> str:
    return ", ".join(repr(str(r)) for r in roots) or "(none configured: set JACOBIAN_MODEL_ROOTS)"


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_model_path(path: str, roots: Sequence[str], *, field: str = "model.path") -> Path:
    """The real path of a model directory, guaranteed to lie under one of ``roots``.

    ``path`` is absolute, or relative to the roots (tried in order; the first that exists wins).
    Symlinks are resolved before the check, so a link inside a root that points outside it is
    refused like any other escape. Raises ``ModelPathNotAllowed`` for ``..`` components, absolute
    paths outside the roots and symlink escapes, ``InvalidRequest`` for an empty or NUL path.
    Existence is not checked here (see ``require_saved_model``).
    """
    if not path or "\x00" in path:
        raise InvalidRequest(f"{field}: give the SavedModel directory as a non-empty path", field=field)
    real_roots = [Path(r).expanduser().resolve() for r in roots]
    hint = f"give a path under one of the model roots: {_roots_text(real_roots)}"
    pure = PurePath(path)
    if ".." in pure.parts:
        raise ModelPathNotAllowed(f"{field}: {path!r} contains '..', which is not allowed; {hint}", field=field)
    if not real_roots:
        raise ModelPathNotAllowed(f"{field}: no model roots are configured; set JACOBIAN_MODEL_ROOTS", field=field)
    candidates = [Path(pure)] if pure.is_absolute() else [root / pure for root in real_roots]
    allowed: list[Path] = []
    escaped = False
    for cand in candidates:
        try:
            real = cand.resolve()
        except (OSError, RuntimeError):  # a symlink loop, or a component we may not read
            raise ModelNotFound(f"{field}: {path!r} cannot be resolved (symbolic link loop?); {hint}",
                                field=field) from None
        if _under(real, real_roots):
            allowed.append(real)
        elif _under(cand, real_roots) or not pure.is_absolute():
            escaped = True
    if not allowed:
        if escaped:
            raise ModelPathNotAllowed(
                f"{field}: {path!r} resolves (through a symbolic link) to a directory outside the "
                f"model roots; {hint}", field=field)
        raise ModelPathNotAllowed(f"{field}: {path!r} is outside the model roots; {hint}", field=field)
    for real in allowed:
        if real.exists():
            return real
    return allowed[0]


def require_saved_model(model_dir: Path, *, field: str = "model.path") -> Path:
    """``model_dir`` if it holds a ``saved_model.pb``; raises ``ModelNotFound`` otherwise."""
    if not (model_dir / SAVED_MODEL_FILE).is_file():
        what = "does not exist" if not model_dir.exists() else f"has no {SAVED_MODEL_FILE}"
        raise ModelNotFound(f"{field}: {str(model_dir)!r} {what}; give the directory of a SavedModel "
                            "(the one that holds saved_model.pb)", field=field)
    return model_dir


def check_api_key(authorization: str | None, keys: Sequence[str]) -> None:
    """Accept ``Authorization: Bearer <key>`` for a configured key; no keys configured means no auth.

    Each configured key is compared with ``hmac.compare_digest`` (all of them, always), so the
    time taken does not reveal how much of a key matched. Raises ``InvalidApiKey``.
    """
    if not keys:
        return
    if not authorization:
        raise InvalidApiKey("Authorization: header missing; send 'Authorization: Bearer <api key>'",
                            field="Authorization")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise InvalidApiKey("Authorization: expected 'Bearer <api key>'", field="Authorization")
    given = token.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise InvalidApiKey("Authorization: unknown API key; ask an operator for a key in JACOBIAN_API_KEYS",
                            field="Authorization")
