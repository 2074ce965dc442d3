// A build without test providers (FABRIC_TEST_PROVIDERS=OFF: installed and pip builds): efa-sim
// is not in the library, and open_domain refuses the provider before anything reaches these.
#include "fabric/error.h"
#include "providers/efa_sim/efa_sim.h"

namespace fabric::efa_sim {

namespace {
[[noreturn]] void absent() {
  throw Error(ErrorCode::kUnsupported, "provider 'efa-sim': this fabric-lib was built without its test providers "
                                       "(configure with -DFABRIC_TEST_PROVIDERS=ON)");
}
}  // namespace

void present_as_efa(ProviderAttrs&, bool) { absent(); }
int open_domain(fid_fabric*, fi_info*, fid_domain**) { absent(); }

}  // namespace fabric::efa_sim
