/* 1-bit codec kernels for bunsan.compression (see native.py, which compiles and loads this file).
 *
 * Seide et al. (2014), "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
 * Distributed Training of Speech DNNs": per chunk, code 1 where v >= 0, and two reconstruction
 * values, the means of the non-negative and of the negative entries. Payload format and
 * arithmetic are those of bunsan/compression/quantize.py, bit for bit where it matters:
 *
 *   decode:   value = code * step + offset   (two float32 roundings, as torch computes it)
 *   residual: v - decode(payload)            (exactly, so error feedback loses nothing)
 *
 * Why C: torch runs one pass over memory per operation; encoding with error feedback takes
 * about ten of them, decoding three. Here a chunk (2 KiB at 512 elements) is read from memory
 * once, kept in L1 for its second pass, and the packed bits are written once.
 *
 * Plain C99 with SSE2 intrinsics where the machine has them (every x86-64), scalar elsewhere.
 */
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define BUNSAN_SSE2 1
#else
#define BUNSAN_SSE2 0
#endif

/* The two reconstruction values of one chunk: offset (negative side) and step. */
static void chunk_means(const float *v, int64_t len, float *offset, float *step) {
    float sum_pos = 0.0f, sum_neg = 0.0f, low, high;
    int64_t count_pos = 0, i = 0;
#if BUNSAN_SSE2
    __m128 zero = _mm_setzero_ps();
    __m128 sp0 = zero, sp1 = zero, sn0 = zero, sn1 = zero;
    __m128i c0 = _mm_setzero_si128(), c1 = _mm_setzero_si128();
    __m128 lo0 = _mm_set1_ps(v[0]), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    for (; i + 8 <= len; i += 8) {
        __m128 a = _mm_loadu_ps(v + i), b = _mm_loadu_ps(v + i + 4);
        __m128 ma = _mm_cmpge_ps(a, zero), mb = _mm_cmpge_ps(b, zero);
        sp0 = _mm_add_ps(sp0, _mm_and_ps(ma, a));
        sp1 = _mm_add_ps(sp1, _mm_and_ps(mb, b));
        sn0 = _mm_add_ps(sn0, _mm_andnot_ps(ma, a));
        sn1 = _mm_add_ps(sn1, _mm_andnot_ps(mb, b));
        c0 = _mm_sub_epi32(c0, _mm_castps_si128(ma)); /* a true lane is -1 */
        c1 = _mm_sub_epi32(c1, _mm_castps_si128(mb));
        lo0 = _mm_min_ps(lo0, a); hi0 = _mm_max_ps(hi0, a);
        lo1 = _mm_min_ps(lo1, b); hi1 = _mm_max_ps(hi1, b);
    }
    float fp[4], fn[4], fl[4], fh[4];
    int32_t ci[4];
    _mm_storeu_ps(fp, _mm_add_ps(sp0, sp1));
    _mm_storeu_ps(fn, _mm_add_ps(sn0, sn1));
    _mm_storeu_ps(fl, _mm_min_ps(lo0, lo1));
    _mm_storeu_ps(fh, _mm_max_ps(hi0, hi1));
    _mm_storeu_si128((__m128i *)ci, _mm_add_epi32(c0, c1));
    sum_pos = (fp[0] + fp[1]) + (fp[2] + fp[3]);
    sum_neg = (fn[0] + fn[1]) + (fn[2] + fn[3]);
    count_pos = (int64_t)ci[0] + ci[1] + ci[2] + ci[3];
    low = fl[0]; high = fh[0];
    for (int k = 1; k < 4; k++) {
        if (fl[k] < low) low = fl[k];
        if (fh[k] > high) high = fh[k];
    }
#else
    low = high = v[0];
#endif
    for (; i < len; i++) {
        float a = v[i];
        if (a >= 0.0f) { sum_pos += a; count_pos++; } else { sum_neg += a; }
        if (a < low) low = a;
        if (a > high) high = a;
    }
    int64_t count_neg = len - count_pos;
    float mean_pos = count_pos ? sum_pos / (float)count_pos : 0.0f;
    float mean_neg = count_neg ? sum_neg / (float)count_neg : 0.0f;
    if (low == high) { /* a rounded sum / count can miss a constant chunk's value: take it exactly */
        mean_pos = high > 0.0f ? high : 0.0f;
        mean_neg = low < 0.0f ? low : 0.0f;
    }
    *offset = mean_neg;
    *step = mean_pos - mean_neg;
}

/* Codes of v[0..len) into packed (bit k of byte k / 8 for element k; unused high bits zero);
 * with residual, v becomes v - decode, in place. */
