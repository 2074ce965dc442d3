// FP8 e4m3 conversion and the scales of 128-value blocks, header-only so that host code and CUDA
// kernels (nvcc, C++17) compute the same bits: the weight update's block quantization
// (fabric/weights/fp8.h) and the MoE dispatch's token quantization (fabric/moe/types.h, Quantize)
// both use it.
//
// e4m3 here is OCP "e4m3fn" (torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits,
// no infinities, largest finite 448, one NaN pattern per sign (0x7F / 0xFF).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FABRIC_E4M3_HD __host__ __device__ inline
#else
#define FABRIC_E4M3_HD inline
#endif

namespace fabric::fp8 {

inline constexpr float kE4m3Max = 448.0f;

FABRIC_E4M3_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}
FABRIC_E4M3_HD float float_of(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

FABRIC_E4M3_HD float from_bf16(uint16_t b) { return float_of(uint32_t{b} << 16); }

// Division rounded to nearest on both sides (device code spells it out, so that no fast-math
// flag turns it into a multiplication by the reciprocal).
FABRIC_E4M3_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Round to nearest, ties to even; values beyond +-448 saturate to +-448 (torch's cast gives NaN
// from 464 up; block scaling keeps values within 448, so both agree on what quantization makes).
// NaN stays NaN.
FABRIC_E4M3_HD uint8_t to_e4m3(float x) {
  const uint32_t bits = bits_of(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abits = bits & 0x7FFFFFFF;
  if (abits > 0x7F800000u) return sign | 0x7F;  // NaN
  const float a = float_of(abits);
  if (a >= kE4m3Max) return sign | 0x7E;
  // Subnormals are multiples of 2^-9: scaling by 2^9 is exact, and rint rounds to nearest even
  // (the default rounding mode). 8 (a just below 2^-6 rounding up) is the smallest normal's code.
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(rintf(a * 0x1p9f));
  // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even.
  int exponent = static_cast<int>(abits >> 23) - 127;  // -6 .. 8
  uint32_t mantissa = (abits >> 20) & 0x7;
  const uint32_t dropped = abits & 0xFFFFF;
  if (dropped > 0x80000 || (dropped == 0x80000 && (mantissa & 1))) mantissa++;
  if (mantissa == 8) {  // rounded up into the next binade
    mantissa = 0;
    exponent++;
  }
  // a < 448 rounds to at most 448 (exponent 8, mantissa 6): never the NaN pattern.
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | mantissa);
}

inline float from_e4m3(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

// The scale of a block whose largest magnitude is amax: amax / 448 rounded to nearest, 1 for a
// block of zeros (values = e4m3(x / scale), x ~ value * scale).
FABRIC_E4M3_HD float amax_scale(float amax) { return amax > 0.0f ? div_rn(amax, kE4m3Max) : 1.0f; }

// The power-of-two scale DeepEP's round_scale uses: 2^ceil(log2(max(amax, 1e-4) / 448)), so that
// one UE8M0 exponent byte holds it exactly. The ceiling comes from the bits (exponent, plus one
// when any mantissa bit is set), not from a log2 that may round.
inline constexpr float kPow2ScaleMinAmax = 1e-4f;
FABRIC_E4M3_HD float pow2_scale(float amax) {
  const float v = div_rn(amax > kPow2ScaleMinAmax ? amax : kPow2ScaleMinAmax, kE4m3Max);  // normal: >= 2.2e-7
  const uint32_t b = bits_of(v);
  const uint32_t exponent = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0 ? 1u : 0u);
  return float_of(exponent << 23);
}

}  // namespace fabric::fp8
