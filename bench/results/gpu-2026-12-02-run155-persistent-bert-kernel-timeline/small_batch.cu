// A whole BERT encoder for batches of at most 64 tokens in one persistent kernel (engine/small_batch.py).
//
// One block per SM runs every layer; the blocks wait for each other at grid-wide barriers between the
// steps that need another block's results (five a layer). Each matrix product spreads its output
// columns over all the warps of the grid: a warp reads a column's weights once (the products of a few
// tokens are bound by reading the weights) and multiplies them with up to ROWS tokens' inputs, which
// every block keeps in shared memory. The LayerNorms run where their rows are read, in every block,
// so they cost no barrier. Arithmetic is float32; weights and the output are bf16 or fp16.
// Built by nvcc into a shared library that Python calls through ctypes: no torch headers.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace cg = cooperative_groups;

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int ROWS = 16;  // token rows per pass through shared memory
constexpr unsigned FULL = 0xffffffffu;

// The pointers of one layer's tensors, in this order, in SmallBertParams.layers.
enum LayerTensor { QKV_W, QKV_B, OUT_W, OUT_B, LN1_W, LN1_B, UP_W, UP_B, DOWN_W, DOWN_B, LN2_W, LN2_B, PER_LAYER };
enum Activation { GELU_ERF = 0, GELU_TANH = 1, RELU = 2 };

struct SmallBertParams {
    const int* inputs;         // the engine's layout: ids, positions, token types, sequence ids (tokens each), cu_seqlens
    int tokens;                // the batch's padded token count (the length of each input row)
    int slots;                 // sequence slots; cu_seqlens[slots] is the number of real tokens
    const void* word;          // [vocab, hidden]
    const void* position;      // [positions, hidden]
    const void* token_type;    // [types, hidden]
    const void* embed_norm_w;  // [hidden]
    const void* embed_norm_b;
    const unsigned long long* layers;  // [num_layers][PER_LAYER] device addresses
    int num_layers;
    int hidden;
    int heads;
    int intermediate;
    int activation;
    int position_offset;
    float eps;
    float* y;    // [64, hidden] a sublayer's output before its LayerNorm
    float* x;    // [64, hidden] the LayerNorm's output: the next sublayer's residual
    float* qkv;  // [64, 3 * hidden]
    float* context;  // [64, hidden]
    float* up;   // [64, intermediate]
    void* out;   // [tokens, hidden] the last layer's output; rows past the real tokens are zeros
    unsigned long long* timeline;  // null, or where block 0 writes the time at each barrier (nanoseconds)
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half(v); }

// Four consecutive weights from one 8-byte read.
template <typename T> __device__ __forceinline__ float4 load4(const T* p) {
    uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    const T* v = reinterpret_cast<const T*>(&raw);
    return make_float4(to_float(v[0]), to_float(v[1]), to_float(v[2]), to_float(v[3]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL, v, offset);
    return v;
}

__device__ __forceinline__ float activate(float v, int activation) {
    if (activation == GELU_ERF) return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    if (activation == GELU_TANH) return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    return fmaxf(v, 0.0f);
}

// LayerNorm of `rows` rows of `width` floats in shared memory, in place; a warp per row.
template <typename T>
__device__ void normalize_rows(float* rows_smem, int rows, int width, const T* weight, const T* bias, float eps) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < rows; r += WARPS) {
        float* row = rows_smem + r * width;
        float sum = 0.0f;
        for (int i = lane; i < width; i += 32) sum += row[i];
        float mean = warp_sum(sum) / width;
        float squares = 0.0f;
        for (int i = lane; i < width; i += 32) { float d = row[i] - mean; squares += d * d; }
        float inv = rsqrtf(warp_sum(squares) / width + eps);
        for (int i = lane; i < width; i += 32) row[i] = (row[i] - mean) * inv * to_float(weight[i]) + to_float(bias[i]);
    }
}

// Rows [row0, row0 + rows) of a float32 [*, width] buffer into shared memory.
__device__ void stage_rows(float* rows_smem, const float* src, int row0, int rows, int width) {
    const float4* from = reinterpret_cast<const float4*>(src + (size_t)row0 * width);
    float4* to = reinterpret_cast<float4*>(rows_smem);
    for (int i = threadIdx.x; i < rows * width / 4; i += THREADS) to[i] = __ldcg(from + i);  // L2: written this launch
}

