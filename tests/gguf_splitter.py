"""Split a GGUF into parts as ``llama-gguf-split --split`` does, with ``gguf.GGUFWriter``.

The writer's own split support names the parts ``PREFIX-0000K-of-0000N.gguf`` and
writes llama.cpp's keys (``split.no``, ``split.count``, ``split.tensors.count``), every
other metadata value in the first part only. The tensors keep their order and bytes,
so the parts hold the model the file holds.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGUFValueType as VT


def split_gguf(src: Path, prefix: Path, max_tensors: int) -> list[Path]:
    """Write ``src`` as parts of at most ``max_tensors`` tensors named after ``prefix``
    (``prefix`` less ``.gguf``, then ``-0000K-of-0000N.gguf``); returns them in order."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(prefix, arch, split_max_tensors=max_tensors)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == VT.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    count = len(w.tensors)  # one table of tensors per part
    w.write_tensors_to_file()
    w.close()
    stem = prefix.name.removesuffix(".gguf")
    return [prefix.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
