#!/usr/bin/env bash
# The offline SASS tables of docs/benchmarks/decode-gpu.md (2026-12-05, second session): each GEMV design's
# main loop on sm_90 as `benchmarks/sass_stats.py` reports it (instructions, barriers, shuffles, 16-byte
# loads). Needs Triton installed (e.g. PYTHONPATH=/tmp/tsite:src:benchmarks with `pip install --target
# /tmp/tsite triton==3.6.0`); no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-src:benchmarks}
loop() {  # the first loop's line of sass_stats, then its barrier / shuffle / 16-byte-load (weights and scales) counts
    local out
    out=$("$PY" benchmarks/sass_stats.py "$@" 2>&1)
    local body
    body=$(echo "$out" | grep -A1 "  loop" | sed -n 2p)
    printf '%s | loop: %s | BAR %s SHFL %s LDG.128 %s\n' "$(echo "$out" | head -1 | grep -o '[0-9]* registers')" \
        "$(echo "$out" | grep -m1 "  loop" | grep -o '[0-9]* instructions')" \
        "$(echo "$body" | grep -o 'BAR[^ ]*:[0-9]*' | cut -d: -f2 | paste -sd+ | bc 2>/dev/null || echo 0)" \
        "$(echo "$body" | grep -o 'SHFL[^ ]*:[0-9]*' | cut -d: -f2 | paste -sd+ | bc 2>/dev/null || echo 0)" \
        "$(echo "$body" | grep -o 'LDG[^ ]*128:[0-9]*' | cut -d: -f2 | paste -sd+ | bc 2>/dev/null || echo 0)"
}
B8='"X":"*bf16","S":"*bf16","Z":"*bf16","Y":"*bf16","K":"i32","N":"i32","NB":"i32","sxm":"i32","sym":"i32"'
echo "== int4 designs (8B shapes, block 32, symmetric, bf16 x)"
echo -n "v1  8 rows x 8 blocks, 4 warps: "; loop gpu_int4_variants:v1_kernel "{$B8,\"B\":\"*u8\"}" '{"BLOCK":32,"BLOCK_N":8,"BLOCKS":8,"ZP":0}'
echo -n "v4  1 row x 16 groups, 4 warps: "; loop gpu_int4_variants:v4_kernel '{"X":"*bf16","W":"*i32","S":"*bf16","Z":"*bf16","Y":"*bf16","KW":"i32","N":"i32","NB":"i32","NG":"i32","sxm":"i32","sym":"i32"}' '{"BLOCK":32,"BLOCK_N":1,"G":16,"ZP":0,"SUM_BLOCKS":true,"PDL":false}'
echo -n "v5  8 rows x 8 blocks, 4 warps: "; loop gpu_int4_variants:v5_kernel "{$B8,\"B\":\"*u8\"}" '{"BLOCK":32,"BLOCK_N":8,"BLOCKS":8,"ZP":0,"CONV":1}'
echo -n "v6  16 rows x 32 blocks, 4 warps: "; loop gpu_int4_variants:v6_kernel "{$B8,\"W\":\"*i32\",\"ONE_BITS\":\"i32\"}" '{"BLOCK":32,"BLOCK_N":16,"WB":32,"ZP":0,"EVEN":true}'
for v in "1 false false false" "0 false false false" "1 true false false" "1 false true false" "1 true true false" \
         "1 false true true" "1 true true true"; do
    set -- $v
    echo -n "v7 scheme $1 silu $2 norm $3 skip $4  32 cols x 64 word rows, 4 warps: "
    loop onnxgen.backends.native.triton_int4:int4_gemv_kernel \
        "{$B8,\"W\":\"*i32\",\"LD\":\"i32\",\"ONE_BITS\":\"i32\",\"SKIP\":\"*bf16\",\"NW\":\"*bf16\",\"SUM\":\"*bf16\",\"eps\":\"fp32\",\"RES\":\"*bf16\"}" \
        "{\"BLOCK\":32,\"BLOCK_N\":32,\"BK8\":64,\"ZP\":0,\"EVEN\":true,\"SCHEME\":$1,\"SILU\":$2,\"NORM\":$3,\"HAS_SKIP\":$4,\"HAS_RES\":false,\"PDL\":true}"
done
G='"X":"*bf16","W":"*bf16","Y":"*bf16","K":"i32","N":"i32","R":"i32","SKIP":"*bf16","NW":"*bf16","SUM":"*bf16","eps":"fp32","COS":"*bf16","SIN":"*bf16","POS":"*i64","SLOT":"*i64","KB":"*bf16","VB":"*bf16","sk_h":"i32","sk_s":"i32","sv_h":"i32","sv_s":"i32","cos_stride":"i32","NQ":"i32","NK":"i32"'
echo "== bf16 GEMV (decode launch), x as a vector (X2D off) vs in the tile (X2D on); whole-kernel barriers"
for cfg in "4 256 4 false" "8 128 4 false" "2 512 4 false" "16 128 4 true"; do
    set -- $cfg
    for x2d in false true; do
        out=$("$PY" benchmarks/sass_stats.py onnxgen.backends.native.triton_gemv:gemv_kernel "{$G}" \
            "{\"BLOCK_N\":$1,\"BLOCK_K\":$2,\"SILU\":$4,\"NORM\":$4,\"HAS_SKIP\":$4,\"ROPE\":false,\"HEAD\":1,\"HALF\":0,\"RB\":1,\"ONE\":true,\"LATE\":false,\"X2D\":$x2d,\"PDL\":true}" \
            --warps "$3" --not-divisible R,eps --dump /tmp/sass_tables 2>&1)
        echo "$1 x $2, $3 warps, norm+SiLU $4, X2D $x2d: $(echo "$out" | head -1 | grep -o '[0-9]* instructions'), $(grep -c BAR /tmp/sass_tables/kernel.sass) barriers"
    done
done
