"""What a job reads before the engine runs: its inputs (``.npz``), its model path and its memory budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contracts import npz, storage
from contracts.settings import Settings


class InvalidInputs(ValueError):
    """``inputs_uri`` is missing or is not a readable ``.npz``."""


class ModelPathNotAllowed(PermissionError):
    """The model path resolves outside every configured model root."""


def effective_budget(job_bytes: int | None, operator_bytes: int | None) -> int | None:
    """The tighter of the job's ``memory_budget_bytes`` and the operator's cap (None: no cap)."""
    given = [b for b in (job_bytes, operator_bytes) if b]
    return min(given) if given else None


def load_inputs(uri: str, *, settings: Settings, field: str = "inputs_uri") -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` at ``uri`` (local path, ``file://`` or ``s3://``), read by
    ``contracts.npz``: headers checked against ``settings.max_input_bytes`` and ``max_input_elements`` first.

    Raises ``InvalidInputs`` (naming ``field``) when absent, unreadable or over a limit; other
    ``OSError`` when storage fails.
    """
    try:
        with storage.open_file(uri) as f:
            return npz.load(f, max_bytes=settings.max_input_bytes, max_elements=settings.max_input_elements)
    except (FileNotFoundError, IsADirectoryError) as err:
        raise InvalidInputs(f"{field}: {uri!r} does not exist; give the path or URL of an .npz file") from err
    except npz.NpzDtypeRefused as err:
        raise InvalidInputs(f"{field}: {uri!r}: input {err.name!r}: {err}") from err
    except npz.NpzTooLarge as err:
        raise InvalidInputs(f"{field}: {uri!r}: {err}; send smaller inputs or split the job") from err
    except npz.NpzError as err:
        raise InvalidInputs(f"{field}: {uri!r} is not a readable .npz ({err}); write it with numpy.savez") from err


def check_model_path(path: str, roots: list[str]) -> str:
    """``path`` resolved (an ``s3://`` URL: as it is); raises ``ModelPathNotAllowed`` unless it lies under one of
    ``roots`` (a URL: under an S3 root, ``contracts.remote_models.remote_root_of``)."""
    if storage.is_remote(path):
        from contracts.remote_models import remote_root_of

        if remote_root_of(path, roots) is not None:
            return storage.normalize(path)
    else:
        resolved = Path(path).expanduser().resolve()
        for root in roots:
            if not storage.is_remote(root) and resolved.is_relative_to(Path(root).expanduser().resolve()):
                return str(resolved)
    raise ModelPathNotAllowed(f"model.path: {path!r} is outside the allowed model roots; "
                              f"put the model under one of: {', '.join(roots) or '(none configured)'}")