// The embedding sums of rows [row0, row0 + rows) into shared memory.
template <typename T>
__device__ void stage_embeddings(float* rows_smem, const SmallBertParams& p, int row0, int rows) {
    const int* ids = p.inputs;
    const int* positions = p.inputs + p.tokens;
    const int* types = p.inputs + 2 * p.tokens;
    const T* word = static_cast<const T*>(p.word);
    const T* position = static_cast<const T*>(p.position);
    const T* token_type = static_cast<const T*>(p.token_type);
    for (int i = threadIdx.x; i < rows * p.hidden; i += THREADS) {
        int r = i / p.hidden, c = i % p.hidden, t = row0 + r;
        rows_smem[i] = to_float(word[(size_t)ids[t] * p.hidden + c]) +
                       to_float(position[(size_t)(positions[t] + p.position_offset) * p.hidden + c]) +
                       to_float(token_type[(size_t)types[t] * p.hidden + c]);
    }
}

enum Epilogue { STORE, ADD_RESIDUAL, ACTIVATE };

constexpr int MAX_STEPS = 24;  // 128 weights a step across a warp: rows of at most 3,072

// A warp's first output column of a product, read into registers before the barrier that the product waits
// for: the weights do not depend on the steps before, so their reading overlaps the wait.
struct ColumnWeights { uint2 raw[MAX_STEPS]; };

template <typename T>
__device__ __forceinline__ void load_column(const T* weight, int width, int col, int columns, ColumnWeights& w) {
    int lane = threadIdx.x % 32;
    const T* row = weight + (size_t)min(col, columns - 1) * width;
#pragma unroll
    for (int s = 0; s < MAX_STEPS; ++s) {
        int k = lane * 4 + s * 128;
        w.raw[s] = k < width ? __ldg(reinterpret_cast<const uint2*>(row + k)) : make_uint2(0, 0);
    }
}

__device__ __forceinline__ int first_column() { return blockIdx.x * WARPS + threadIdx.x / 32; }

// out[row0 + r][col] = epilogue(rows_smem[r] . weight[col] + bias[col]) for every column of weight
// [columns, width], spread over every warp of the grid, one column at a time per warp; `first` holds
// the weights of the warp's first column.
template <typename T>
__device__ __forceinline__ void matmul_rows(const float* rows_smem, int rows, int row0, int width, const T* weight, const T* bias,
                            int columns, float* out, Epilogue epilogue, const float* residual, int activation,
                            const ColumnWeights& first) {
    int lane = threadIdx.x % 32;
    int warps = gridDim.x * WARPS;
    ColumnWeights w = first;
    for (int col = first_column(); col < columns; col += warps) {
        if (col != first_column()) load_column(weight, width, col, columns, w);
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
#pragma unroll
        for (int s = 0; s < MAX_STEPS; ++s) {
            int k = lane * 4 + s * 128;
            if (k < width) {
                const T* v = reinterpret_cast<const T*>(&w.raw[s]);
                float4 w4 = make_float4(to_float(v[0]), to_float(v[1]), to_float(v[2]), to_float(v[3]));
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        float4 x4 = *reinterpret_cast<const float4*>(rows_smem + r * width + k);
                        acc[r] += x4.x * w4.x + x4.y * w4.y + x4.z * w4.z + x4.w * w4.w;
                    }
                }
            }
        }
        float b = to_float(bias[col]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < rows) {
                float v = warp_sum(acc[r]) + b;
                if (lane == r) {
                    size_t at = (size_t)(row0 + r) * columns + col;
                    if (epilogue == ADD_RESIDUAL) v += __ldcg(residual + at);
                    else if (epilogue == ACTIVATE) v = activate(v, activation);
                    out[at] = v;
                }
            }
        }
    }
}

// Attention of every (token, head) inside its own sequence, a warp each, its lanes over the keys (at most
// 64: SMALL_BATCH_TOKENS), so that every key's row is read at once; head_dim a multiple of 4, at most 128.
__device__ void attend(const SmallBertParams& p, int real_tokens) {
    const int* seq_ids = p.inputs + 3 * p.tokens;
    const int* cu_seqlens = p.inputs + 4 * p.tokens;
    int hidden = p.hidden, head_dim = hidden / p.heads, per_lane = head_dim / 32;
    float scale = rsqrtf((float)head_dim);
    int lane = threadIdx.x % 32;
    int warps = gridDim.x * WARPS;
    for (int item = first_column(); item < real_tokens * p.heads; item += warps) {
        int t = item / p.heads, h = item % p.heads, seq = seq_ids[t];
        int start = cu_seqlens[seq], keys = cu_seqlens[seq + 1] - start;
        const float4* q = reinterpret_cast<const float4*>(p.qkv + (size_t)t * 3 * hidden + h * head_dim);
        float score[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            int j = lane + 32 * c;
            score[c] = -INFINITY;
            if (j < keys) {
                const float4* k = reinterpret_cast<const float4*>(p.qkv + (size_t)(start + j) * 3 * hidden + hidden + h * head_dim);
                float dot = 0.0f;
                for (int e = 0; e < head_dim / 4; ++e) {
                    float4 a = __ldcg(q + e), b = __ldcg(k + e);
                    dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                }
                score[c] = dot * scale;
            }
        }
        float top = fmaxf(score[0], score[1]);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, offset));
        float weight[2] = {__expf(score[0] - top), __expf(score[1] - top)};  // exp(-inf) = 0 for missing keys
        float total = warp_sum(weight[0] + weight[1]);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* v = p.qkv + (size_t)start * 3 * hidden + 2 * hidden + h * head_dim + lane;
