"""The S3 model cache's eviction rule (``worker.model_download.evictions``), pure: least recently used first, until
the rest fit; never an entry the caller keeps."""

from __future__ import annotations

from contracts.remote_models import RemoteObject
from worker.model_download import CachedEntry, content_key, evictions


def entries(*spec: tuple[str, int, float]) -> list[CachedEntry]:
    return [CachedEntry(key, size, used) for key, size, used in spec]


def test_nothing_removed_while_everything_fits():
    assert evictions(entries(("a", 40, 1.0), ("b", 60, 2.0)), limit_bytes=100) == []
    assert evictions([], limit_bytes=0) == []


def test_least_recently_used_go_first_until_the_rest_fit():
    cache = entries(("new", 50, 30.0), ("old", 50, 10.0), ("mid", 50, 20.0))
    assert evictions(cache, limit_bytes=100) == ["old"]
    assert evictions(cache, limit_bytes=50) == ["old", "mid"]
    assert evictions(cache, limit_bytes=0) == ["old", "mid", "new"]


def test_a_large_old_entry_alone_can_make_room():
    cache = entries(("big", 90, 1.0), ("a", 10, 2.0), ("b", 10, 3.0))
    assert evictions(cache, limit_bytes=30) == ["big"]


def test_kept_entries_stay_even_over_the_bound():
    cache = entries(("just-used", 80, 1.0), ("other", 30, 2.0))
    assert evictions(cache, limit_bytes=50, keep={"just-used"}) == ["other"]
    assert evictions(entries(("just-used", 80, 1.0)), limit_bytes=50, keep={"just-used"}) == []


def test_ties_in_last_use_go_by_key():
    cache = entries(("b", 10, 5.0), ("a", 10, 5.0), ("c", 10, 5.0))
    assert evictions(cache, limit_bytes=15) == ["a", "b"]


def test_content_key_changes_with_any_object_and_with_the_url():
    objects = [RemoteObject("saved_model.pb", 10, "e1"), RemoteObject("variables/variables.index", 5, "e2")]
    key = content_key("s3://b/m", objects)
    assert key == content_key("s3://b/m/", list(reversed(objects))) and len(key) == 32
    assert key != content_key("s3://b/m", [objects[0], RemoteObject("variables/variables.index", 5, "e3")])
    assert key != content_key("s3://b/m", [objects[0], RemoteObject("variables/variables.index", 6, "e2")])
    assert key != content_key("s3://b/other", objects)
