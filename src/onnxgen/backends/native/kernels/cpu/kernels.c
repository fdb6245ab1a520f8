/* onnxgen's CPU kernels for decode-size float32 work (compiled at first use by `kernels/cpu/build.py`).

   - og_linear: a few rows times a constant [K, N] weight (or its split layout [P, K, N / P]), with an
     RMSNorm (+ skip sum) before it and a bias, a residual or silu(g) * u over [g | u] halves after it.
   - og_rope_qkv_write: packed QKV rows rotated (q and k) and k, v written at their KV rows.
   - og_attention: each query token over its own sequence's keys (paged or contiguous), causal, with a
     window, soft-capping and attention sinks.
   - og_layer: a whole pre-norm decoder layer (the calls above in order) in one parallel region.

   Contracts every function keeps (the Python side relies on them, tests check them):
   - a row's values never depend on the other rows of the call (a verify step's rows equal plain decoding's);
   - float32 in, float32 out, float32 accumulation; products rounded then summed where the torch reference
     does so (compiled with -ffp-contract=off; the fused multiply-adds below are explicit);
   - parallel work runs on the caller's OpenMP pool (libgomp is the one torch loaded: the same soname). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define OG_KB 64          /* rows of w a tiled product sums in registers at a time */
#define OG_TILE_COLS 512  /* chunks up to this wide run tiled for OG_TILE_ROWS rows or more */
#define OG_TILE_ROWS 3
#define OG_PIECE 256      /* columns of a several-row product's piece (eight rows of w: 8 KiB) */
#define OG_ROWS_MAX 16   /* rows of one og_linear call */
#define OG_CHUNK 4096    /* the most columns of a weight block one work item computes */
#define OG_KEYS 256      /* keys per attention split (a sequence's split count depends on its length only) */
#define OG_SPLITS 16     /* at most this many splits per query token */
#define OG_KEY_BLOCK 64  /* keys scored at once inside a split */
#define OG_GROUP_MAX 64  /* query heads per KV head */
#define OG_HEAD_MAX 256  /* head size */

int og_version(void) { return 8; }

/* ---------------------------------------------------------------------------------------------------------
   Products */

/* R rows (1..4) of y[:, 0:16] += x[:, 0:kb] . w[0:kb, 0:16] (w's row stride ldw), the sums in registers over
   the kb rows. */
static inline __attribute__((always_inline)) void tile(const int R, const float *x, int64_t ldx, int kb,
                                                        const float *w, int64_t ldw, float *y, int64_t ldy) {
    __m256 a[4][2];
    for (int r = 0; r < R; r++) {
        a[r][0] = _mm256_loadu_ps(y + r * ldy);
        a[r][1] = _mm256_loadu_ps(y + r * ldy + 8);
    }
    for (int k = 0; k < kb; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + ldw * k), w1 = _mm256_loadu_ps(w + ldw * k + 8);
        for (int r = 0; r < R; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(b, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * ldy, a[r][0]);
        _mm256_storeu_ps(y + r * ldy + 8, a[r][1]);
    }
}

/* y[m, 0:cols] = x[m, 0:K] . w[0:K, 0:cols] (w's row stride ldw). Every y[m, c] is one FMA chain over k in
   order from 0, whichever path below computes it: a row's bits do not depend on the row count. */
