"""The tokenizer files of a synthetic package: a deterministic byte-level BPE with ChatML special tokens
and template, or copies of another package's files; and the special token ids genai_config.json needs.

tokenizers is imported lazily.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.convert.synthetic.config import SyntheticConfig
from onnxgen.errors import ConversionError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
def main():\n    print("hello")\n    return 0\n
{"name": "onnxgen", "version": 1, "values": [1, 2, 3], "ok": true}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
The model writes tokens one at a time, and the cache keeps the keys and values of the past.
Une phrase en français, ein Satz auf Deutsch, una frase en español.
日本語の文章です。中文句子。한국어 문장. Emoji: 😀🚀✨👍🏽
"""


@dataclass(frozen=True)
class TokenizerFiles:
    """A package's tokenizer files: tokenizer.json text, tokenizer_config.json dict, chat template
    (None: no chat_template.jinja) and a special_tokens_map.json to copy (None: none)."""

    tokenizer_json: str
    config: dict[str, Any]
    chat_template: str | None
    special_tokens_map: Path | None = None

    def write(self, out: Path) -> None:
        """Write the files into the folder `out` (overwriting)."""
        (out / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(
            json.dumps(self.config, indent=2, ensure_ascii=False), encoding="utf-8"
        )
        if self.chat_template is not None:
            (out / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        if self.special_tokens_map is not None:
            shutil.copy(self.special_tokens_map, out / "special_tokens_map.json")

    def token_ids(self) -> tuple[int | None, list[int], int | None, int]:
        """(bos, eos list, pad, vocab size incl. added tokens). eos gathers the config's eos_token,
        <|im_end|> and <|endoftext|> (those that exist, in that order); pad defaults to the first eos."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self.tokenizer_json)

        def tid(v: Any) -> int | None:
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        bos = tid(self.config.get("bos_token"))
        eos: list[int] = []
        for t in (
            tid(self.config.get("eos_token")),
            tok.token_to_id("<|im_end|>"),
            tok.token_to_id("<|endoftext|>"),
        ):
            if t is not None and t not in eos:
                eos.append(t)
        pad = tid(self.config.get("pad_token"))
        return (
            bos,
            eos,
            pad if pad is not None else (eos[0] if eos else None),
            tok.get_vocab_size(with_added_tokens=True),
        )


def byte_level_tokenizer(
    cfg: SyntheticConfig, extra_special: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> TokenizerFiles:
    """A deterministic byte-level BPE trained on a fixed text up to cfg.vocab_size tokens, with ChatML
    special tokens (then `extra_special`, e.g. a vision model's) and `chat_template`. Raises ConversionError
    if the vocab cannot hold the 256 bytes and the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = (*SPECIAL_TOKENS, *extra_special)
    n_base = 256 + len(specials)
    if cfg.vocab_size < n_base:
        raise ConversionError(
            f"vocab_size {cfg.vocab_size} is too small for the built-in byte-level tokenizer (needs >= {n_base}); "
            "raise vocab_size or pass tokenizer_dir"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer=trainer)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in specials
    }
    tok_cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": cfg.context_length,
        "pad_token": "<|im_end|>",
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": "<|endoftext|>",
    }
    return TokenizerFiles(tok.to_str(pretty=True), tok_cfg, chat_template)


def tokenizer_from_dir(path: Path) -> TokenizerFiles:
    """The tokenizer files of the folder `path` (tokenizer.json required; tokenizer_config.json,
    chat_template.jinja and special_tokens_map.json taken when present). Raises ConversionError
    without tokenizer.json."""
    if not (path / "tokenizer.json").is_file():
        raise ConversionError(f"{path}: no tokenizer.json to copy")
    cfg_path, template_path, map_path = (
        path / "tokenizer_config.json",
        path / "chat_template.jinja",
        path / "special_tokens_map.json",
    )
    return TokenizerFiles(
        (path / "tokenizer.json").read_text(encoding="utf-8"),
        json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {},
        template_path.read_text(encoding="utf-8") if template_path.is_file() else None,
        map_path if map_path.is_file() else None,
    )
