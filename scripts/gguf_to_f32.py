#!/usr/bin/env python3
"""Write a GGUF file's every tensor dequantized to F32, metadata unchanged.

For comparing engines without the weight format in the way: llama.cpp multiplies k-quant and
Q5_0 weights against activations it quantizes to 8 bits, where Tandem's target multiplies the
dequantized f32 weights against f32 activations. On the F32 copy both run f32 arithmetic, so what
is left between them is summation order. Needs the `gguf` package (pip install gguf).

    python3 scripts/gguf_to_f32.py IN.gguf OUT.gguf
"""
import sys

import numpy as np
import gguf
from gguf.constants import GGUFValueType


def main():
    src, dst = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), t, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), t)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