#pragma unroll 4
        for (int j = 0; j < keys; ++j) {
            float w = __shfl_sync(FULL, j < 32 ? weight[0] : weight[1], j & 31);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (i < per_lane) acc[i] += w * __ldcg(v + (size_t)j * 3 * hidden + 32 * i);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < per_lane) p.context[(size_t)t * hidden + h * head_dim + lane + 32 * i] = acc[i] / total;
    }
}

__device__ __forceinline__ void mark(const SmallBertParams& p, int& at) {
    if (p.timeline != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        p.timeline[at] = now;
    }
    ++at;
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 1) small_bert_kernel(SmallBertParams p) {
    extern __shared__ float4 shared_raw[];
    float* rows_smem = reinterpret_cast<float*>(shared_raw);
    cg::grid_group grid = cg::this_grid();
    const int real_tokens = p.inputs[4 * p.tokens + p.slots];
    const int hidden = p.hidden;
    int at = 0;
    mark(p, at);
    ColumnWeights next;
    load_column(reinterpret_cast<const T*>(p.layers[QKV_W]), hidden, first_column(), 3 * hidden, next);

    for (int layer = 0; layer < p.num_layers; ++layer) {
        const unsigned long long* tensors = p.layers + layer * PER_LAYER;
        auto tensor = [&](int which) { return reinterpret_cast<const T*>(tensors[which]); };
        // The layer's input: the embeddings, or the last layer's output, normalised; then q, k, v.
        const T* norm_w = layer == 0 ? static_cast<const T*>(p.embed_norm_w)
                                     : reinterpret_cast<const T*>(p.layers[(layer - 1) * PER_LAYER + LN2_W]);
        const T* norm_b = layer == 0 ? static_cast<const T*>(p.embed_norm_b)
                                     : reinterpret_cast<const T*>(p.layers[(layer - 1) * PER_LAYER + LN2_B]);
        for (int row0 = 0; row0 < real_tokens; row0 += ROWS) {
            int rows = min(ROWS, real_tokens - row0);
            __syncthreads();
            if (layer == 0) stage_embeddings<T>(rows_smem, p, row0, rows);
            else stage_rows(rows_smem, p.y, row0, rows, hidden);
            __syncthreads();
            normalize_rows(rows_smem, rows, hidden, norm_w, norm_b, p.eps);
            __syncthreads();
            if (blockIdx.x == 0)
                for (int i = threadIdx.x; i < rows * hidden; i += THREADS) p.x[(size_t)row0 * hidden + i] = rows_smem[i];
            matmul_rows(rows_smem, rows, row0, hidden, tensor(QKV_W), tensor(QKV_B), 3 * hidden, p.qkv, STORE,
                        nullptr, 0, next);
        }
        load_column(tensor(OUT_W), hidden, first_column(), hidden, next);  // read while the grid gathers
        mark(p, at);
        grid.sync();
        mark(p, at);
        attend(p, real_tokens);
        mark(p, at);
        grid.sync();
        mark(p, at);
        // The attention output projection, plus the residual.
        for (int row0 = 0; row0 < real_tokens; row0 += ROWS) {
            int rows = min(ROWS, real_tokens - row0);
            __syncthreads();
            stage_rows(rows_smem, p.context, row0, rows, hidden);
            __syncthreads();
            matmul_rows(rows_smem, rows, row0, hidden, tensor(OUT_W), tensor(OUT_B), hidden, p.y, ADD_RESIDUAL, p.x,
                        0, next);
        }
        load_column(tensor(UP_W), hidden, first_column(), p.intermediate, next);
        mark(p, at);
        grid.sync();
        mark(p, at);
        // Normalised, it is the feed-forward's input and residual.
        for (int row0 = 0; row0 < real_tokens; row0 += ROWS) {
            int rows = min(ROWS, real_tokens - row0);
            __syncthreads();
            stage_rows(rows_smem, p.y, row0, rows, hidden);
            __syncthreads();
            normalize_rows(rows_smem, rows, hidden, tensor(LN1_W), tensor(LN1_B), p.eps);
            __syncthreads();
            if (blockIdx.x == 0)
                for (int i = threadIdx.x; i < rows * hidden; i += THREADS) p.x[(size_t)row0 * hidden + i] = rows_smem[i];
            matmul_rows(rows_smem, rows, row0, hidden, tensor(UP_W), tensor(UP_B), p.intermediate, p.up, ACTIVATE,
                        nullptr, p.activation, next);
        }
        load_column(tensor(DOWN_W), p.intermediate, first_column(), hidden, next);
        mark(p, at);
        grid.sync();
        mark(p, at);
        for (int row0 = 0; row0 < real_tokens; row0 += ROWS) {
            int rows = min(ROWS, real_tokens - row0);
            __syncthreads();
            stage_rows(rows_smem, p.up, row0, rows, p.intermediate);
            __syncthreads();
            matmul_rows(rows_smem, rows, row0, p.intermediate, tensor(DOWN_W), tensor(DOWN_B), hidden, p.y,
                        ADD_RESIDUAL, p.x, 0, next);
        }
        if (layer + 1 < p.num_layers)
            load_column(reinterpret_cast<const T*>(p.layers[(layer + 1) * PER_LAYER + QKV_W]), hidden, first_column(),
                        3 * hidden, next);
        mark(p, at);
        grid.sync();
        mark(p, at);
    }
    // The last LayerNorm, a warp per row across the grid, into the output; zeros past the real tokens.
    const T* norm_w = reinterpret_cast<const T*>(p.layers[(p.num_layers - 1) * PER_LAYER + LN2_W]);
    const T* norm_b = reinterpret_cast<const T*>(p.layers[(p.num_layers - 1) * PER_LAYER + LN2_B]);
    T* out = static_cast<T*>(p.out);
    int lane = threadIdx.x % 32;
    for (int t = first_column(); t < p.tokens; t += gridDim.x * WARPS) {
        if (t >= real_tokens) {
            for (int i = lane; i < hidden; i += 32) out[(size_t)t * hidden + i] = from_float<T>(0.0f);
            continue;
        }
        const float* row = p.y + (size_t)t * hidden;
        float sum = 0.0f;
        for (int i = lane; i < hidden; i += 32) sum += __ldcg(row + i);
        float mean = warp_sum(sum) / hidden;
        float squares = 0.0f;
        for (int i = lane; i < hidden; i += 32) { float d = __ldcg(row + i) - mean; squares += d * d; }
        float inv = rsqrtf(warp_sum(squares) / hidden + p.eps);
        for (int i = lane; i < hidden; i += 32)
            out[(size_t)t * hidden + i] =
                from_float<T>((__ldcg(row + i) - mean) * inv * to_float(norm_w[i]) + to_float(norm_b[i]));
    }
    mark(p, at);
}

