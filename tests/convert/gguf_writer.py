"""Write a Hugging Face checkpoint of a Qwen-family model as an fp32 GGUF file (tests only).

What llama.cpp's converter writes for `qwen2` / `qwen3` (no q/k permutation for these architectures): the
architecture's hyper-parameters, the byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`, tokens,
types, merges, special ids) and every tensor under its GGUF name (gguf's own HF -> GGUF name map).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_gguf(hf_dir: Path, dest: Path) -> Path:
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch_name = cfg["model_type"]  # qwen2 | qwen3
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch_name]
    n = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(dest), arch_name)
    w.add_name(f"tiny-{arch_name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg["vocab_size"], (len(tokens), cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])

    names = gguf.get_tensor_name_map(arch, n)
    state = load_file(str(hf_dir / "model.safetensors"))
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf_name
        w.add_tensor(f"{name}.{suffix}", t.to(torch.float32).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
