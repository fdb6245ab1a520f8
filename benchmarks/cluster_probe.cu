// What the split-key attention's hand-off to its combine costs, and what a thread-block cluster would save.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/cluster_probe.cu -o /tmp/cluster_probe
//   /tmp/cluster_probe            (gpu_session.sh cluster)
//
// A standalone micro-benchmark (not the runtime's code): L layers of a decode step's attention chain in one CUDA
// graph, every launch with programmatic dependent launch (PDL) as the runtime's Triton kernels are:
//   attention over `keys` keys cut into `nsplit` splits (one CTA per KV head and split, G query rows each)
//   [-> combine] -> a one-row product (the o-projection's shape; its output is the next layer's q)
// and four ways of merging the splits' partial results (max, sum, accumulator):
//   launch   partials to global memory, a second launch merges them (the runtime's design today)
//   global   partials to global memory, the splits of a KV head form one cluster, `barrier.cluster` with
//            release/acquire (on sm_90 the release is `MEMBAR.ALL.GPU`), rank 0 loads and merges
//   dsmem    each split keeps its partials in its own shared memory, the same barrier, rank 0 reads them
//            through distributed shared memory (`ld.shared::cluster`)
//   async    each split sends its partials into rank 0's shared memory with `st.async` (completing bytes on
//            rank 0's mbarrier): no fence, rank 0 waits on the mbarrier and merges
// Every variant merges with the same code in the same order, so the outputs should be bit-identical to
// `launch`'s (a difference would come from the compiler contracting one instantiation otherwise, or from a
// broken hand-off); the program checks that, then times each graph (interleaved rounds, median), and prints
// µs a layer and the difference to `launch`. The attention arithmetic itself is plain CUDA, the same in all four.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e = (x);                                                                       \
    if (e != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));       \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int D = 64;       // head size
constexpr int BN = 64;      // keys a block
constexpr int MAXG = 8;     // query rows a KV head (G) at most
constexpr int MAXS = 16;    // splits (= cluster size) at most
constexpr int THREADS = 128;

enum Mode { LAUNCH = 0, GLOBAL = 1, DSMEM = 2, ASYNC = 3 };
static const char* kModeName[] = {"launch", "global", "dsmem", "async"};

__device__ __forceinline__ void pdl_begin() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync_release_acquire() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ unsigned map_rank(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

struct Partials {  // one split's results, in shared memory (rank 0's receive slots in `async`)
  float acc[MAXG][D];
  float ml[MAXG][2];
};

struct Smem {
  float q[MAXG][D];
  float p[MAXG][BN];
  Partials own;
  Partials recv[MAXS];  // `async`: the others' partials, written by st.async; `dsmem`/`launch`: unused
  alignas(8) unsigned long long bar;
};

// One merge of `ns` partials for row g, dims d0..d0+3; `get_ml(s, k)` and `get_acc(s, d)` read split s.
template <class ML, class ACC>
__device__ __forceinline__ void merge_row(int ns, int d0, ML get_ml, ACC get_acc, float out[4]) {
  float mx = -INFINITY;
  for (int s = 0; s < ns; ++s) mx = fmaxf(mx, get_ml(s, 0));
  float den = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < ns; ++s) {
    float m = get_ml(s, 0);
    float w = m > -INFINITY ? exp2f(m - mx) : 0.f;
    den += w * get_ml(s, 1);
    for (int i = 0; i < 4; ++i) o[i] += w * get_acc(s, d0 + i);
  }
  float inv = den > 0.f ? 1.f / den : 1.f;
  for (int i = 0; i < 4; ++i) out[i] = o[i] * inv;
}

