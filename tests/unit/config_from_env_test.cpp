// EngineConfig::from_env: the variables it reads, and a clear error for a value it cannot use.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "fabric/fabric.h"

namespace fabric {
namespace {

// Sets a variable for one scope and restores the environment after.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) {
    if (const char* old = std::getenv(name)) previous = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (previous.empty()) {
      unsetenv(name);
    } else {
      setenv(name, previous.c_str(), 1);
    }
  }
  const char* name;
  std::string previous;
};

TEST(ConfigFromEnv, VerbsTrafficClassAndServiceLevel) {
  ScopedEnv p("FABRIC_PROVIDER", "verbs"), tc("FABRIC_VERBS_TC", "106"), sl("FABRIC_VERBS_SL", "0x3");
  EngineConfig c = EngineConfig::from_env();
  EXPECT_EQ(c.verbs.traffic_class, 106);
  EXPECT_EQ(c.verbs.service_level, 3);
}

TEST(ConfigFromEnv, AValueThatIsNotAByteIsRefusedByName) {
  for (const char* bad : {"256", "-1", "ten", "10x", ""}) {
    ScopedEnv tc("FABRIC_VERBS_TC", bad);
    try {
      (void)EngineConfig::from_env();
      ADD_FAILURE() << "FABRIC_VERBS_TC='" << bad << "' accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("FABRIC_VERBS_TC"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace fabric