static void chunk_codes(float *v, int64_t len, float offset, float step, uint8_t *packed, int residual) {
    float zero = 0.0f, one = 1.0f;
    float d0 = zero * step + offset, d1 = one * step + offset; /* what decode computes */
    int64_t i = 0;
#if BUNSAN_SSE2
    __m128 z = _mm_setzero_ps(), v0 = _mm_set1_ps(d0), v1 = _mm_set1_ps(d1);
    for (; i + 8 <= len; i += 8) {
        __m128 a = _mm_loadu_ps(v + i), b = _mm_loadu_ps(v + i + 4);
        __m128 ma = _mm_cmpge_ps(a, z), mb = _mm_cmpge_ps(b, z);
        packed[i >> 3] = (uint8_t)(_mm_movemask_ps(ma) | (_mm_movemask_ps(mb) << 4));
        if (residual) {
            __m128 da = _mm_or_ps(_mm_and_ps(ma, v1), _mm_andnot_ps(ma, v0));
            __m128 db = _mm_or_ps(_mm_and_ps(mb, v1), _mm_andnot_ps(mb, v0));
            _mm_storeu_ps(v + i, _mm_sub_ps(a, da));
            _mm_storeu_ps(v + i + 4, _mm_sub_ps(b, db));
        }
    }
#endif
    for (; i < len; i += 8) {
        int64_t end = len - i < 8 ? len - i : 8;
        uint8_t byte = 0;
        for (int64_t k = 0; k < end; k++) {
            float a = v[i + k];
            int bit = a >= 0.0f;
            byte |= (uint8_t)(bit << k);
            if (residual) v[i + k] = a - (bit ? d1 : d0);
        }
        packed[i >> 3] = byte;
    }
}

/* Encode n floats, chunk by chunk. values: float32[n]; with addend, values is the residual and
 * becomes values + addend - decode (error feedback), else it is only read. offsets, steps:
 * float32[ceil(n / chunk)]; packed: ceil(n / 8) bytes. chunk must be a multiple of 8, so every
 * chunk starts on a byte. */
void bunsan_onebit_encode(float *values, const float *addend, int64_t n, int64_t chunk,
                          float *offsets, float *steps, uint8_t *packed) {
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk;
        float *v = values + start;
        if (addend) {
            const float *x = addend + start;
            int64_t i = 0;
#if BUNSAN_SSE2
            for (; i + 4 <= len; i += 4) _mm_storeu_ps(v + i, _mm_add_ps(_mm_loadu_ps(v + i), _mm_loadu_ps(x + i)));
#endif
            for (; i < len; i++) v[i] = v[i] + x[i];
        }
        chunk_means(v, len, &offsets[j], &steps[j]);
        chunk_codes(v, len, offsets[j], steps[j], packed + (start >> 3), addend != 0);
    }
}

/* Decode n floats into out (accumulate: out += decoded, rounded as torch's add_ of the decoded
 * values would be). Layout as in bunsan_onebit_encode. */
void bunsan_onebit_decode(const float *offsets, const float *steps, const uint8_t *packed, int64_t n,
                          int64_t chunk, float *out, int accumulate);

/* ---- Rotated chunks (bunsan/compression/rotation.py): random signs, then Walsh-Hadamard ---- */

/* The butterflies of rotation.hadamard, in place, with the same operations on the same operands
 * (a + (-b) is a - b in IEEE arithmetic), so the same bits. n a power of two. Levels 1 and 2 run
 * on groups of 4 in registers; the others two at a time (radix 4) where they can, so a chunk of
 * 1024 is read from L1 6 times instead of 10. With AVX (a build of its own, chosen at load
 * time) the wide levels take 8 floats at a time. */
