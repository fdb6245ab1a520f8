"""Reading model packages (`genai_config.json` + graph + tokenizer) into a frozen `ModelSpec`."""

from onnxgen.package.spec import GraphIO, ModelSpec, SearchDefaults, load_spec

__all__ = ["GraphIO", "ModelSpec", "SearchDefaults", "load_spec"]
