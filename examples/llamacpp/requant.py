"""Rewrite a GGUF file with its quantized tensors in another type: F32, F16 or Q8_0.

    python examples/llamacpp/requant.py IN.gguf OUT.gguf --type q8_0|f16|f32

The llama-cpp-python wheel ships no `llama-quantize`, so this is the gguf package's own
arithmetic (gguf 0.19.0): every tensor that is not F32 is dequantized (`gguf.quants.dequantize`)
and quantized again (`gguf.quants.quantize`); F32 tensors (the norms) and every metadata field
are copied as they are, `general.file_type` excepted. Going from Q4_1 the values are the Q4_1
ones re-rounded, not the original checkpoint's: every producer is then run on the new file, so
what is compared is the same weights.
"""

import argparse
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
TYPES = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def requant(src: str, dst: str, kind: str) -> None:
    target, file_type = TYPES[kind]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # The writer adds the GGUF.* header fields and the architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = int(file_type) if field.name == "general.file_type" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == Q.F32:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # [rows, ne0] f32
        if target == Q.F32:
            writer.add_tensor(t.name, values.astype(np.float32))
        elif target == Q.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=sorted(TYPES), required=True)
    a = ap.parse_args()
    try:
        requant(a.src, a.dst, a.type)
    except (OSError, ValueError, KeyError) as e:
        print(f"requant.py: {a.src} -> {a.dst}: {e}", file=sys.stderr)
        return 2
    print(a.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
