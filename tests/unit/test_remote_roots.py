"""S3 model roots without the network: which URLs lie under which root (``storage.is_under``,
``remote_models.remote_root_of``), the per-root ops for a URL (``graph_scan.extra_ops``), and the path checks of
the API (``app.security.resolve_model_path``) and the worker (``worker.inputs.check_model_path``) on URLs."""

from __future__ import annotations

import pytest

from app.errors import ModelPathNotAllowed
from app.security import resolve_model_path
from contracts.graph_scan import extra_ops
from contracts.remote_models import bad_key, remote_root_of
from contracts.storage import is_under
from worker.inputs import ModelPathNotAllowed as WorkerPathNotAllowed
from worker.inputs import check_model_path

ROOTS = ["/srv/models", "s3://bucket/models/", "s3a://other/pub"]


@pytest.mark.parametrize(("path", "folder", "expected"), [
    ("s3://bucket/models/m", "s3://bucket/models", True),
    ("s3://bucket/models", "s3://bucket/models/", True),
    ("s3a://bucket/models/m/x", "s3://bucket/models", True),
    ("s3://bucket/models2/m", "s3://bucket/models", False),
    ("s3://bucket2/models/m", "s3://bucket/models", False),
    ("s3://bucket/models/m", "/srv/models", False),
    ("/srv/models/m", "s3://bucket/models", False),
    ("/srv/models/m", "/srv/models", True),
    ("/srv/models2", "/srv/models", False),
])
def test_is_under(path, folder, expected):
    assert is_under(path, folder) is expected


@pytest.mark.parametrize(("url", "root"), [
    ("s3://bucket/models/m", "s3://bucket/models"),
    ("s3://bucket/models/a/b.keras", "s3://bucket/models"),
    ("s3a://other/pub/m", "s3a://other/pub"),
    ("s3://bucket/modelsX/m", None),
    ("s3://bucket/models/a/../m", None),
    ("s3://bucket/models//m", None),
    ("s3://bucket/models/./m", None),
    ("/srv/models/m", None),
])
def test_remote_root_of(url, root):
    assert remote_root_of(url, ROOTS) == root


def test_bad_key():
    assert not bad_key("s3://b/a/b/c") and not bad_key("s3://b/a/b/")
    assert bad_key("s3://b/a/../c") and bad_key("s3://b//a") and bad_key("s3://b/./a")


def test_extra_ops_for_urls():
    allow = {"s3://bucket/models": ["PyFunc"], "s3://bucket/models/legacy": ["ReadFile"], "/srv/models": ["X"]}
    assert extra_ops("s3://bucket/models/legacy/m", allow) == (frozenset({"PyFunc", "ReadFile"}),
                                                               "s3://bucket/models/legacy")
    assert extra_ops("s3://bucket/models/m", allow) == (frozenset({"PyFunc"}), "s3://bucket/models")
    assert extra_ops("s3://bucket/other/m", allow) == (frozenset(), None)


@pytest.mark.parametrize(("path", "says"), [
    ("s3://bucket/elsewhere/m", "is outside the model roots"),
    ("s3://bucket/models/../m", "has an empty, '.' or '..' component"),
    ("s3://nobucket/models/m", "is outside the model roots"),
])
def test_api_refuses_urls_outside_the_s3_roots(path, says):
    with pytest.raises(ModelPathNotAllowed) as caught:
        resolve_model_path(path, ROOTS, field="model.path")
    message = str(caught.value)
    assert message.startswith(f"model.path: {path!r} {says}") and "'s3://bucket/models'" in message


def test_api_takes_a_url_under_an_s3_root_as_it_is():
    assert resolve_model_path("s3://bucket/models/m/", ROOTS) == "s3://bucket/models/m"


def test_url_model_path_with_only_local_roots_is_refused():
    with pytest.raises(ModelPathNotAllowed, match="is outside the model roots"):
        resolve_model_path("s3://bucket/models/m", ["/srv/models"])


def test_worker_checks_urls_against_the_s3_roots():
    assert check_model_path("s3://bucket/models/m/", ROOTS) == "s3://bucket/models/m"
    for path in ("s3://bucket/elsewhere/m", "s3://bucket/models/../x", "/srv/elsewhere"):
        with pytest.raises(WorkerPathNotAllowed, match="outside the allowed model roots"):
            check_model_path(path, ROOTS)
    with pytest.raises(WorkerPathNotAllowed):   # a local path is never under an S3 root
        check_model_path("/bucket/models/m", ["s3://bucket/models"])