#if defined(__AVX__)
#include <immintrin.h>
#endif
static void butterflies(float *a, int64_t n) {
    int64_t h = 1;
#if BUNSAN_SSE2
    if (n >= 4) {
        const __m128 odd = _mm_castsi128_ps(_mm_set_epi32((int)0x80000000, 0, (int)0x80000000, 0));
        const __m128 high = _mm_castsi128_ps(_mm_set_epi32((int)0x80000000, (int)0x80000000, 0, 0));
        for (int64_t i = 0; i < n; i += 4) {
            __m128 x = _mm_loadu_ps(a + i); /* a b c d */
            __m128 y = _mm_shuffle_ps(x, x, _MM_SHUFFLE(2, 2, 0, 0));
            __m128 z = _mm_xor_ps(_mm_shuffle_ps(x, x, _MM_SHUFFLE(3, 3, 1, 1)), odd);
            x = _mm_add_ps(y, z); /* a+b a-b c+d c-d */
            y = _mm_shuffle_ps(x, x, _MM_SHUFFLE(1, 0, 1, 0));
            z = _mm_xor_ps(_mm_shuffle_ps(x, x, _MM_SHUFFLE(3, 2, 3, 2)), high);
            _mm_storeu_ps(a + i, _mm_add_ps(y, z));
        }
        h = 4;
#if defined(__AVX__)
        if (n >= 8) { /* level 4 alone, then 8 floats at a time */
            for (int64_t i = 0; i < n; i += 8) {
                __m128 p0 = _mm_loadu_ps(a + i), p1 = _mm_loadu_ps(a + i + 4);
                _mm_storeu_ps(a + i, _mm_add_ps(p0, p1));
                _mm_storeu_ps(a + i + 4, _mm_sub_ps(p0, p1));
            }
            h = 8;
            for (; 4 * h <= n; h *= 4)
                for (int64_t i = 0; i < n; i += 4 * h)
                    for (int64_t k = i; k < i + h; k += 8) {
                        __m256 p0 = _mm256_loadu_ps(a + k), p1 = _mm256_loadu_ps(a + k + h);
                        __m256 p2 = _mm256_loadu_ps(a + k + 2 * h), p3 = _mm256_loadu_ps(a + k + 3 * h);
                        __m256 q0 = _mm256_add_ps(p0, p1), q1 = _mm256_sub_ps(p0, p1);
                        __m256 q2 = _mm256_add_ps(p2, p3), q3 = _mm256_sub_ps(p2, p3);
                        _mm256_storeu_ps(a + k, _mm256_add_ps(q0, q2));
                        _mm256_storeu_ps(a + k + 2 * h, _mm256_sub_ps(q0, q2));
                        _mm256_storeu_ps(a + k + h, _mm256_add_ps(q1, q3));
                        _mm256_storeu_ps(a + k + 3 * h, _mm256_sub_ps(q1, q3));
                    }
            for (; h < n; h *= 2) /* a last single level */
                for (int64_t i = 0; i < n; i += 2 * h)
                    for (int64_t k = i; k < i + h; k += 8) {
                        __m256 x = _mm256_loadu_ps(a + k), y = _mm256_loadu_ps(a + k + h);
                        _mm256_storeu_ps(a + k, _mm256_add_ps(x, y));
                        _mm256_storeu_ps(a + k + h, _mm256_sub_ps(x, y));
                    }
        }
#else
        for (; 4 * h <= n; h *= 4)
            for (int64_t i = 0; i < n; i += 4 * h)
                for (int64_t k = i; k < i + h; k += 4) {
                    __m128 p0 = _mm_loadu_ps(a + k), p1 = _mm_loadu_ps(a + k + h);
                    __m128 p2 = _mm_loadu_ps(a + k + 2 * h), p3 = _mm_loadu_ps(a + k + 3 * h);
                    __m128 q0 = _mm_add_ps(p0, p1), q1 = _mm_sub_ps(p0, p1);
                    __m128 q2 = _mm_add_ps(p2, p3), q3 = _mm_sub_ps(p2, p3);
                    _mm_storeu_ps(a + k, _mm_add_ps(q0, q2));
                    _mm_storeu_ps(a + k + 2 * h, _mm_sub_ps(q0, q2));
                    _mm_storeu_ps(a + k + h, _mm_add_ps(q1, q3));
                    _mm_storeu_ps(a + k + 3 * h, _mm_sub_ps(q1, q3));
                }
        for (; h < n; h *= 2) /* a last single level */
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t k = i; k < i + h; k += 4) {
                    __m128 x = _mm_loadu_ps(a + k), y = _mm_loadu_ps(a + k + h);
                    _mm_storeu_ps(a + k, _mm_add_ps(x, y));
                    _mm_storeu_ps(a + k + h, _mm_sub_ps(x, y));
                }
#endif
    }
#endif
    for (; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t k = i; k < i + h; k++) {
                float x = a[k], y = a[k + h];
                a[k] = x + y;
                a[k + h] = x - y;
            }
}

static int64_t next_power_of_two(int64_t n) {
    int64_t p = 1;
    while (p < n) p *= 2;
    return p;
}

static int log2_of(int64_t p) {
    int k = 0;
    while (((int64_t)1 << k) < p) k++;
    return k;
}