static void chunk_product(const float *x, int64_t ldx, int rows, int K, const float *w, int64_t ldw,
                          int cols, float *y, int64_t ldy) {
    for (int m = 0; m < rows; m++) memset(y + m * ldy, 0, (size_t)cols * sizeof(float));
    int k = 0;
    if (rows >= OG_TILE_ROWS && cols <= OG_TILE_COLS) {
        /* several rows over a narrow chunk: 16-column tiles of OG_KB rows of w read in place (each row of w a
           few KiB from the next, so a tile's lines share few pages), their sums in registers for up to four
           rows at a time; the next tile's lines fetched while this one is summed */
        const int tiled = cols / 16 * 16;
        for (; k + OG_KB <= K; k += OG_KB) {
            const float *wk = w + (int64_t)k * ldw;
            for (int t = 0; t < tiled; t += 16) {
                if (t + 16 < tiled)
                    for (int kk = 0; kk < OG_KB; kk++)
                        _mm_prefetch((const char *)(wk + kk * ldw + t + 16), _MM_HINT_T0);
                for (int m = 0; m < rows; m += 4) {
                    const float *xm = x + m * ldx + k;
                    float *ym = y + m * ldy + t;
                    switch (rows - m < 4 ? rows - m : 4) {
                    case 4: tile(4, xm, ldx, OG_KB, wk + t, ldw, ym, ldy); break;
                    case 3: tile(3, xm, ldx, OG_KB, wk + t, ldw, ym, ldy); break;
                    case 2: tile(2, xm, ldx, OG_KB, wk + t, ldw, ym, ldy); break;
                    default: tile(1, xm, ldx, OG_KB, wk + t, ldw, ym, ldy);
                    }
                }
            }
            /* the columns past the last whole tile: one k at a time over the same block */
            for (int kk = k; kk < k + OG_KB; kk++)
                for (int m = 0; m < rows; m++)
                    for (int c = tiled; c < cols; c++)
                        y[m * ldy + c] = fmaf(x[m * ldx + kk], w[(int64_t)kk * ldw + c], y[m * ldy + c]);
        }
    }
    /* one row, a wide chunk's rows (columns in pieces whose eight rows of w stay in L1 for every row), and
       the rows of k a tiled product's blocks left: eight rows of w at a time */
    const int piece = rows == 1 ? cols : OG_PIECE;
    for (; k + 8 <= K; k += 8) {
        const float *w0 = w + (int64_t)k * ldw;
        for (int c0 = 0; c0 < cols; c0 += piece) {
            const int c1 = cols - c0 < piece ? cols : c0 + piece;
            for (int m = 0; m < rows; m++) {
                const float *xm = x + m * ldx + k;
                float *ym = y + m * ldy;
                __m256 b[8];
                for (int u = 0; u < 8; u++) b[u] = _mm256_set1_ps(xm[u]);
                int c = c0;
                for (; c + 32 <= c1; c += 32) {  /* four independent chains in flight */
                    __m256 a0 = _mm256_loadu_ps(ym + c), a1 = _mm256_loadu_ps(ym + c + 8);
                    __m256 a2 = _mm256_loadu_ps(ym + c + 16), a3 = _mm256_loadu_ps(ym + c + 24);
                    for (int u = 0; u < 8; u++) {
                        const float *wu = w0 + u * ldw + c;
                        a0 = _mm256_fmadd_ps(b[u], _mm256_loadu_ps(wu), a0);
                        a1 = _mm256_fmadd_ps(b[u], _mm256_loadu_ps(wu + 8), a1);
                        a2 = _mm256_fmadd_ps(b[u], _mm256_loadu_ps(wu + 16), a2);
                        a3 = _mm256_fmadd_ps(b[u], _mm256_loadu_ps(wu + 24), a3);
                    }
                    _mm256_storeu_ps(ym + c, a0);
                    _mm256_storeu_ps(ym + c + 8, a1);
                    _mm256_storeu_ps(ym + c + 16, a2);
                    _mm256_storeu_ps(ym + c + 24, a3);
                }
                for (; c + 8 <= c1; c += 8) {
                    __m256 acc = _mm256_loadu_ps(ym + c);
                    for (int u = 0; u < 8; u++) acc = _mm256_fmadd_ps(b[u], _mm256_loadu_ps(w0 + u * ldw + c), acc);
                    _mm256_storeu_ps(ym + c, acc);
                }
                for (; c < c1; c++) {
                    float a = ym[c];
                    for (int u = 0; u < 8; u++) a = fmaf(xm[u], w0[u * ldw + c], a);
                    ym[c] = a;
                }
            }
        }
    }
    for (; k < K; k++) {
        const float *wk = w + (int64_t)k * ldw;
        for (int m = 0; m < rows; m++) {
            const float xk = x[m * ldx + k];
            float *ym = y + m * ldy;
            const __m256 b = _mm256_set1_ps(xk);
            int c = 0;
            for (; c + 8 <= cols; c += 8)
                _mm256_storeu_ps(ym + c, _mm256_fmadd_ps(b, _mm256_loadu_ps(wk + c), _mm256_loadu_ps(ym + c)));
            for (; c < cols; c++) ym[c] = fmaf(xk, wk[c], ym[c]);
        }
    }
}

