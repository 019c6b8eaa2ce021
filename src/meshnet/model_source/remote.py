"""Find the file(s) a reference names, through ``huggingface_hub`` (never a hand-written client).

``locate`` asks the hub for the repository's files (``HfApi.model_info`` with
their sizes and LFS sha256s), picks the file(s) (``quant.pick_files``) and
returns where to read them, pinned to the commit it saw. A plain URL is asked
for its size and ETag with ``get_hf_file_metadata``. A file or URL that names a part
of a split GGUF (``-0000K-of-0000N.gguf``) names all its parts. The hub's errors become
typed ones: a missing repository, revision, file or quantization is
``ModelRefNotFound`` naming the model files there are; no answer is
``FetchFailed``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshnet.errors import FetchFailed, ModelRefNotFound, ModelSourceError
from meshnet.model.gguf_split import parse_split_name, split_fingerprint
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.quant import model_files, pick_files
from meshnet.model_source.reference import HubRef, ModelRef, UrlRef


@dataclass(frozen=True)
class RemoteFile:
    name: str  # the file's path in its repository, or a URL's last part
    url: str  # where its bytes are read (a hub URL pinned to a commit)
    size: int
    sha256: str | None  # the hub's LFS sha256; None for a plain URL
    etag: str | None


@dataclass(frozen=True)
class RemoteModel:
    ref: ModelRef
    files: tuple[RemoteFile, ...]  # one, or a split GGUF's parts in order
    commit: str | None  # the repository commit the URLs are pinned to

    @property
    def key(self) -> str:
        """What identifies these bytes for caching: the sha256s, else URLs and ETags."""
        return "\n".join(f.sha256 or f"{f.url}|{f.etag}|{f.size}" for f in self.files)

    @property
    def size(self) -> int:
        """Every file's bytes together."""
        return sum(f.size for f in self.files)

    @property
    def fingerprint(self) -> str | None:
        """The model's fingerprint from the hub's sha256s (``gguf_split.split_fingerprint``),
        known without reading a byte; None when the source gives no sha256 (a plain URL)."""
        shas = [f.sha256 for f in self.files]
        return split_fingerprint([s for s in shas if s]) if all(shas) else None


def hf_headers(model: RemoteModel, cfg: SourceConfig) -> dict[str, str]:
    """The headers of a read of ``model``: the hub's (token from ``HF_TOKEN`` or the login,
    user agent); a plain URL's without the token, which is the hub's only."""
    from huggingface_hub.utils import build_hf_headers

    token = None if isinstance(model.ref, HubRef) else False
    return dict(build_hf_headers(token=token, user_agent=cfg.user_agent))


def locate(ref: ModelRef, cfg: SourceConfig) -> RemoteModel:
    """Where the model ``ref`` names lives; typed errors as the module says."""
    import httpx2  # the hub's client: loaded by a process that asks the hub, not before
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        if isinstance(ref, UrlRef):
            return _locate_url(ref, cfg)
        return _locate_hub(ref, cfg)
    except ModelSourceError:
        raise
    except RepositoryNotFoundError:
        raise ModelRefNotFound(f"{ref}: no such repository (or no access: HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelRefNotFound(f"{ref}: no such revision") from None
    except RemoteEntryNotFoundError:
        raise ModelRefNotFound(f"{ref}: no such file") from None
    except OfflineModeIsEnabled:
        raise FetchFailed(f"{ref}: HF_HUB_OFFLINE is set and it is not fetched yet") from None
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        raise FetchFailed(f"{ref}: the source did not answer: {e}") from None


def _locate_hub(ref: HubRef, cfg: SourceConfig) -> RemoteModel:
    from huggingface_hub import HfApi, hf_hub_url

    info = HfApi(endpoint=cfg.endpoint, user_agent=cfg.user_agent).model_info(
        ref.repo, revision=ref.revision, files_metadata=True
    )
    siblings = {s.rfilename: s for s in info.siblings or []}
    if ref.filename is not None:
        if ref.filename not in siblings:
            there = ", ".join(model_files(siblings)) or "no .gguf file"
            raise ModelRefNotFound(f"{ref}: no such file in hf:{ref.repo} (files there: {there})")
        names = _all_parts(ref.filename, siblings, str(ref))
    else:
        names = pick_files(siblings, ref.quant, ref.repo)
    commit = info.sha or ref.revision
    files = []
    for name in names:
        s = siblings[name]
        url = hf_hub_url(ref.repo, name, revision=commit, endpoint=cfg.endpoint)
        sha = s.lfs.sha256 if s.lfs else None
        size = s.lfs.size if s.lfs else s.size
        if size is None:
            raise FetchFailed(f"{ref}: the hub gave no size for {name}")
        files.append(RemoteFile(name, url, int(size), sha, sha))
    return RemoteModel(ref, tuple(files), commit)


def _all_parts(name: str, there: Iterable[str], ref: str) -> tuple[str, ...]:
    """``name``, or all the parts of the split GGUF it is a part of, in order."""
    split = parse_split_name(name)
    if split is None:
        return (name,)
    parts = tuple(split.part(i) for i in range(split.count))
    missing = [p for p in parts if p not in there]
    if missing:
        raise ModelRefNotFound(f"{ref}: split GGUF parts missing: {', '.join(missing)}")
    return parts


def _locate_url(ref: UrlRef, cfg: SourceConfig) -> RemoteModel:
    from huggingface_hub import get_hf_file_metadata

    base, _, query = ref.url.partition("?")
    folder = base.rsplit("/", 1)[0]
    split = parse_split_name(ref.filename)
    names = [split.part(i) for i in range(split.count)] if split else [ref.filename]
    files = []
    for name in names:
        url = f"{folder}/{name}" + (f"?{query}" if query else "") if split else ref.url
        meta = get_hf_file_metadata(
            url, token=False, user_agent=cfg.user_agent, retry_on_errors=True
        )
        if meta.size is None:
            raise FetchFailed(f"{url}: the server gave no size (Content-Length)")
        files.append(RemoteFile(name, url, meta.size, None, meta.etag))
    return RemoteModel(ref, tuple(files), None)