/* out[0..len) = the two-valued decode of len codes (accumulate: out += it). */
static void expand(const uint8_t *p, int64_t len, float d0, float d1, float *o, int accumulate) {
    int64_t i = 0;
#if BUNSAN_SSE2
    __m128 v0 = _mm_set1_ps(d0), v1 = _mm_set1_ps(d1);
    __m128i lowbits = _mm_set_epi32(8, 4, 2, 1), highbits = _mm_set_epi32(128, 64, 32, 16);
    for (; i + 8 <= len; i += 8) {
        __m128i byte = _mm_set1_epi32(p[i >> 3]);
        __m128 ma = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(byte, lowbits), lowbits));
        __m128 mb = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(byte, highbits), highbits));
        __m128 da = _mm_or_ps(_mm_and_ps(ma, v1), _mm_andnot_ps(ma, v0));
        __m128 db = _mm_or_ps(_mm_and_ps(mb, v1), _mm_andnot_ps(mb, v0));
        if (accumulate) {
            da = _mm_add_ps(_mm_loadu_ps(o + i), da);
            db = _mm_add_ps(_mm_loadu_ps(o + i + 4), db);
        }
        _mm_storeu_ps(o + i, da);
        _mm_storeu_ps(o + i + 4, db);
    }
#endif
    for (; i < len; i++) {
        float d = (p[i >> 3] >> (i & 7)) & 1 ? d1 : d0;
        o[i] = accumulate ? o[i] + d : d;
    }
}

/* As bunsan_onebit_encode, on rotated chunks: a chunk of len < chunk (the last) is padded with
 * zeros to a power of two p, and its codes and means cover all p. signs: float32[chunk] of +-1;
 * scales[k] = float32(2 ** (-k / 2)); work: float32[chunk]. With addend the residual stays in
 * the original coordinates: values = v - signs * H(decoded) * scale, as rotation.py computes. */
void bunsan_onebit_encode_rotated(float *values, const float *addend, int64_t n, int64_t chunk, const float *signs,
                                  const float *scales, float *work, float *offsets, float *steps, uint8_t *packed) {
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk;
        int64_t p = len == chunk ? chunk : next_power_of_two(len);
        float scale = scales[log2_of(p)], zero = 0.0f, one = 1.0f;
        float *v = values + start;
        if (addend)
            for (int64_t i = 0; i < len; i++) v[i] = v[i] + addend[start + i];
        for (int64_t i = 0; i < len; i++) work[i] = v[i] * signs[i];
        for (int64_t i = len; i < p; i++) work[i] = 0.0f * signs[i]; /* the padding, as torch pads */
        butterflies(work, p);
        for (int64_t i = 0; i < p; i++) work[i] = work[i] * scale;
        chunk_means(work, p, &offsets[j], &steps[j]);
        chunk_codes(work, p, offsets[j], steps[j], packed + (start >> 3), 0);
        if (!addend) continue;
        expand(packed + (start >> 3), p, zero * steps[j] + offsets[j], one * steps[j] + offsets[j], work, 0);
        butterflies(work, p);
        for (int64_t i = 0; i < len; i++) v[i] = v[i] - (work[i] * signs[i]) * scale;
    }
}

/* Decode n floats of rotated chunks (layout as bunsan_onebit_encode_rotated) into out, or add. */
void bunsan_onebit_decode_rotated(const float *offsets, const float *steps, const uint8_t *packed, int64_t n,
                                  int64_t chunk, const float *signs, const float *scales, float *work, float *out,
                                  int accumulate) {
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk;
        int64_t p = len == chunk ? chunk : next_power_of_two(len);
        float scale = scales[log2_of(p)], zero = 0.0f, one = 1.0f;
        expand(packed + (start >> 3), p, zero * steps[j] + offsets[j], one * steps[j] + offsets[j], work, 0);
        butterflies(work, p);
        float *o = out + start;
        if (accumulate)
            for (int64_t i = 0; i < len; i++) o[i] = o[i] + (work[i] * signs[i]) * scale;
        else
            for (int64_t i = 0; i < len; i++) o[i] = (work[i] * signs[i]) * scale;
    }
}

/* Decode n floats into out (accumulate: out += decoded, rounded as torch's add_ of the decoded
 * values would be). Layout as in bunsan_onebit_encode. */
void bunsan_onebit_decode(const float *offsets, const float *steps, const uint8_t *packed, int64_t n,
                          int64_t chunk, float *out, int accumulate) {
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk;
        float zero = 0.0f, one = 1.0f;
        expand(packed + (start >> 3), len, zero * steps[j] + offsets[j], one * steps[j] + offsets[j], out + start,
               accumulate);
    }
}