/* h[m] = (x[m] (+ skip[m])) * rsqrt(mean((x + skip)^2) + eps) * nw, the sum written to sum_out[m] when
   skip is given (onnxruntime's SkipSimplifiedLayerNormalization, float32 throughout). */
static void rms_rows(const float *x, const float *skip, const float *nw, float eps, int rows, int K,
                     float *h, float *sum_out) {
    for (int m = 0; m < rows; m++) {
        const float *xm = x + (int64_t)m * K;
        float *hm = h + (int64_t)m * K;
        if (skip) {
            const float *sm = skip + (int64_t)m * K;
            float *om = sum_out + (int64_t)m * K;
            for (int k = 0; k < K; k++) om[k] = xm[k] + sm[k];
            xm = om;
        }
        double ss = 0.0;
        for (int k = 0; k < K; k++) ss += (double)xm[k] * (double)xm[k];
        const float r = 1.0f / sqrtf((float)(ss / K) + eps);
        for (int k = 0; k < K; k++) hm[k] = xm[k] * r * nw[k];
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* A constant weight as the products read it: `parts` blocks of [K, nb] (block p at w + p * block_stride, row
   stride ldw, columns p * nb ..): the split layout is parts = P, block_stride = K * nb, ldw = nb; a plain
   [K, N] weight is parts = 1, ldw = N. */
typedef struct {
    const float *w;
    int parts;
    int64_t block_stride, ldw;
    int nb;
} og_weight;

/* y = x @ W (+ bias) (+ residual) over [rows, N], then with act 1 out[rows, N/2] = silu(y[:, :N/2]) * y[:, N/2:].
   Called by every thread of a parallel region (orphaned work-sharing loops, a barrier at the end). */
static void product_phase(const float *x, int rows, int K, const og_weight *W, const float *bias,
                          const float *residual, int act, float *y, float *out, int nthreads) {
    const int nb = W->nb, parts = W->parts;
    const int64_t N = (int64_t)parts * nb;
    /* whole rows of a block per work item (one sequential stream through it) where there are blocks for
       every thread, else each block cut into about nthreads / parts column ranges; at most OG_CHUNK columns */
    int width = nb;
    if (parts < nthreads) width = ((nb * parts + nthreads - 1) / nthreads + 7) / 8 * 8;
    if (width > OG_CHUNK) width = OG_CHUNK;
    if (width < 8) width = 8;
    const int chunks = (nb + width - 1) / width;
    const int items = parts * chunks;
#pragma omp for schedule(static)
    for (int it = 0; it < items; it++) {
        const int p = it / chunks, c0 = (it % chunks) * width;
        const int cols = nb - c0 < width ? nb - c0 : width;
        const int64_t col = (int64_t)p * nb + c0;
        chunk_product(x, K, rows, K, W->w + p * W->block_stride + c0, W->ldw, cols, y + col, N);
        if (bias || residual) {
            for (int m = 0; m < rows; m++) {
                float *ym = y + m * N + col;
                if (bias)
                    for (int c = 0; c < cols; c++) ym[c] += bias[col + c];
                if (residual) {
                    const float *rm = residual + m * N + col;
                    for (int c = 0; c < cols; c++) ym[c] += rm[c];
                }
            }
        }
    }
    if (act == 1) {
        const int64_t half = N / 2;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * half; i++) {
            const int64_t m = i / half, c = i % half;
            out[i] = silu(y[m * N + c]) * y[m * N + half + c];
        }
    }
}

/* out[rows, N'] = act(norm(x) @ W + bias + residual).

   x [rows, K] contiguous; W as `og_weight` describes. nw (may be NULL): an RMSNorm's weight first (skip,
   sum_out: its residual sum), into h [rows, K]. act 1: silu(y[:, :N/2]) * y[:, N/2:] into out [rows, N/2]
   (y [rows, N] scratch); act 0: y is out. bias [N], residual [rows, N] (may be NULL; not with act 1). */
int og_linear(const float *x, int rows, int K, const float *skip, const float *nw, float eps, float *h,
              float *sum_out, const og_weight *W, const float *bias, const float *residual, int act, float *y,
              float *out, int nthreads) {
    if (rows < 1 || rows > OG_ROWS_MAX || K < 1 || W->nb < 1 || W->parts < 1) return -1;
    if (nw) {
        rms_rows(x, skip, nw, eps, rows, K, h, sum_out);
        x = h;
    }
#pragma omp parallel num_threads(nthreads)
    product_phase(x, rows, K, W, bias, residual, act, y, out, nthreads);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
   Rotary and the KV write */

/* One head's rotation of its first 2 * half features at table row `row` (torch reference: products rounded,
   then their sum); the rest copied. */
static void rotate(const float *x, const float *cs, const float *sn, int d, int half, int interleaved,
                   float *o) {
    for (int i = 0; i < half; i++) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        const float x1 = x[a], x2 = x[b], c = cs[i], s = sn[i];
        const float p1 = x1 * c, p2 = x2 * s, p3 = x2 * c, p4 = x1 * s;
        o[a] = p1 - p2;
        o[b] = p3 + p4;
    }
    for (int i = 2 * half; i < d; i++) o[i] = x[i];
}

/* qkv [S, (n + 2 hkv) d] rows (row stride ld): q heads rotated into qout (token t, head h at
   qout + t * q_tok + h * q_head), k heads rotated and v heads copied to slot slots[t] of kb / vb (slot
   stride kv_row, head stride kv_head); rotary table row positions[t] (cos_c / sin_c, row stride cs). */
static void rope_write(const float *qkv, int64_t ld, int S, int n, int hkv, int d, int half, const float *cos_c,
                       const float *sin_c, int64_t cs, const int64_t *positions, const int64_t *slots,
                       int interleaved, float *qout, int64_t q_tok, int64_t q_head, float *kb, float *vb,
                       int64_t kv_row, int64_t kv_head) {
    for (int t = 0; t < S; t++) {
        const float *r = qkv + t * ld;
        const float *c = cos_c + positions[t] * cs, *s = sin_c + positions[t] * cs;
        for (int h = 0; h < n; h++) rotate(r + h * d, c, s, d, half, interleaved, qout + t * q_tok + h * q_head);
        float *krow = kb + slots[t] * kv_row, *vrow = vb + slots[t] * kv_row;
        for (int h = 0; h < hkv; h++) {
            rotate(r + (int64_t)(n + h) * d, c, s, d, half, interleaved, krow + h * kv_head);
            memcpy(vrow + h * kv_head, r + (int64_t)(n + hkv + h) * d, (size_t)d * sizeof(float));
        }
    }
}

int og_rope_qkv_write(const float *qkv, int64_t ld, int S, int n, int hkv, int d, int half,
                      const float *cos_c, const float *sin_c, int64_t cs, const int64_t *positions,
                      const int64_t *slots, int interleaved, float *qout, int64_t q_tok, int64_t q_head,
                      float *kb, float *vb, int64_t kv_row, int64_t kv_head) {
    if (2 * half > d) return -1;
    rope_write(qkv, ld, S, n, hkv, d, half, cos_c, sin_c, cs, positions, slots, interleaved, qout, q_tok, q_head,
               kb, vb, kv_row, kv_head);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
   Attention */

/* exp(x) for 8 floats: Cephes' single-precision polynomial after a range reduction by ln 2 (relative error
   about 1e-7 over the range softmax uses, exp(x) for x <= 0); exp(-inf) = 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 zero_below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, half));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c1));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c2));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, half);
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero_below, y);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* the sums of eight vectors' lanes as one vector: lane i = sum of a[i] */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

typedef struct {
    const float *kb, *vb;
    int64_t page_stride, row_stride, head_stride;
    const int32_t *tables;
    int64_t table_stride;
    int page_size;
} og_kv;

static inline int64_t key_offset(const og_kv *kv, const int32_t *table, int64_t p, int head) {
    return (int64_t)table[p / kv->page_size] * kv->page_stride + (p % kv->page_size) * kv->row_stride +
           (int64_t)head * kv->head_stride;
}

/* The split count and keys per split of a query that reads `keys` keys: a function of its length only. */
static inline void plan(int64_t keys, int *splits, int64_t *per) {
    int64_t s = (keys + OG_KEYS - 1) / OG_KEYS;
    if (s > OG_SPLITS) s = OG_SPLITS;
    if (s < 1) s = 1;
    *per = (keys + s - 1) / s;
    *splits = (int)((keys + *per - 1) / *per);
}

/* The `g` query heads of one KV head over keys [lo, hi) of one sequence: the running maximum m, the sum l of
   exp(score - m) and acc = sum exp(score - m) v (unnormalised), per head. d is a multiple of 8. */
static void attend_split(const float *q, int64_t q_head, int g, int d, const og_kv *kv, const int32_t *table,
                         int head, int64_t lo, int64_t hi, float scale, float softcap, float *m, float *l,
                         float *acc) {
    float scores[OG_GROUP_MAX * OG_KEY_BLOCK] __attribute__((aligned(32)));
    const float *kp[OG_KEY_BLOCK], *vp[OG_KEY_BLOCK];
    for (int j = 0; j < g; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        memset(acc + j * d, 0, (size_t)d * sizeof(float));
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b0 = lo; b0 < hi; b0 += OG_KEY_BLOCK) {
        const int nk = hi - b0 < OG_KEY_BLOCK ? (int)(hi - b0) : OG_KEY_BLOCK;
        for (int i = 0; i < nk; i++) {
            const int64_t off = key_offset(kv, table, b0 + i, head);
            kp[i] = kv->kb + off;
            vp[i] = kv->vb + off;
        }
        for (int i = nk; i < (nk + 7) / 8 * 8; i++) kp[i] = kp[0]; /* a partial group reads key 0 again */
        for (int j = 0; j < g; j++) {
            const float *qj = q + j * q_head;
            float *sj = scores + j * OG_KEY_BLOCK;
            for (int i = 0; i < nk; i += 8) {
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                for (int e = 0; e < d; e += 8) {
                    const __m256 qv = _mm256_loadu_ps(qj + e);
                    for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[i + u] + e), a[u]);
                }
                _mm256_store_ps(sj + i, _mm256_mul_ps(hsum8x8(a), vscale));
            }
            if (softcap > 0.0f)
                for (int i = 0; i < nk; i++) sj[i] = softcap * tanhf(sj[i] / softcap);
            for (int i = nk; i < (nk + 7) / 8 * 8; i++) sj[i] = -INFINITY;
            __m256 mx8 = _mm256_set1_ps(m[j]);
            for (int i = 0; i < nk; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_load_ps(sj + i));
            const float mx = hmax8(mx8);
            const float corr = m[j] == -INFINITY ? 0.0f : expf(m[j] - mx);
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 sum8 = _mm256_setzero_ps();
            for (int i = 0; i < nk; i += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(sj + i), vmx));
                _mm256_store_ps(sj + i, p);
                sum8 = _mm256_add_ps(sum8, p);
            }
            l[j] = l[j] * corr + hsum8(sum8);
            m[j] = mx;
            /* acc = acc * corr + sum_i p_i v_i, 64 features at a time in registers */
            const __m256 vc = _mm256_set1_ps(corr);
            float *aj = acc + j * d;
            for (int e0 = 0; e0 < d; e0 += 64) {
                const int w = d - e0 < 64 ? (d - e0) / 8 : 8;
                __m256 r[8];
                for (int c = 0; c < w; c++) r[c] = _mm256_mul_ps(_mm256_loadu_ps(aj + e0 + 8 * c), vc);
                for (int i = 0; i < nk; i++) {
                    const __m256 p = _mm256_set1_ps(sj[i]);
                    const float *v = vp[i] + e0;
                    for (int c = 0; c < w; c++) r[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), r[c]);
                }
                for (int c = 0; c < w; c++) _mm256_storeu_ps(aj + e0 + 8 * c, r[c]);
            }
        }
    }
}

