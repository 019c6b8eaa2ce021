"""What a hub's listing names is checked before it names a path in the hub cache: a
sha256, a commit or a file name that would lead out of the repository's folder is a
typed error that writes nothing (``model_source.hub_cache``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnet.errors import ModelSourceError
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.hub_cache import hub_cached_file
from meshnet.model_source.reference import HubRef
from meshnet.model_source.remote import RemoteFile, RemoteModel

SHA = "ab" * 32
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("name", "sha", "commit"),
    [
        ("../../../evil.gguf", SHA, COMMIT),
        ("/abs/evil.gguf", SHA, COMMIT),
        ("a/./b.gguf", SHA, COMMIT),
        ("ok.gguf", "../../../evil", COMMIT),
        ("ok.gguf", SHA.upper()[:63], COMMIT),
        ("ok.gguf", SHA, "../../.."),
        ("ok.gguf", SHA, "main/../../.."),
    ],
)
def test_a_listing_naming_a_path_outside_the_repository_is_refused(
    tmp_path: Path, name: str, sha: str, commit: str
) -> None:
    ref = HubRef("org/repo", quant="Q4_K_M")
    # Nothing listens on port 9: any read would fail, but none is tried.
    f = RemoteFile(name, "http://127.0.0.1:9/x", 10, sha, sha)
    model = RemoteModel(ref, (f,), commit)
    cfg = SourceConfig(cache_dir=tmp_path / "meshnet", hf_cache=tmp_path / "hf", attempts=1)
    with pytest.raises(ModelSourceError) as refused:
        hub_cached_file(ref, model, f, cfg, None)
    assert type(refused.value) is ModelSourceError
    assert list(tmp_path.rglob("*")) == []