/* The sum of k payloads of rotated chunks, decoded: summed in rotated coordinates (in rank
 * order), then rotated back once, so k payloads cost one inverse transform instead of k. */
void bunsan_onebit_decode_rotated_sum(int k, const float *const *offsets, const float *const *steps,
                                      const uint8_t *const *packed, int64_t n, int64_t chunk, const float *signs,
                                      const float *scales, float *work, float *out) {
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk;
        int64_t p = len == chunk ? chunk : next_power_of_two(len);
        float scale = scales[log2_of(p)], zero = 0.0f, one = 1.0f;
        for (int r = 0; r < k; r++)
            expand(packed[r] + (start >> 3), p, zero * steps[r][j] + offsets[r][j], one * steps[r][j] + offsets[r][j],
                   work, r > 0);
        butterflies(work, p);
        float *o = out + start;
        for (int64_t i = 0; i < len; i++) o[i] = (work[i] * signs[i]) * scale;
    }
}

/* ---- One pass for the local momentum's linear combinations (bunsan/algorithms/data_parallel) ----
 *
 * out = a * x + b * y (x NULL: out = b * y), and with scaled, also scaled = out / divisor. torch
 * takes one pass over memory per operation (mul, add, div: three); this takes one. Any of x, y,
 * out, scaled may be the same array (each element is read before it is written).
 *
 * Rounded as torch's torch.mul(x, a).add_(y, alpha=b) on the same machine: torch's AVX2 kernels
 * (chosen where the CPU has AVX2 and FMA) compute add's a + alpha * b as one fused multiply-add,
 * so the build with -mfma does too (fmaf), and the baseline build rounds twice, as torch's
 * baseline kernels do. The same bits as the torch operations they replace. */
#if defined(__FMA__)
#include <math.h>
#define BUNSAN_ADD_SCALED(acc, b, y) fmaf((b), (y), (acc))
#else
#define BUNSAN_ADD_SCALED(acc, b, y) ((acc) + (b) * (y))
#endif
void bunsan_axpby(const float *x, float a, const float *y, float b, float *out, float *scaled, float divisor,
                  int64_t n) {
    if (x && scaled) {
        for (int64_t i = 0; i < n; i++) {
            float m = BUNSAN_ADD_SCALED(a * x[i], b, y[i]);
            out[i] = m;
            scaled[i] = m / divisor;
        }
    } else if (x) {
        for (int64_t i = 0; i < n; i++) out[i] = BUNSAN_ADD_SCALED(a * x[i], b, y[i]);
    } else if (scaled) {
        for (int64_t i = 0; i < n; i++) {
            float m = b * y[i];
            out[i] = m;
            scaled[i] = m / divisor;
        }
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = b * y[i];
    }
}

/* The sum of k plain payloads decoded into out[0..n) (in the given order, each chunk summed while
 * it is in L1), then, in the same pass, for each of m pieces q: out[lo..hi) = (out - a * prev) / div
 * (rounded as torch's out.sub_(prev, alpha=a).div_(div), see bunsan_axpby),
 * where prev[q][0] goes with out[lo[q]]. Pieces are sorted and disjoint. With k = 1 and m = 0 it is
 * bunsan_onebit_decode; the pieces are the local momentum's inversion (momentum.py). */
void bunsan_onebit_decode_sum_then(int k, const float *const *offsets, const float *const *steps,
                                   const uint8_t *const *packed, int64_t n, int64_t chunk, float *out, int m,
                                   const int64_t *lo, const int64_t *hi, const float *const *prev, const float *a,
                                   const float *div) {
    int first = 0;
    for (int64_t start = 0, j = 0; start < n; start += chunk, j++) {
        int64_t len = n - start < chunk ? n - start : chunk, end = start + len;
        float zero = 0.0f, one = 1.0f;
        for (int r = 0; r < k; r++)
            expand(packed[r] + (start >> 3), len, zero * steps[r][j] + offsets[r][j], one * steps[r][j] + offsets[r][j],
                   out + start, r > 0);
        while (first < m && hi[first] <= start) first++;
        for (int q = first; q < m && lo[q] < end; q++) {
            int64_t from = lo[q] > start ? lo[q] : start, to = hi[q] < end ? hi[q] : end;
            const float *b = prev[q] - lo[q];
            float aq = a[q], dq = div[q];
            for (int64_t i = from; i < to; i++) out[i] = BUNSAN_ADD_SCALED(out[i], -aq, b[i]) / dq;
        }
    }
}
