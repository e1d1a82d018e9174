// bfloat16 <-> float32 for 16 lanes of AVX-512, and the mask of a partial 16, shared by the CPU
// kernels (cpu_kernels.cpp, linear_amx.cpp, linear_avx512.cpp, decode_layers.cpp, mamba2.cpp,
// gated_delta.cpp). Widening is exact
// (the bf16 bits become a float's top half); narrowing rounds to nearest even (AVX512-BF16's
// vcvtneps2bf16).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

namespace pagedserve {

// The lanes below `count` (none if count <= 0, all if count >= 16): a loop's last, partial 16.
inline __mmask16 lanes_below(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 widen_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

inline __m512 load_bf16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The lanes of `mask` only; the others read as 0.
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 mask) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, p)); }

#if defined(__AVX512BF16__)
inline void store_bf16(c10::BFloat16* p, __m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(b));
}

inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, mask, reinterpret_cast<const __m256i&>(b));
}
#endif

// A recurrent state's lanes (float32 or bfloat16; `mask`'s lanes only) read as float32 and stored
// back in its type (mamba2.cpp, gated_delta.cpp): `vector_state<T>` where the vector path takes T.
inline __m512 load_state(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline void store_state(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
#if defined(__AVX512BF16__)
inline __m512 load_state(const c10::BFloat16* p, __mmask16 mask) { return load_bf16(p, mask); }
inline void store_state(c10::BFloat16* p, __m512 v, __mmask16 mask) { store_bf16(p, v, mask); }
#endif

template <typename T>
inline constexpr bool vector_state = std::is_same_v<T, float>
#if defined(__AVX512BF16__)
                                     || std::is_same_v<T, c10::BFloat16>
#endif
    ;

}  // namespace pagedserve

#endif
