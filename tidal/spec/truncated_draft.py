"""A draft model for speculative decoding made from the target itself: its first N layers.

`python -m tidal.spec.truncated_draft TARGET.gguf DRAFT.gguf --layers 4` copies the target's GGUF
file with only blocks 0..N-1 (the embeddings, the final norm, the output head and every
metadata key kept, the block count changed). The tensors keep their quantization, so the draft
runs the same kernels; its vocabulary and tokenizer are the target's by construction. No package
ships a smaller model of SmolLM2's tokenizer, so this is the default model's draft in tests and
benchmarks (tidal/bench/spec.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_SKIP = ("GGUF.", "general.alignment")  # written by the writer itself


def truncate_gguf(src: str, dst: str, layers: int) -> str:
    """Write the first `layers` blocks of `src` (a GGUF model) to `dst`; returns dst."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] for {src}, got {layers}")
    writer = GGUFWriter(dst, arch=arch)
    for name, field in reader.fields.items():
        if name.startswith(_SKIP) or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        block = _BLOCK.match(t.name)
        if block is not None and int(block.group(1)) >= layers:
            continue
        writer.add_tensor(t.name, t.data, raw_shape=list(t.data.shape), raw_dtype=t.tensor_type)  # bytes per row if quantized
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tidal.spec.truncated_draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="the target model's .gguf file")
    ap.add_argument("draft", help="where to write the draft's .gguf file")
    ap.add_argument("--layers", type=int, default=4, help="blocks to keep (default: 4)")
    ns = ap.parse_args(argv)
    Path(ns.draft).parent.mkdir(parents=True, exist_ok=True)
    print(truncate_gguf(ns.target, ns.draft, ns.layers))


if __name__ == "__main__":
    main()
