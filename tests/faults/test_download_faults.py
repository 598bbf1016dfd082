"""A hostile download server: ETags are file names in the resume path, so only
hash-shaped ones are accepted and nothing is written outside the cache. Local server only."""

from __future__ import annotations

import pytest

from engine.artifacts.hub import HubError, download
from tests.fake_hub import FakeHub

REPO = "org/Hostile"

HOSTILE_ETAGS = [
    "../../x",
    "../../../escape",
    "/var/absolute",
    "a" * 63 + "/",
    "..",
    "not-a-hash",
    "G" * 64,  # hash length, not hex
    "",  # no ETag at all
]


@pytest.mark.parametrize("etag", HOSTILE_ETAGS)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])  # git file and LFS file
def test_hostile_etag_writes_nothing_outside_the_cache(tmp_path, etag, name):
    root = tmp_path / "root"
    cache = root / "a" / "b" / "cache"
    cache.mkdir(parents=True)
    with FakeHub() as hub:
        hub.repos[REPO] = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 4096}
        hub.etags[name] = etag
        with pytest.raises(HubError) as err:
            download(REPO, cache_dir=cache, endpoint=hub.endpoint)
    assert "\n" not in str(err.value) and name in str(err.value)
    outside = [p for p in root.rglob("*") if cache not in p.parents and p != cache and p not in cache.parents]
    assert outside == [], f"written outside the cache: {outside}"
    # And nothing inside it bears the hostile name.
    assert not [p for p in cache.rglob("*") if etag and etag.strip("/.") and etag.strip("/.") in p.name]


def test_hash_etags_still_download(tmp_path):
    with FakeHub() as hub:
        hub.repos[REPO] = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 4096}
        snap = download(REPO, cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
    assert (snap / "model.safetensors").read_bytes() == b"w" * 4096