/* One attention call's work: query tokens and where their keys are. */
typedef struct {
    const float *q;
    int64_t q_tok, q_head;
    int T, n, hkv, d;
    og_kv kv;
    const int32_t *seq;
    const int64_t *pos;
    float scale, softcap;
    int window;
    const float *sink;
    float *out;
    int64_t o_tok, o_head;
    float *scratch;
} og_attn;

static int attention_ok(int n, int hkv, int d, int T) {
    return !(hkv < 1 || n % hkv || n / hkv > OG_GROUP_MAX || d > OG_HEAD_MAX || d % 8 || T < 1);
}

/* Called by every thread of a parallel region (orphaned work-sharing loops, a barrier at the end). */
static void attention_phase(const og_attn *A) {
    const int g = A->n / A->hkv, hkv = A->hkv, n = A->n, d = A->d;
    const int64_t part = (int64_t)g * (d + 2); /* one split's (m, l, acc) for a KV head's g query heads */
    const int items = A->T * hkv * OG_SPLITS;  /* (token, KV head, split) */
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; it++) {
        const int t = it / (hkv * OG_SPLITS), head = (it / OG_SPLITS) % hkv, sp = it % OG_SPLITS;
        const int64_t hi = A->pos[t] + 1, lo = A->window > 0 && hi - A->window > 0 ? hi - A->window : 0;
        int splits;
        int64_t per;
        plan(hi - lo, &splits, &per);
        if (sp >= splits) continue;
        const int64_t a = lo + sp * per, b = a + per < hi ? a + per : hi;
        float *slot = A->scratch + ((int64_t)(t * hkv + head) * OG_SPLITS + sp) * part;
        attend_split(A->q + t * A->q_tok + (int64_t)head * g * A->q_head, A->q_head, g, d, &A->kv,
                     A->kv.tables + (int64_t)A->seq[t] * A->kv.table_stride, head, a, b, A->scale, A->softcap,
                     slot, slot + g, slot + 2 * g);
    }
    /* the splits of each (token, query head) combined in split order */