template <typename T>
static int launch(const SmallBertParams* params, int blocks, int shared_bytes, cudaStream_t stream) {
    auto kernel = small_bert_kernel<T>;
    cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
    if (status != cudaSuccess) return status;
    SmallBertParams copy = *params;
    void* args[] = {&copy};
    return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(blocks), dim3(THREADS), args,
                                       shared_bytes, stream);
}

extern "C" {

// bf16: dtype 0, fp16: dtype 1. Returns a cudaError_t (0 on success).
int small_bert_launch(const SmallBertParams* params, int dtype, int blocks, int shared_bytes, void* stream) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    return dtype == 0 ? launch<__nv_bfloat16>(params, blocks, shared_bytes, s) : launch<__half>(params, blocks, shared_bytes, s);
}

// How many blocks of the kernel fit on one SM with this much shared memory (0: none).
int small_bert_blocks_per_sm(int dtype, int shared_bytes) {
    int blocks = 0;
    void* kernel = dtype == 0 ? reinterpret_cast<void*>(small_bert_kernel<__nv_bfloat16>)
                              : reinterpret_cast<void*>(small_bert_kernel<__half>);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) != cudaSuccess) return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, THREADS, shared_bytes) != cudaSuccess) return 0;
    return blocks;
}

const char* small_bert_error(int status) { return cudaGetErrorString(static_cast<cudaError_t>(status)); }

int small_bert_sizeof_params() { return sizeof(SmallBertParams); }
}