// q: [HKV*G, D] bf16 (this layer's), k/v: [HKV, keys, D] bf16, out: [HKV*G, D] bf16.
// grid (nsplit, HKV); thread t owns row g = t / 16 and dims d0 = (t % 16) * 4 of the accumulator.
template <int MODE>
__global__ void __launch_bounds__(THREADS) attention(const __nv_bfloat16* __restrict__ q,
                                                     const __nv_bfloat16* __restrict__ k,
                                                     const __nv_bfloat16* __restrict__ v, int keys, int G,
                                                     float scale_log2, float* __restrict__ gacc,
                                                     float* __restrict__ gml, __nv_bfloat16* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw);
  const int sp = blockIdx.x, nsplit = gridDim.x, h = blockIdx.y, t = threadIdx.x;
  const int g = t / 16, d0 = (t % 16) * 4;
  const unsigned rank = (MODE == LAUNCH) ? 0u : cluster_rank();
  const int part_bytes = G * D * 4 + G * 8;
  if (MODE == ASYNC) {
    if (rank == 0 && t == 0) {  // one arrival (this thread's) plus the bytes the other splits will send
      unsigned b = smem_addr(&sm.bar);
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b),
                   "r"((nsplit - 1) * part_bytes)
                   : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_arrive_relaxed();  // waited on before the first send: rank 0's mbarrier is then initialised
  }
  pdl_begin();
  for (int i = t; i < G * D; i += THREADS) sm.q[i / D][i % D] = __bfloat162float(q[(h * G + i / D) * D + i % D]);
  __syncthreads();
  // this split's keys: whole blocks of ceil(keys / nsplit)
  const int per = ((keys + nsplit - 1) / nsplit + BN - 1) / BN * BN;
  const int lo = sp * per, hi = min(lo + per, keys);
  float m_i = -INFINITY, l_i = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  const __nv_bfloat16* kh = k + (size_t)h * keys * D;
  const __nv_bfloat16* vh = v + (size_t)h * keys * D;
  for (int start = lo; start < hi; start += BN) {
    {  // scores: thread t takes key j = t % 64 for rows t / 64, t / 64 + 2, ...
      const int j = t % BN, key = start + j;
      float kr[D];
      if (key < hi) {
        const uint4* kp = reinterpret_cast<const uint4*>(kh + (size_t)key * D);
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          uint4 u = kp[c];
          const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
          for (int i = 0; i < 8; ++i) kr[c * 8 + i] = __bfloat162float(e[i]);
        }
      }
      for (int r = t / BN; r < G; r += THREADS / BN) {
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) s += sm.q[r][d] * kr[d];
        sm.p[r][j] = key < hi ? s * scale_log2 : -INFINITY;
      }
    }
    __syncthreads();
    float alpha = 1.f;
    {  // row g's 16 threads: block max, probabilities, block sum (every lane shuffles; rows >= G only read)
      const int gr = g < G ? g : 0, j0 = (t % 16) * 4;
      float bm = -INFINITY;
      for (int j = j0; j < j0 + 4; ++j) bm = fmaxf(bm, sm.p[gr][j]);
      for (int o = 8; o; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffff, bm, o, 16));
      const float mn = fmaxf(m_i, bm);
      float pj[4], bs = 0.f;
      for (int i = 0; i < 4; ++i) {
        pj[i] = exp2f(sm.p[gr][j0 + i] - mn);
        bs += pj[i];
      }
      for (int o = 8; o; o >>= 1) bs += __shfl_xor_sync(0xffffffff, bs, o, 16);
      if (g < G) {
        for (int i = 0; i < 4; ++i) sm.p[g][j0 + i] = pj[i];
        alpha = exp2f(m_i - mn);
        l_i = l_i * alpha + bs;
        m_i = mn;
      }
    }
    __syncthreads();
    if (g < G) {
      for (int i = 0; i < 4; ++i) acc[i] *= alpha;
      for (int j = 0; j < BN && start + j < hi; ++j) {
        const uint2 u = *reinterpret_cast<const uint2*>(vh + (size_t)(start + j) * D + d0);
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
        const float pj = sm.p[g][j];
        for (int i = 0; i < 4; ++i) acc[i] += pj * __bfloat162float(e[i]);
      }
    }
    __syncthreads();
  }
  // the hand-off
  if (MODE == LAUNCH || MODE == GLOBAL) {
    if (g < G) {
      float* a = gacc + (((size_t)h * nsplit + sp) * G + g) * D + d0;
      *reinterpret_cast<float4*>(a) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (t % 16 == 0) {
        gml[(((size_t)h * nsplit + sp) * G + g) * 2] = m_i;
        gml[(((size_t)h * nsplit + sp) * G + g) * 2 + 1] = l_i;
      }
    }
    if (MODE == LAUNCH) return;
    cluster_sync_release_acquire();
    if (rank != 0) return;
    if (g < G) {
      const size_t base = (size_t)h * nsplit * G;
      float o[4];
      merge_row(
          nsplit, d0, [&](int s, int c) { return __ldcg(gml + ((base + (size_t)s * G + g) * 2 + c)); },
          [&](int s, int d) { return __ldcg(gacc + (base + (size_t)s * G + g) * D + d); }, o);
      for (int i = 0; i < 4; ++i) out[(h * G + g) * D + d0 + i] = __float2bfloat16(o[i]);
    }
    return;
  }
  Partials& own = (MODE == ASYNC && rank == 0) ? sm.recv[0] : sm.own;
  if (MODE == DSMEM || rank == 0) {
    if (g < G) {
      for (int i = 0; i < 4; ++i) own.acc[g][d0 + i] = acc[i];
      if (t % 16 == 0) {
        own.ml[g][0] = m_i;
        own.ml[g][1] = l_i;
      }
    }
  }
  if (MODE == DSMEM) {
    cluster_sync_release_acquire();
    if (rank == 0 && g < G) {
      const unsigned acc0 = smem_addr(&sm.own.acc[g][0]), ml0 = smem_addr(&sm.own.ml[g][0]);
      float o[4];
      merge_row(
          nsplit, d0, [&](int s, int c) { return ld_cluster(map_rank(ml0 + 4 * c, s)); },
          [&](int s, int d) { return ld_cluster(map_rank(acc0 + 4 * d, s)); }, o);
      for (int i = 0; i < 4; ++i) out[(h * G + g) * D + d0 + i] = __float2bfloat16(o[i]);
    }
    cluster_arrive_relaxed();  // the others keep their shared memory until rank 0 has read it
    cluster_wait();
    return;
  }
  // ASYNC
  cluster_wait();  // rank 0's mbarrier is initialised
  if (rank != 0) {
    if (g < G) {
      const unsigned bar = map_rank(smem_addr(&sm.bar), 0);
      const unsigned a = map_rank(smem_addr(&sm.recv[sp].acc[g][d0]), 0);
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(a),
          "f"(acc[0]), "f"(acc[1]), "f"(acc[2]), "f"(acc[3]), "r"(bar)
          : "memory");
      if (t % 16 == 0) {
        const unsigned mlp = map_rank(smem_addr(&sm.recv[sp].ml[g][0]), 0);
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(mlp),
                     "f"(m_i), "f"(l_i), "r"(bar)
                     : "memory");
      }
    }
    return;
  }
  {
    const unsigned b = smem_addr(&sm.bar);
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(b)
          : "memory");
    }
  }
  __syncthreads();  // rank 0's own partials (recv[0]) written by its threads
  if (g < G) {
    float o[4];
    merge_row(
        nsplit, d0, [&](int s, int c) { return sm.recv[s].ml[g][c]; },
        [&](int s, int d) { return sm.recv[s].acc[g][d]; }, o);
    for (int i = 0; i < 4; ++i) out[(h * G + g) * D + d0 + i] = __float2bfloat16(o[i]);
  }
}

