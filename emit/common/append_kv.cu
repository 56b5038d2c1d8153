// fadsl_append_kv: write new tokens' keys and values into a KV cache after each batch's
// cache_seqlens[b] keys, guarded on the device (fadsl/runtime/append.py launches it).
//
// The lengths and the page table stay on the device (reading them on the host would wait
// for the GPU), so the kernel checks them itself: a token whose position is past its batch's
// capacity, or whose page-table entry lies outside the cache, is not written at all. One
// malformed request then leaves the other batches' rows and the CUDA context intact; the
// attention call after it turns that batch's rows NaN.
//
// Grid (new_tokens, min(batch, 65535)), 128 threads: one CTA per (token t, batch b); CTAs
// loop over b past gridDim.y. Every stride is in bytes.

struct AppendKvParams {
    const char* k_new;  // (batch, new_tokens, heads_kv, head_dim); a row contiguous
    const char* v_new;
    char* k_cache;  // contiguous (batch, capacity, ...) or paged (pages, page_size, ...)
    char* v_cache;
    const int* seqlens;     // (batch,): the keys each batch's cache holds
    const int* page_table;  // (batch, max_pages); null: a contiguous cache
    int* seqlens_out;       // (batch,): seqlens + new_tokens; null: not written
    long long k_new_batch_stride;
    long long k_new_row_stride;
    long long v_new_batch_stride;
    long long v_new_row_stride;
    long long k_cache_batch_stride;  // a batch's (contiguous) or a page's (paged)
    long long k_cache_row_stride;
    long long v_cache_batch_stride;
    long long v_cache_row_stride;
    long long page_table_stride;  // in int32 entries
    long long capacity;           // a batch's rows: the cache's, or max_pages * page_size
    long long num_pages;          // paged: the cache's pages
    long long elem_bytes;         // 2, or 1 (float8): the copy's unit without 16-byte vectors
    int row_bytes;                // heads_kv * head_dim * elem_bytes
    int new_tokens;
    int page_size;  // paged: rows a page (> 0)
    int batch;
    int vector16;  // every base, stride and row_bytes a multiple of 16 (last: a plan writes
                   // it with the 4 bytes of padding after it, as 8 bytes)
};

// Copy `bytes` bytes in units of T, one a thread per step.
template <typename T>
__device__ __forceinline__ void copy_units(char* dst, const char* src, int bytes)
{
    for (int i = threadIdx.x * (int)sizeof(T); i < bytes; i += blockDim.x * (int)sizeof(T))
        *reinterpret_cast<T*>(dst + i) = *reinterpret_cast<const T*>(src + i);
}

// Copy one row of `bytes` bytes: 16 bytes a thread per step where everything is aligned to
// 16, else the element's size, the only alignment the dtype promises: 2 bytes for 16-bit
// caches, 1 for 8-bit ones (whose rows and bases may be odd, so 2-byte units would
// misalign or copy a byte past the row).
__device__ __forceinline__ void copy_row(char* dst, const char* src, int bytes, bool vector16,
                                         int elem_bytes)
{
    if (vector16)
        copy_units<uint4>(dst, src, bytes);
    else if (elem_bytes == 2)
        copy_units<unsigned short>(dst, src, bytes);
    else
        copy_units<unsigned char>(dst, src, bytes);
}

extern "C" __global__ void __launch_bounds__(128) fadsl_append_kv(const AppendKvParams p)
{
    const int t = blockIdx.x;
    for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
        const int s = p.seqlens[b];
        // 64-bit: s + t may pass INT_MAX
        const long long pos = (long long)s + t;
        if (t == 0 && threadIdx.x == 0 && p.seqlens_out != nullptr) {
            // saturate: an overflowing length stays out of range (past any capacity) instead
            // of wrapping negative; a negative one stays negative (out of range too)
            long long next = s >= 0 ? (long long)s + p.new_tokens : (long long)s;
            p.seqlens_out[b] = (int)(next > 2147483647LL ? 2147483647LL : next);
        }
        // a negative length or a position past the capacity: nothing to write (the attention
        // call NaNs this batch's rows)
        if (s < 0 || pos >= p.capacity)
            continue;
        long long k_offset, v_offset;
        if (p.page_table == nullptr) {
            k_offset = b * p.k_cache_batch_stride + pos * p.k_cache_row_stride;
            v_offset = b * p.v_cache_batch_stride + pos * p.v_cache_row_stride;
        } else {
            // pos < capacity = max_pages * page_size keeps the entry inside b's table row
            const int page = p.page_table[b * p.page_table_stride + pos / p.page_size];
            // an entry outside the cache (-1 for "none", or a stale index): write nothing
            if (page < 0 || page >= p.num_pages)
                continue;
            const long long row = pos % p.page_size;
            k_offset = page * p.k_cache_batch_stride + row * p.k_cache_row_stride;
            v_offset = page * p.v_cache_batch_stride + row * p.v_cache_row_stride;
        }
        const bool vector16 = p.vector16 != 0;
        const int elem_bytes = (int)p.elem_bytes;
        copy_row(p.k_cache + k_offset,
                 p.k_new + b * p.k_new_batch_stride + t * p.k_new_row_stride, p.row_bytes,
                 vector16, elem_bytes);
        copy_row(p.v_cache + v_offset,
                 p.v_new + b * p.v_new_batch_stride + t * p.v_new_row_stride, p.row_bytes,
                 vector16, elem_bytes);
    }
}
