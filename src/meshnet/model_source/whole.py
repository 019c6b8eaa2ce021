"""A referenced model as one whole local file, for what reads every layer in one process
(``meshnet generate``, ``meshnet bench``, the tracker's verifier).

A hub file whose sha256 the hub gives (every LFS file) is fetched by ranges and
checked against that sha256 as it streams, then put in the hub's own cache, where
``hf_hub_download`` would (``hub_cache``: its layout, ``HF_TOKEN``, ``HF_ENDPOINT``;
with ``HF_HUB_OFFLINE`` the quantization is picked among the files already cached);
one without goes through ``hf_hub_download`` (nothing to check it against). A plain
URL is fetched by ranges into meshnet's cache, resumably (``NAME.partial``), and
renamed when whole (``download``). A split GGUF's parts are all fetched, side by
side; the path is its first part's, which the loader opens them by
(``model.gguf_split``).
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from meshnet.errors import FetchFailed, ModelRefNotFound
from meshnet.model_source.config import SourceConfig
from meshnet.model_source.download import download_file
from meshnet.model_source.files import store_dir
from meshnet.model_source.hub_cache import hub_cached_file
from meshnet.model_source.progress import OnBytes
from meshnet.model_source.quant import pick_files
from meshnet.model_source.reference import HubRef, UrlRef, is_reference, parse_ref
from meshnet.model_source.remote import RemoteFile, RemoteModel, hf_headers, locate


def local_model_path(text: str, cfg: SourceConfig, progress: OnBytes | None = None) -> Path:
    """``text`` as a local path: a path as it is, a reference fetched whole first."""
    if not is_reference(text):
        return Path(text)
    ref = parse_ref(text)
    if isinstance(ref, HubRef) and constants.is_offline_mode():
        return _cached_hub_file(ref, cfg)
    model = locate(ref, cfg)
    if isinstance(ref, UrlRef):
        return [_url_file(model, f, cfg, progress) for f in model.files][0]  # noqa: RUF015
    try:
        paths = [
            hub_cached_file(ref, model, f, cfg, progress)
            if f.sha256 is not None
            else Path(
                hf_hub_download(
                    ref.repo,
                    f.name,
                    revision=model.commit,
                    cache_dir=cfg.hf_cache,
                    endpoint=cfg.endpoint,
                    user_agent=cfg.user_agent,
                )
            )
            for f in model.files
        ]
    except HfHubHTTPError as e:
        raise FetchFailed(f"{ref}: {e}") from None
    return paths[0]


def _cached_hub_file(ref: HubRef, cfg: SourceConfig) -> Path:
    try:
        folder = Path(
            snapshot_download(
                ref.repo, revision=ref.revision, cache_dir=cfg.hf_cache, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        raise ModelRefNotFound(f"{ref}: HF_HUB_OFFLINE is set and it is not cached") from None
    names = [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
    if ref.filename is not None:
        chosen: tuple[str, ...] = (ref.filename,)
        if ref.filename not in names:
            raise ModelRefNotFound(f"{ref}: not in the cache (cached: {', '.join(names)})")
    else:
        chosen = pick_files(names, ref.quant, ref.repo)
    return folder / chosen[0]


def _url_file(
    model: RemoteModel, f: RemoteFile, cfg: SourceConfig, progress: OnBytes | None
) -> Path:
    path = store_dir(cfg, model) / f.name
    if not path.is_file():
        download_file(f, path, hf_headers(model, cfg), cfg, progress)
    return path
