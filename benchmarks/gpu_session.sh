#!/usr/bin/env bash
# The standard run on the offline GPU host, one section after another, each under a time limit, tables last.
#
#   bash benchmarks/gpu_session.sh tests decode batch verify paged int4 spec   (any subset, in the order given)
#
# Expects (carried beside the tree, git-ignored): .whl/ with onnxruntime-genai's cp312 wheel (the builder
# makes the packages) and .carry/tok/ with SmolLM2's tokenizer files; `bash benchmarks/prepare_carry.sh`
# makes them (and spec's GGUF parts and wheels) in a fresh checkout. Sections:
#   ifh200  print the card; on anything but an H200 skip every section after it (`ifh200 small decode`:
#           the H200 targets only where they can be measured)
#   tests   the GPU tests (kernels, runner, decode runs, paged attention, backend, concurrency, bf16 parity)
#   decode  batch-1 decode of the 0.5B, 1B and 8B shapes against the floor and transformers (gpu_decode.py)
#   batch   8B (16k context): 1 and 64 concurrent, the growing conversation with a profiled turn, 32 agents
#           beside the serial engine (gpu_batch.py)
#   int4    builder -p int4 8B package: dequantized vs packed vs bf16 (gpu_int4.py)
#   verify  a speculative verify step's cost next to a decode step, rowwise and not (gpu_verify_cost.py); after
#           `spec`, also on the real SmolLM2 bf16 package with 1 and 4 rows per GEMV program (`--rows 1,4`)
#   paged   the paged attention kernel on a prefill chunk: tiles and key splits vs flash attention
#           (gpu_paged_attention.py)
#   quick   the int4 kernel's tests and the GEMV's late-norm, x-in-tile and residual tests (and the few-row
#           GEMM's residual test, the paged attention's kernel tests), in 8 processes (pytest-xdist); each
#           failure's name
#   argmax  the 0.5B and 1B decode graphs as they are and with torch.argmax instead of the greedy choice in
#           the advance kernel (kernels.GREEDY_IN_ADVANCE off), interleaved twice
#   fold    the 0.5B and 1B decode graphs as they are and with every RMSNorm folded into its product (the
#           per-shape timing not asked), interleaved three times (FOLD_ABLATIONS=none,fold,... another list)
#   tune    0.5B and 1B: each one-row product's per-shape choice tuned by the decode step's own time
#           (coordinate descent, TUNE_ROUNDS passes), then the load's choices against the tuned ones
#           (gpu_tune_in_graph.py)
#   pick    after `fold`: the faster of its variants (summed over both shapes) exported for the sections after
#           it (ONNXGEN_FOLD_NORMS; benchmarks/pick_ablation.py)
#   small   `decode` for the 0.5B and 1B shapes only
#   gaps    0.5B and 1B: decode tok/s at 8 steps a run (`8n`: no first run launched behind the prompt's step;
#           `8s`: each run's first replay one step deep; both as before 2026-12-06; `8f`: that first run full
#           length; `8w`: runs read whole, not in parts) and 16, TTFT, replies ending by EOS, and the device's
#           idle gaps between kernels under torch.profiler, summed by neighbours (gpu_gaps.py; GAPS_STEPS=8,32
#           another list)
#   pagedbits  the paged attention's GPU tests: against the torch path (every step kind, splits), verify rows =
#           decode bits; each failure's name
#   shortbits  the short-context decode graph (attention unpipelined: paged.SHORT_BLOCKS) against the graph for
#           any length, bit for bit, and the switch between them; verify rows = decode bits through graphs
#   parity  the bf16 GPU parity test (builder-made package vs transformers fp32/bf16 to 8k tokens) and the
#           decode runs' GPU tests; each failure's name
#   kernels each kernel of the 0.5B and 1B decode steps in order, without programmatic dependent launch (its
#           own time), a layer's kernels against their weights' floor (gpu_kernel_table.py); then the
#           graphs' replay time with it, for what the overlap buys
#   pagedcheck  the paged attention kernel against the torch path for every tile, split and dtype
#           (gpu_paged_check.py): which cases exceed the GPU test's tolerance
#   cluster the key splits' hand-off to their merge, four ways, in a standalone CUDA C probe (a second launch;
#           a thread-block cluster through global memory, through distributed shared memory, or by st.async
#           into rank 0's shared memory): µs a layer and bits (benchmarks/cluster_probe.cu, built here by nvcc)
#   late    the 0.5B decode graph: as is (folded norms scaled after the product), with x normalised first
#           (kernels.NORM_LATE off), and
#           with the GEMV's x through shared memory (kernels.X_IN_TILE off), interleaved (gpu_decode_ablation.py)
#   int4v   packed int4 GEMV designs v7 (src/, both schemes) vs v1 (gpu_int4_variants.py; v5 and v6 lost offline,
#           in SASS, and are not timed here), then one launch of each under Nsight
#           Compute (speed of light, warp states, instruction mix: $OUT/ncu.txt where the runner has $OUT)
#   specrows  after `spec`: verify cost on the real SmolLM2 bf16 package, 1 and 4 rows per GEMV program
#   rows    a verify step's cost with 1 and 4 rows per GEMV program, interleaved in one process (0.5B)
#   spec    speculative decoding on SmolLM2-135M (real weights; bf16 then fp32 packages; the engine's choice,
#           speculative=None, and runs of 2 without `drafts.CUDA_FOLLOW` beside plain decoding, interleaved):
#           needs /tmp/gg/m.gguf
#           on the host, i.e. the GGUF carried in two parts (.gguf_parts/part.aa, part.ab: 49 MB each, one per
#           call within the warm window, copied to /tmp/gg and joined there) and the pure-Python `gguf` and
#           `accelerate` wheels (.gguf_py/) installed into /tmp/gg/py (speculative-gpu.md); SPEC_PRECISIONS=bf16
#           runs only the bf16 package, SPEC_RUNS=2,4f those contenders (speculative.py --spec-runs), SPEC_ARGS=--mix more arguments
# Commands and results go to docs/benchmarks/ (decode-gpu.md, batching-gpu.md).
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src ONNXGEN_TEST_TOKENIZER=$PWD/.carry/tok PYTHONUNBUFFERED=1
quiet() { grep -v "Loading weights\|Writing model\|UserWarning\|_warn_once"; }
for section in "$@"; do
  echo "== $section (t=$(( $(date +%s) - T0 )) s)"
  case "$section" in
    ifh200) card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
            case "$card" in *H200*) ;; *) echo "not an H200: the sections after ifh200 are skipped"; break ;; esac ;;
    tests) timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_gemv_kernel.py \
             tests/test_skinny_kernel.py tests/test_int4_kernel.py 2>&1 | tail -4  # 8 processes: compiles in parallel
           timeout 300 python3 -m pytest -q -m gpu tests/test_native_runner.py tests/test_decode_runs.py \
             tests/test_paged_attention.py tests/test_native_backend.py tests/test_concurrency.py \
             tests/test_parity_bf16.py tests/test_choice.py tests/test_speculative.py 2>&1 | tail -8 ;;
    decode) timeout 300 python3 benchmarks/gpu_decode.py --tokenizer .carry/tok --shapes 0.5b,1b,8b16k \
              --decode-steps 8 2>&1 | quiet | tail -40 ;;
    batch) timeout 400 python3 benchmarks/gpu_batch.py --tokenizer .carry/tok --shapes 8b16k --batches 1,64 \
             --sections throughput,growing,agents,serial 2>&1 | quiet | tail -60 ;;
    gaps) timeout 400 python3 benchmarks/gpu_gaps.py --tokenizer .carry/tok --shapes 0.5b,1b \
            --decode-steps ${GAPS_STEPS:-8,8n,8s,16} 2>&1 | quiet | tail -60 ;;
    paged) timeout 150 python3 benchmarks/gpu_paged_attention.py 2>&1 | grep -v Warning | tail -22 ;;
    int4) timeout 400 python3 benchmarks/gpu_int4.py --tokenizer .carry/tok --shape 8b16k 2>&1 | quiet | tail -12 ;;
    spec) [ -f /tmp/gg/hf/config.json ] || PYTHONPATH=$PYTHONPATH:/tmp/gg/py timeout 200 python3 -m \
            onnxgen.convert.checkpoint gguf-to-hf /tmp/gg/m.gguf /tmp/gg/hf  # dequantized once for both packages
          for prec in ${SPEC_PRECISIONS:-bf16 fp32}; do  # the GPU's usual precision, then the default's
            [ -d /tmp/spkg_$prec ] || timeout 150 python3 -c \
              "import sys; from onnxgen.cli.main import main; sys.exit(main())" convert /tmp/gg/hf /tmp/spkg_$prec \
              --precision $prec -e $([ $prec = fp32 ] && echo cpu || echo cuda) -q
            timeout 240 python3 benchmarks/speculative.py /tmp/spkg_$prec --backend native-paged --device cuda \
              --runs 5 --tokens 128 --spec-runs ${SPEC_RUNS:-default,2} ${SPEC_ARGS:-} --save-tokens ${OUT:-/tmp}/spec_tokens_$prec.json 2>&1 | quiet | tail -16
          done ;;
    verify) timeout 400 python3 benchmarks/gpu_verify_cost.py --tokenizer .carry/tok --shapes 0.5b,1b,8b16k 2>&1 \
              | quiet | tail -8
            if [ -d /tmp/spkg_bf16 ]; then  # after `spec`: the real SmolLM2 package, rows per GEMV program 1 vs 4
              timeout 150 python3 benchmarks/gpu_verify_cost.py --shapes /tmp/spkg_bf16 --rows 1,4 2>&1 | tail -2
            fi ;;
    quick) timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rf tests/test_int4_kernel.py \
             tests/test_gemv_kernel.py tests/test_skinny_kernel.py tests/test_paged_attention.py tests/test_decode_runs.py \
             -k "int4 or packed or late or same_bits or residual or cuda_triton or cuda_per_token or greedy_advance or float_output or few_row or gemm" \
             2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-160 | tail -12 ;;
    argmax) timeout 300 python3 benchmarks/gpu_decode_ablation.py --tokenizer .carry/tok --shapes 0.5b,1b \
              --ablations none,torchargmax,none,torchargmax 2>&1 | quiet | grep -v "^$" | tail -24 ;;
    fold) timeout 420 python3 benchmarks/gpu_decode_ablation.py --tokenizer .carry/tok --shapes 0.5b,1b \
            --ablations ${FOLD_ABLATIONS:-none,fold,none,fold,none,fold} 2>&1 | quiet | grep -v "^$" \
            | tee /tmp/fold.txt | tail -36 ;;
    tune) timeout 420 python3 benchmarks/gpu_tune_in_graph.py --tokenizer .carry/tok --shapes 0.5b,1b \
            --rounds ${TUNE_ROUNDS:-1} 2>&1 | quiet | grep -v "^$" | tail -60 ;;
    pick) best=$(python3 benchmarks/pick_ablation.py /tmp/fold.txt) && echo "picked: $best" && export $best ;;
    small) timeout 240 python3 benchmarks/gpu_decode.py --tokenizer .carry/tok --shapes 0.5b,1b --decode-steps 8 \
             2>&1 | quiet | tail -30 ;;
    pagedbits) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_paged_attention.py \
                 -k "cuda_triton_kernel_equals or cuda_per_token" 2>&1 | grep -E "^FAILED|passed|failed" \
                 | cut -c1-160 | tail -8 ;;
    shortbits) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_native_runner.py \
                 -k "short_context or verify_rows" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-160 | tail -8 ;;
    parity) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_parity_bf16.py \
              tests/test_decode_runs.py 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-200 | tail -8 ;;
    kernels) ONNXGEN_PDL=0 timeout 240 python3 benchmarks/gpu_kernel_table.py --tokenizer .carry/tok \
               --shapes 0.5b,1b 2>&1 | quiet | tail -60
             timeout 200 python3 benchmarks/gpu_kernel_table.py --tokenizer .carry/tok --shapes 0.5b,1b 2>&1 \
               | grep "decode graph\|bandwidth" ;;
    pagedcheck) timeout 240 python3 benchmarks/gpu_paged_check.py 2>&1 | grep -v Warn | tail -60 ;;
    cluster) nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/cluster_probe.cu \
               -o /tmp/cluster_probe && timeout 120 /tmp/cluster_probe ${CLUSTER_ROUNDS:-5} 200 ;;
    late) timeout 240 python3 benchmarks/gpu_decode_ablation.py --tokenizer .carry/tok --shapes 0.5b \
            --ablations none,early,nores,none,early,nores 2>&1 | quiet | grep -v "^$" | tail -16 ;;
    int4v) timeout 150 python3 benchmarks/gpu_int4_variants.py --variants v7,v1 2>&1 | grep -v Warn | tail -40
           ncu_out=${OUT:-/tmp}/ncu.txt
           ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
           timeout 45 "${ncu:-ncu}" --clock-control none -k 'regex:int4_gemv_kernel|v1_kernel' --launch-count 6 \
             --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
             --section InstructionStats --section MemoryWorkloadAnalysis \
             python3 benchmarks/gpu_int4_variants.py --variants v7,v1 --once > "$ncu_out" 2>&1
           grep -E "^  [a-z0-9_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per Thread|Executed Ipc A|stalled|Stall|L1/TEX Hit|==ERROR|==PROF==" \
             "$ncu_out" | cut -c1-150 | tail -60 ;;
    specrows) timeout 150 python3 benchmarks/gpu_verify_cost.py --shapes /tmp/spkg_bf16 --rows 1,4 2>&1 | tail -2 ;;
    rows) timeout 100 python3 benchmarks/gpu_verify_cost.py --tokenizer .carry/tok --shapes 0.5b --rows 1,4 2>&1 \
            | quiet | tail -5 ;;
    *) echo "unknown section $section" ;;
  esac
done
echo "== done (t=$(( $(date +%s) - T0 )) s)"
