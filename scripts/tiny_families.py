#!/usr/bin/env python3
"""Write a tiny random-weight GGUF of each model family Tandem loads, with the `gguf` package, for
comparing Tandem with llama.cpp on it (scripts/peer_check.py):

    python3 scripts/tiny_families.py SMOLLM2.gguf GEMMA3.gguf OUTDIR

llama (SmolLM2's shape), llama3 (llama with per-frequency RoPE divisors, `rope_freqs.weight`),
qwen2 (QKV biases), qwen3 (QK-norm, heads wider than the embedding over the heads) and gemma3
(QK-norm, post-norms, GeGLU, √dim embeddings, six layers: five windowed over 8 tokens, one
global). Each borrows the tokenizer of a real model: SmolLM2's byte-level BPE vocabulary and merges
for the first four, split as each family's own tokenizer splits text (`tokenizer.ggml.pre`: smollm,
llama-bpe for llama3, qwen2 for the Qwens), Gemma's SentencePiece vocabulary for gemma3. Weights
are drawn from a fixed seed, f32."""
import os
import sys

import numpy as np
import gguf
from gguf.constants import GGUFValueType

DIM, HEADS, KV_HEADS, FF, CTX = 64, 4, 2, 160, 512


def tokenizer_fields(path):
    r = gguf.GGUFReader(path)
    out = []
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = f.types[0]
        sub = f.types[-1] if t == GGUFValueType.ARRAY else None
        out.append((name, f.contents(), t, sub))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return out, vocab


def write(path, arch, tok, vocab, seed):
    rng = np.random.default_rng(seed)
    layers = 6 if arch == "gemma3" else 2
    hd = {"qwen3": 32, "gemma3": 24}.get(arch, DIM // HEADS)
    qd, kvd = HEADS * hd, KV_HEADS * hd
    g_arch = "llama" if arch == "llama3" else arch
    w = gguf.GGUFWriter(path, g_arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_block_count(layers)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10_000.0)
    if hd != DIM // HEADS:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(8)
    pre = {"llama3": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}.get(arch)
    for name, value, t, sub in tok:
        if name == "tokenizer.ggml.pre" and pre:
            value = pre
        w.add_key_value(name, value, t, sub_type=sub)

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, DIM)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(DIM))
    if arch == "llama3":
        w.add_tensor("rope_freqs.weight", (1.0 + 3.0 * rng.random(hd // 2)).astype(np.float32))
    for l in range(layers):
        n = lambda s: f"blk.{l}.{s}"
        w.add_tensor(n("attn_norm.weight"), norm(DIM))
        w.add_tensor(n("attn_q.weight"), mat(qd, DIM, 2.0))
        w.add_tensor(n("attn_k.weight"), mat(kvd, DIM, 2.0))
        w.add_tensor(n("attn_v.weight"), mat(kvd, DIM))
        if arch == "qwen2":
            for t, d in (("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)):
                w.add_tensor(n(f"{t}.bias"), (0.3 * rng.standard_normal(d)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(n("attn_q_norm.weight"), norm(hd))
            w.add_tensor(n("attn_k_norm.weight"), norm(hd))
        w.add_tensor(n("attn_output.weight"), mat(DIM, qd))
        if arch == "gemma3":
            w.add_tensor(n("post_attention_norm.weight"), norm(DIM))
            w.add_tensor(n("post_ffw_norm.weight"), norm(DIM))
        w.add_tensor(n("ffn_norm.weight"), norm(DIM))
        w.add_tensor(n("ffn_gate.weight"), mat(FF, DIM, 2.0))
        w.add_tensor(n("ffn_up.weight"), mat(FF, DIM))
        w.add_tensor(n("ffn_down.weight"), mat(DIM, FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    smol, gemma, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    bpe, bpe_vocab = tokenizer_fields(smol)
    spm, spm_vocab = tokenizer_fields(gemma)
    for i, arch in enumerate(["llama", "llama3", "qwen2", "qwen3", "gemma3"]):
        tok, vocab = (spm, spm_vocab) if arch == "gemma3" else (bpe, bpe_vocab)
        write(os.path.join(out, f"tiny-{arch}.gguf"), arch, tok, vocab, seed=100 + i)
        print(os.path.join(out, f"tiny-{arch}.gguf"))


if __name__ == "__main__":
    main()