// grid (HKV, G), 64 threads in 16 groups of 4 dims: the `launch` variant's second kernel (the same merge).
__global__ void combine(const float* __restrict__ gacc, const float* __restrict__ gml, int nsplit, int G,
                        __nv_bfloat16* __restrict__ out) {
  pdl_begin();
  const int h = blockIdx.x, g = blockIdx.y, d0 = (threadIdx.x % 16) * 4;
  if (threadIdx.x >= 16) return;
  const size_t base = (size_t)h * nsplit * G;
  float o[4];
  merge_row(
      nsplit, d0, [&](int s, int c) { return gml[(base + (size_t)s * G + g) * 2 + c]; },
      [&](int s, int d) { return gacc[(base + (size_t)s * G + g) * D + d]; }, o);
  for (int i = 0; i < 4; ++i) out[(h * G + g) * D + d0 + i] = __float2bfloat16(o[i]);
}

// y = W x, W [n, n] bf16, x and y [n] bf16 (n % 256 == 0, n <= 2048): 8 rows a CTA (2 a warp), each row's
// weights requested before the PDL wait, as the runtime's GEMV does with its first tile.
__global__ void __launch_bounds__(THREADS) gemv(const __nv_bfloat16* __restrict__ w,
                                                const __nv_bfloat16* __restrict__ x, int n,
                                                __nv_bfloat16* __restrict__ y) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint4 wr[2][8];
  const int steps = n / 256;
  for (int r = 0; r < 2; ++r) {
    const int row = blockIdx.x * 8 + warp * 2 + r;
    const uint4* wp = reinterpret_cast<const uint4*>(w + (size_t)row * n);
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if (c < steps) wr[r][c] = __ldcs(wp + c * 32 + lane);
  }
  pdl_begin();
  const uint4* xp = reinterpret_cast<const uint4*>(x);
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (c >= steps) break;
    const uint4 xu = xp[c * 32 + lane];
    const __nv_bfloat16* xe = reinterpret_cast<const __nv_bfloat16*>(&xu);
    for (int r = 0; r < 2; ++r) {
      const __nv_bfloat16* we = reinterpret_cast<const __nv_bfloat16*>(&wr[r][c]);
      for (int i = 0; i < 8; ++i) s[r] += __bfloat162float(we[i]) * __bfloat162float(xe[i]);
    }
  }
  for (int r = 0; r < 2; ++r) {
    for (int o = 16; o; o >>= 1) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
    if (lane == 0) y[blockIdx.x * 8 + warp * 2 + r] = __float2bfloat16(s[r]);
  }
}

