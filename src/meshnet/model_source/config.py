"""Where fetched models go and how fetches behave: one frozen value, made at the entry point.

The hub's own settings (``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``,
``HF_HUB_CACHE``) are ``huggingface_hub``'s, read by it; ``endpoint`` and
``hf_cache`` here override them for one process's calls (tests run a hub of
their own in-process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "MESHNET_CACHE"


@dataclass(frozen=True)
class SourceConfig:
    cache_dir: Path  # meshnet's own: manifests, tracker headers, node shards, URL downloads
    client: str = "meshnet"  # named in the User-Agent as meshnet-client/CLIENT
    endpoint: str | None = None  # None: huggingface_hub's (HF_ENDPOINT or the public hub)
    hf_cache: Path | None = None  # None: huggingface_hub's cache (HF_HUB_CACHE)
    attempts: int = 5  # tries of one range (or one tensor whose hash failed) before giving up
    backoff_s: float = 0.5  # first wait between tries, doubling
    max_backoff_s: float = 8.0
    chunk_bytes: int = 8 << 20  # one range request; progress is kept per chunk
    timeout_s: float = 30.0  # per request read
    peer_wait_s: float = 60.0  # waiting on a peer still fetching a chunk, then the next source
    progress: bool = False  # draw a progress bar on stderr

    @property
    def user_agent(self) -> str:
        return f"meshnet-client/{self.client}"


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$MESHNET_CACHE``, else ``~/.cache/meshnet`` (``$XDG_CACHE_HOME/meshnet``)."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshnet"


def source_config(client: str = "meshnet", progress: bool = False) -> SourceConfig:
    """The config of a process run from the command line."""
    return SourceConfig(cache_dir=default_cache_dir(), client=client, progress=progress)
