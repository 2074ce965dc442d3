// Umbrella header of the public API.
#pragma once

#include "fabric/config.h"
#include "fabric/error.h"
#include "fabric/metrics.h"
#include "fabric/on_done.h"
#include "fabric/shm_cleanup.h"
#include "fabric/topology.h"
#include "fabric/transfer_engine.h"
#include "fabric/types.h"