using Attention = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, int, int, float,
                          float*, float*, __nv_bfloat16*);
static const Attention kAttention[4] = {attention<LAUNCH>, attention<GLOBAL>, attention<DSMEM>, attention<ASYNC>};

static cudaLaunchAttribute cluster_attr(int cluster) {
  cudaLaunchAttribute at;
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = cluster;
  at.val.clusterDim.y = 1;
  at.val.clusterDim.z = 1;
  return at;
}

struct Shape {
  const char* name;
  int hkv, g, keys, nsplit, layers;
};

template <class K, class... A>
static void launch(K kern, dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cluster, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  int na = 1;
  if (cluster > 1) at[na++] = cluster_attr(cluster);
  cfg.attrs = at;
  cfg.numAttrs = na;
  CK(cudaLaunchKernelEx(&cfg, kern, args...));
}

static int active_clusters(int mode, dim3 grid, int cluster) {  // clusters of this size that fit at once (0: none)
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = sizeof(Smem);
  cudaLaunchAttribute at = cluster_attr(cluster);
  cfg.attrs = &at;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kAttention[mode], &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5, replays = argc > 2 ? atoi(argv[2]) : 200;
  for (int mode = 0; mode < 4; ++mode) {
    CK(cudaFuncSetAttribute(kAttention[mode], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem)));
    if (mode != LAUNCH) CK(cudaFuncSetAttribute(kAttention[mode], cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs, smem a CTA %zu B\n", prop.name, prop.multiProcessorCount, sizeof(Smem));
  const Shape shapes[] = {{"0.5b", 2, 7, 528, 8, 24},  {"1b", 8, 4, 528, 8, 16},     {"0.5b", 2, 7, 528, 16, 24},
                          {"1b", 8, 4, 528, 16, 16}, {"0.5b", 2, 7, 4096, 16, 24}, {"1b", 8, 4, 4096, 16, 16}};
  printf("| shape | keys | splits | launch µs/layer | global | dsmem | async | bits equal (g/d/a) |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const int n = s.hkv * s.g * D;  // q / out width; the product is n x n (padded to a multiple of 256)
    const int np = (n + 255) / 256 * 256;
    std::vector<__nv_bfloat16> hk((size_t)s.layers * s.hkv * s.keys * D), hw((size_t)s.layers * np * np),
        hq(np, __float2bfloat16(0.f));
    srand(1);
    auto rnd = [] { return (float)rand() / RAND_MAX * 2.f - 1.f; };
    for (auto& e : hk) e = __float2bfloat16(rnd());
    for (size_t i = 0; i < hw.size(); ++i) {
      const size_t r = (i / np) % np, c = i % np;
      hw[i] = __float2bfloat16(r < (size_t)n && c < (size_t)n ? rnd() * 1.7f / sqrtf((float)n) : 0.f);
    }
    for (int i = 0; i < n; ++i) hq[i] = __float2bfloat16(rnd());
    __nv_bfloat16 *k, *v, *w, *x;  // x: [2 * layers + 1][np]: layer l's q at row 2l, its output at 2l + 1
    float *gacc, *gml;
    CK(cudaMalloc(&k, hk.size() * 2));
    CK(cudaMalloc(&v, hk.size() * 2));
    CK(cudaMalloc(&w, hw.size() * 2));
    CK(cudaMalloc(&x, (size_t)(2 * s.layers + 1) * np * 2));
    CK(cudaMalloc(&gacc, (size_t)s.hkv * s.nsplit * s.g * D * 4));
    CK(cudaMalloc(&gml, (size_t)s.hkv * s.nsplit * s.g * 8));
    CK(cudaMemcpy(k, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
    for (auto& e : hk) e = __float2bfloat16(rnd());
    CK(cudaMemcpy(v, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(x, 0, (size_t)(2 * s.layers + 1) * np * 2));
    CK(cudaMemcpy(x, hq.data(), np * 2, cudaMemcpyHostToDevice));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const dim3 grid(s.nsplit, s.hkv);
    const int fit[4] = {1, active_clusters(GLOBAL, grid, s.nsplit), active_clusters(DSMEM, grid, s.nsplit),
                        active_clusters(ASYNC, grid, s.nsplit)};
    cudaGraphExec_t exec[4];
    const float scale = 0.125f * 1.4426950408889634f;
    for (int mode = 0; mode < 4; ++mode) {
      if (!fit[mode]) continue;
      cudaGraph_t graph;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int l = 0; l < s.layers; ++l) {
        const size_t kv = (size_t)l * s.hkv * s.keys * D;
        __nv_bfloat16* q = x + (size_t)(2 * l) * np;
        __nv_bfloat16* o = q + np;
        launch(kAttention[mode], grid, dim3(THREADS), sizeof(Smem), st, mode == LAUNCH ? 1 : s.nsplit,
               (const __nv_bfloat16*)q, (const __nv_bfloat16*)(k + kv), (const __nv_bfloat16*)(v + kv), s.keys, s.g,
               scale, gacc, gml, o);
        if (mode == LAUNCH)
          launch(combine, dim3(s.hkv, s.g), dim3(64), 0, st, 1, (const float*)gacc, (const float*)gml, s.nsplit, s.g,
                 o);
        launch(gemv, dim3(np / 8), dim3(THREADS), 0, st, 1, (const __nv_bfloat16*)(w + (size_t)l * np * np),
               (const __nv_bfloat16*)o, np, q + 2 * np);
      }
      CK(cudaStreamEndCapture(st, &graph));
      CK(cudaGraphInstantiate(&exec[mode], graph, 0));
      CK(cudaGraphDestroy(graph));
    }
    // bits: each variant's outputs of every layer against `launch`'s
    std::vector<__nv_bfloat16> ref((size_t)(2 * s.layers + 1) * np), got(ref.size());
    bool equal[4] = {true, true, true, true};
    for (int mode = 0; mode < 4; ++mode) {
      if (!fit[mode]) continue;
      CK(cudaMemcpy(x, hq.data(), np * 2, cudaMemcpyHostToDevice));
      CK(cudaGraphLaunch(exec[mode], st));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(mode ? got.data() : ref.data(), x, ref.size() * 2, cudaMemcpyDeviceToHost));
      if (mode) equal[mode] = memcmp(got.data(), ref.data(), ref.size() * 2) == 0;
    }
    float last = __bfloat162float(ref[(size_t)(2 * s.layers) * np]);
    if (!std::isfinite(last)) printf("(non-finite output: %f)\n", last);
    // time: rounds of every variant in turn, `replays` replays each, median over rounds
    std::vector<float> ms[4];
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int mode = 0; mode < 4; ++mode)
      for (int i = 0; i < 20 && fit[mode]; ++i) CK(cudaGraphLaunch(exec[mode], st));
    for (int r = 0; r < rounds; ++r)
      for (int mode = 0; mode < 4; ++mode) {
        if (!fit[mode]) continue;
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < replays; ++i) CK(cudaGraphLaunch(exec[mode], st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms[mode].push_back(t / replays);
      }
    float med[4] = {NAN, NAN, NAN, NAN};
    for (int mode = 0; mode < 4; ++mode) {
      if (!fit[mode]) continue;
      std::sort(ms[mode].begin(), ms[mode].end());
      med[mode] = ms[mode][ms[mode].size() / 2] * 1000.f / s.layers;
    }
    printf("| %s | %d | %d | %.2f | %.2f (%+.2f) | %.2f (%+.2f) | %.2f (%+.2f) | %s/%s/%s |\n", s.name, s.keys,
           s.nsplit, med[0], med[1], med[1] - med[0], med[2], med[2] - med[0], med[3], med[3] - med[0],
           equal[1] ? "yes" : "NO", equal[2] ? "yes" : "NO", equal[3] ? "yes" : "NO");
    printf("  (clusters of %d that fit at once: global %d, dsmem %d, async %d)\n", s.nsplit, fit[1], fit[2], fit[3]);
    for (int mode = 0; mode < 4; ++mode)
      if (fit[mode]) CK(cudaGraphExecDestroy(exec[mode]));
    CK(cudaStreamDestroy(st));
    CK(cudaFree(k));
    CK(cudaFree(v));
    CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(gacc));
    CK(cudaFree(gml));
  }
  printf("(µs a layer: one attention [+ combine] + one %s product per layer, graph replay time / layers; "
         "%d rounds x %d replays, median; modes: %s, %s, %s, %s)\n",
         "n x n", rounds, replays, kModeName[0], kModeName[1], kModeName[2], kModeName[3]);
  return 0;
}
