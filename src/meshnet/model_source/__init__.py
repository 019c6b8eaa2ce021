"""Models by reference: ``hf:ORG/REPO[:QUANT]``, ``hf:ORG/REPO/FILE``, ``https://`` URLs.

- ``reference`` parses what users write; ``quant`` picks a quantization's file(s);
  ``remote`` locates them through ``huggingface_hub``; ``ranged`` reads byte ranges
  with bounded retries.
- ``whole``: a reference as one local file (``generate``, ``bench``, the verifier).
- ``tracker_source``: the tracker reads the file once as a stream and keeps its
  header, its small shared tensors and the manifest of per-tensor hashes.
- ``shard_store``: a node fetches only the tensors of its layer range, checked
  against the signed manifest, into a sparse GGUF it reopens after a restart.
"""