#pragma omp for schedule(static)
    for (int it = 0; it < A->T * n; it++) {
        const int t = it / n, h = it % n, head = h / g, j = h % g;
        const int64_t hi = A->pos[t] + 1, lo = A->window > 0 && hi - A->window > 0 ? hi - A->window : 0;
        int splits;
        int64_t per;
        plan(hi - lo, &splits, &per);
        const float *base = A->scratch + (int64_t)(t * hkv + head) * OG_SPLITS * part;
        float mx = A->sink ? A->sink[h] : -INFINITY;
        for (int s = 0; s < splits; s++) {
            const float ms = base[s * part + j];
            mx = ms > mx ? ms : mx;
        }
        float l = A->sink ? expf(A->sink[h] - mx) : 0.0f;
        float *o = A->out + t * A->o_tok + h * A->o_head;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int s = 0; s < splits; s++) {
            const float *sl = base + s * part;
            const float f = expf(sl[j] - mx);
            l += sl[g + j] * f;
            const float *acc = sl + 2 * g + (int64_t)j * d;
            for (int e = 0; e < d; e++) o[e] += acc[e] * f;
        }
        const float inv = 1.0f / l;
        for (int e = 0; e < d; e++) o[e] *= inv;
    }
}

/* out[t, h] = softmax over keys (scale, soft-capped) of q[t, h] . k, times v, for T query tokens: token t of
   sequence seq[t] (its page table row tables + seq[t] * table_stride) at position pos[t] reads keys
   [lo, pos[t]] (lo = pos[t] - window + 1 with a window > 0, else 0). Query head h reads KV head h / (n / hkv).
   sink (may be NULL): [n] logits in each head's denominator. q at q + t * q_tok + h * q_head, out likewise;
   scratch: at least og_attention_scratch(T, n, d) floats. */
