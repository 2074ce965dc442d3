// The shared-memory segment code is header-only (shm_segment.h), so that the CPU unit tests use it
// in builds without CUDA; this unit compiles it once with the library's warnings.
#include "providers/ipc/shm_segment.h"
