// MetricsWriter and DurationHistogram: the exposition text exactly, escaping, and the mistakes it
// refuses.
#include <gtest/gtest.h>

#include "fabric/error.h"
#include "fabric/metrics.h"

namespace fabric {
namespace {

TEST(MetricsWriter, FamiliesComeOutTogetherWithOneTypeLineAndEscapedValues) {
  MetricsWriter w;
  w.counter("x_total", "Xs\\ seen\nso far", 3, {{"a", "1"}});
  w.gauge("y", "a y", 1.5);
  w.counter("x_total", "Xs\\ seen\nso far", uint64_t{18446744073709551615ull}, {{"a", "q\"b\\c\nd"}});
  const double bounds[] = {0.5, 1};
  const uint64_t counts[] = {1, 2, 3};
  w.histogram("h_seconds", "h", bounds, counts, 7.25, {{"k", "v"}});
  EXPECT_EQ(w.text(),
            "# HELP x_total Xs\\\\ seen\\nso far\n"
            "# TYPE x_total counter\n"
            "x_total{a=\"1\"} 3\n"
            "x_total{a=\"q\\\"b\\\\c\\nd\"} 18446744073709551615\n"
            "# HELP y a y\n"
            "# TYPE y gauge\n"
            "y 1.5\n"
            "# HELP h_seconds h\n"
            "# TYPE h_seconds histogram\n"
            "h_seconds_bucket{k=\"v\",le=\"0.5\"} 1\n"
            "h_seconds_bucket{k=\"v\",le=\"1\"} 3\n"
            "h_seconds_bucket{k=\"v\",le=\"+Inf\"} 6\n"
            "h_seconds_sum{k=\"v\"} 7.25\n"
            "h_seconds_count{k=\"v\"} 6\n");
}

TEST(MetricsWriter, MistakesAreRefusedByName) {
  auto refused = [](auto f) {
    MetricsWriter w;
    w.counter("ok_total", "ok", 1);
    try {
      f(w);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return true;
    }
    return false;
  };
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.counter("no_suffix", "c", 1); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.gauge("g_total", "g", 1); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.gauge("ok_total", "ok", 1); }));  // two types
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.counter("ok_total", "other help", 2, {{"a", "b"}}); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.counter("ok_total", "ok", 2); }));  // same series twice
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.gauge("bad-name", "g", 1); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.gauge("g", "g", 1, {{"__x", "1"}}); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) { w.gauge("g", "g", 1, {{"a", "1"}, {"a", "2"}}); }));
  EXPECT_TRUE(refused([](MetricsWriter& w) {
    const double b[] = {1};
    const uint64_t c[] = {1};
    w.histogram("h", "h", b, c, 0);  // one count short
  }));
  EXPECT_FALSE(refused([](MetricsWriter& w) { w.counter("ok_total", "ok", 2, {{"a", "b"}}); }));
}

TEST(DurationHistogram, BucketsAreLog2NanosecondsWithInclusiveBounds) {
  EXPECT_EQ(DurationHistogram::bucket_of(0), 0u);
  EXPECT_EQ(DurationHistogram::bucket_of(1024), 0u);
  EXPECT_EQ(DurationHistogram::bucket_of(1025), 1u);
  EXPECT_EQ(DurationHistogram::bucket_of(2048), 1u);
  EXPECT_EQ(DurationHistogram::bucket_of(uint64_t{1} << 36), DurationHistogram::kBounds - 1);
  EXPECT_EQ(DurationHistogram::bucket_of((uint64_t{1} << 36) + 1), DurationHistogram::kBounds);
  EXPECT_EQ(DurationHistogram::bucket_of(UINT64_MAX), DurationHistogram::kBounds);
  EXPECT_DOUBLE_EQ(DurationHistogram::upper_bounds()[0], 1.024e-6);
  DurationHistogram h;
  h.observe(std::chrono::microseconds(3));
  h.observe(std::chrono::seconds(100));
  MetricsWriter w;
  h.write(w, "d_seconds", "d");
  const std::string t = w.text();
  EXPECT_NE(t.find("d_seconds_bucket{le=\"4.096e-06\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("d_seconds_bucket{le=\"+Inf\"} 2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("d_seconds_sum 100.000003\n"), std::string::npos) << t;
  EXPECT_NE(t.find("d_seconds_count 2\n"), std::string::npos) << t;
}

}  // namespace
}  // namespace fabric