int64_t og_attention_scratch(int T, int n, int d) { return (int64_t)T * n * OG_SPLITS * (d + 2); }

int og_attention(const float *q, int64_t q_tok, int64_t q_head, int T, int n, int hkv, int d,
                 const float *kb, const float *vb, int64_t page_stride, int64_t row_stride,
                 int64_t head_stride, const int32_t *tables, int64_t table_stride, int page_size,
                 const int32_t *seq, const int64_t *pos, float scale, float softcap, int window,
                 const float *sink, float *out, int64_t o_tok, int64_t o_head, float *scratch, int nthreads) {
    if (!attention_ok(n, hkv, d, T)) return -1;
    const og_attn A = {q, q_tok, q_head, T, n, hkv, d,
                       {kb, vb, page_stride, row_stride, head_stride, tables, table_stride, page_size},
                       seq, pos, scale, softcap, window, sink, out, o_tok, o_head, scratch};
#pragma omp parallel num_threads(nthreads)
    attention_phase(&A);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
   A decoder layer */

/* A pre-norm decoder layer with packed QKV, rotary attention and a SiLU-gated MLP, for up to OG_ROWS_MAX
   tokens (decode and verify steps):
     qkv = rms(x, nw1) @ wqkv;  q, k, v rotated / written (og_rope_qkv_write);  a = attention (og_attention)
     h1 = x + a @ wo;  out = h1 + silu_halves(rms(h1, nw2) @ wgu) @ wdown
   each step the values of the separate calls above (the same functions in the same order), in one parallel
   region. KV rows: kb / vb at slot * kv_row + head * kv_head; the attention's pages: page_stride (0: one
   contiguous buffer of page_size rows, tables a zero row). */
typedef struct {
    const float *x;
    float *out;
    int rows, K;
    const float *nw1, *nw2;
    float eps1, eps2;
    og_weight wqkv, wo, wgu, wdown;
    int n, hkv, d, half, interleaved;
    const float *cos_c, *sin_c;
    int64_t cs;
    const int64_t *rope_rows, *slots;
    float *kb, *vb;
    int64_t kv_row, kv_head, page_stride;
    const int32_t *tables;
    int64_t table_stride;
    int page_size;
    const int32_t *seq;
    const int64_t *pos;
    float scale, softcap;
    int window;
    const float *sink;
    float *scratch; /* og_layer_scratch(...) floats */
    int nthreads;
} og_layer_args;

int64_t og_layer_scratch(int rows, int K, int n, int hkv, int d, int64_t ngu) {
    return (int64_t)rows * (2 * K + (int64_t)(n + 2 * hkv) * d + 2 * (int64_t)n * d + ngu + ngu / 2) +
           og_attention_scratch(rows, n, d);
}

int og_layer(const og_layer_args *a) {
    const int rows = a->rows, K = a->K, n = a->n, hkv = a->hkv, d = a->d;
    if (rows < 1 || rows > OG_ROWS_MAX || !attention_ok(n, hkv, d, rows) || 2 * a->half > d) return -1;
    const int64_t nqkv = (int64_t)(n + 2 * hkv) * d, ngu = (int64_t)a->wgu.parts * a->wgu.nb;
    if ((int64_t)a->wqkv.parts * a->wqkv.nb != nqkv || (int64_t)a->wo.parts * a->wo.nb != K ||
        (int64_t)a->wdown.parts * a->wdown.nb != K || ngu % 2)
        return -2;
    float *h = a->scratch, *qkv = h + (int64_t)rows * K, *q = qkv + rows * nqkv, *att = q + (int64_t)rows * n * d;
    float *h1 = att + (int64_t)rows * n * d, *y = h1 + (int64_t)rows * K, *ff = y + rows * ngu;
    float *partial = ff + rows * (ngu / 2);
    const og_attn A = {q, (int64_t)n * d, d, rows, n, hkv, d,
                       {a->kb, a->vb, a->page_stride, a->kv_row, a->kv_head, a->tables, a->table_stride,
                        a->page_size},
                       a->seq, a->pos, a->scale, a->softcap, a->window, a->sink, att, (int64_t)n * d, d, partial};
    const int nt = a->nthreads;
#pragma omp parallel num_threads(nt)
    {
#pragma omp single
        rms_rows(a->x, NULL, a->nw1, a->eps1, rows, K, h, NULL);
        product_phase(h, rows, K, &a->wqkv, NULL, NULL, 0, qkv, qkv, nt);
#pragma omp single
        rope_write(qkv, nqkv, rows, n, hkv, d, a->half, a->cos_c, a->sin_c, a->cs, a->rope_rows, a->slots,
                   a->interleaved, q, (int64_t)n * d, d, a->kb, a->vb, a->kv_row, a->kv_head);
        attention_phase(&A);
        product_phase(att, rows, n * d, &a->wo, NULL, a->x, 0, h1, h1, nt);
#pragma omp single
        rms_rows(h1, NULL, a->nw2, a->eps2, rows, K, h, NULL);
        product_phase(h, rows, K, &a->wgu, NULL, NULL, 1, y, ff, nt);
        product_phase(ff, rows, (int)(ngu / 2), &a->wdown, NULL, h1, 0, a->out, a->out, nt);
    }
    return 0;
}
