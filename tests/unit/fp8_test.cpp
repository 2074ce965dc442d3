// FP8 e4m3 conversion against an independent oracle (nearest of all finite codes, ties to the even
// code) and 128 x 128 block quantization's scales, error bound, edges and bounds checks.
#include "fabric/weights/fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "fabric/error.h"

namespace fabric::fp8 {
namespace {

// The non-negative finite values, by code 0x00..0x7E, built from the definition.
std::vector<double> finite_values() {
  std::vector<double> v;
  for (int code = 0; code <= 0x7E; code++) {
    int e = code >> 3, m = code & 7;
    v.push_back(e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7));
  }
  return v;
}

uint8_t oracle(float x) {
  static const std::vector<double> values = finite_values();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  for (int c = 1; c <= 0x7E; c++) {
    double d = std::fabs(a - values[c]), db = std::fabs(a - values[best]);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(Fp8, DecodesTheDefinedValues) {
  EXPECT_EQ(from_e4m3(0x38), 1.0f);
  EXPECT_EQ(from_e4m3(0x40), 2.0f);
  EXPECT_EQ(from_e4m3(0xB8), -1.0f);
  EXPECT_EQ(from_e4m3(0x7E), 448.0f);
  EXPECT_EQ(from_e4m3(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(from_e4m3(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(from_e4m3(0x77), 240.0f);
  EXPECT_TRUE(std::isnan(from_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(from_e4m3(0xFF)));
  const auto values = finite_values();
  for (int c = 0; c <= 0x7E; c++) {
    EXPECT_EQ(from_e4m3(static_cast<uint8_t>(c)), static_cast<float>(values[c])) << c;
    EXPECT_EQ(from_e4m3(static_cast<uint8_t>(c | 0x80)), -static_cast<float>(values[c])) << c;
  }
}

TEST(Fp8, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(to_e4m3(from_e4m3(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(to_e4m3(std::nanf("")) & 0x7F, 0x7F);
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  const auto values = finite_values();
  std::vector<float> probes;
  // Every midpoint between neighbouring codes, and the floats on either side of it.
  for (size_t c = 0; c + 1 < values.size(); c++) {
    float mid = static_cast<float>((values[c] + values[c + 1]) / 2);
    probes.push_back(mid);
    probes.push_back(std::nextafter(mid, 0.0f));
    probes.push_back(std::nextafter(mid, 1000.0f));
  }
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> exponent(-14.0f, 9.5f);
  for (int i = 0; i < 200000; i++) probes.push_back(std::exp2(exponent(rng)));
  probes.insert(probes.end(), {0.0f, 448.0f, 460.0f, 464.0f, 1e6f, 0x1p-10f, 0x1p-11f, 3 * 0x1p-11f});
  for (float p : probes) {
    ASSERT_EQ(to_e4m3(p), oracle(p)) << p;
    ASSERT_EQ(to_e4m3(-p), oracle(-p)) << -p;
  }
}

uint16_t bf16(float f) { return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16); }

TEST(Fp8, BlockQuantizationScalesEachBlockToItsLargestValue) {
  // 300 x 200: blocks of 128 x 128 with partial edges (3 x 2 blocks); rows padded to 210 elements
  // in and 220 bytes out; block magnitudes from 1e-3 to 1e3; block (1, 1) all zero.
  const uint64_t rows = 300, cols = 200, in_stride = 210, out_stride = 220;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> in(rows * in_stride, bf16(7.0f));
  for (uint64_t i = 0; i < rows; i++)
    for (uint64_t j = 0; j < cols; j++) {
      uint64_t block = (i / 128) * 2 + j / 128;
      in[i * in_stride + j] = block == 3 ? bf16(0.0f) : bf16(normal(rng) * std::pow(10.0f, float(block) - 3));
    }
  std::vector<uint8_t> out(rows * out_stride, 0xCD);
  std::vector<float> scales(scale_rows(rows) * scale_cols(cols), -1.0f);
  ASSERT_EQ(scales.size(), 6u);
  quantize_blocks({.in = in, .rows = rows, .cols = cols, .in_stride = in_stride, .out = out,
                   .out_stride = out_stride, .scales = scales});
  for (uint64_t b = 0; b < 6; b++) {
    const uint64_t br = b / 2, bc = b % 2;
    float amax = 0;
    for (uint64_t i = br * 128; i < std::min(rows, br * 128 + 128); i++)
      for (uint64_t j = bc * 128; j < std::min(cols, bc * 128 + 128); j++)
        amax = std::max(amax, std::fabs(from_bf16(in[i * in_stride + j])));
    EXPECT_EQ(scales[b], b == 3 ? 1.0f : amax / 448.0f) << b;
  }
  for (uint64_t i = 0; i < rows; i++) {
    for (uint64_t j = 0; j < cols; j++) {
      const float x = from_bf16(in[i * in_stride + j]);
      const float scale = scales[(i / 128) * 2 + j / 128];
      const float back = from_e4m3(out[i * out_stride + j]) * scale;
      // Half a step of 3 mantissa bits, or half the subnormal step 2^-10 at the block's scale.
      ASSERT_LE(std::fabs(back - x), std::max(std::fabs(x) / 16, scale * 0x1p-10f) * 1.0001f)
          << i << "," << j;
    }
    for (uint64_t j = cols; j < out_stride; j++) ASSERT_EQ(out[i * out_stride + j], 0xCD) << "padding";
  }
}

TEST(Fp8, BlockQuantizationRejectsShortBuffers) {
  std::vector<uint16_t> in(128 * 128);
  std::vector<uint8_t> out(128 * 128);
  std::vector<float> scales(1);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  std::span<const uint16_t> short_in(in.data(), in.size() - 1);
  std::span<uint8_t> short_out(out.data(), out.size() - 1);
  EXPECT_EQ(code_of([&] { quantize_blocks({.in = short_in, .rows = 128, .cols = 128, .out = out, .scales = scales}); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { quantize_blocks({.in = in, .rows = 128, .cols = 128, .out = short_out, .scales = scales}); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { quantize_blocks({.in = in, .rows = 128, .cols = 128, .out = out, .scales = {}}); }),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { quantize_blocks({.in = in, .rows = 128, .cols = 128, .out = out, .scales = scales}); }),
            ErrorCode::kOk);
}

}  // namespace
}  // namespace fabric::fp8
