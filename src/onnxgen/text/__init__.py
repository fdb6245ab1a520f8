"""Text: tokenizer (`tokenizers` over tokenizer.json), streaming detokenizer, sandboxed chat templates.

This layer knows nothing about KV or backends; the engine calls it to turn requests into ids and
ids back into streamed text.
"""

from onnxgen.text.chat import ChatTemplate, normalize_messages, render_messages
from onnxgen.text.detok import IncrementalDetokenizer
from onnxgen.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer", "normalize_messages", "render_messages"]
