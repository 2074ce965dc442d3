// A host-only stand-in for the CUDA runtime, the driver calls fabric-lib reaches and the GPU tests'
// kernels, so that tests/gpu/gpu_engine_test.cpp runs without a GPU (tests/gpu/run_fake.sh): it
// checks the library's logic (routing, the cuda_ipc protocol, peer and region lifecycles), not GPU
// behaviour. Device memory is a memfd shared across processes: an IPC handle names (pid, fd), the
// importer opens /proc/<pid>/fd/<fd> and holds a shared flock while it maps it, so cudaMemGetInfo
// can tell freed memory that an importer still maps. Streams are threads that run their copies and
// kernels in order; events are sequence numbers. The device reports CAN_FLUSH_REMOTE_WRITES.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu_kernels.h"
#include "providers/cuda_ipc/gather_copy.h"

namespace {
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  uint64_t queued = 0;
  std::atomic<uint64_t> done{0};
  std::thread t;
  Stream() {
    t = std::thread([this] {
      for (;;) {
        std::function<void()> f;
        {
          std::unique_lock l(mu);
          cv.wait(l, [&] { return !q.empty(); });
          f = std::move(q.front());
          q.pop_front();
        }
        f();
        done.fetch_add(1, std::memory_order_release);
      }
    });
    t.detach();
  }
  uint64_t push(std::function<void()> f) {
    std::lock_guard l(mu);
    q.push_back(std::move(f));
    cv.notify_one();
    return ++queued;
  }
  uint64_t marker() {
    std::lock_guard l(mu);
    return queued;
  }
  void sync() {
    uint64_t m = marker();
    while (done.load(std::memory_order_acquire) < m) std::this_thread::yield();
  }
};
struct Event {
  Stream* s = nullptr;
  uint64_t at = 0;
};
struct Alloc {
  int fd;
  size_t size;
};
std::mutex mu;
std::map<uintptr_t, Alloc> allocs;    // ours
std::map<uintptr_t, Alloc> imported;  // opened IPC handles
std::vector<Alloc> zombies;           // freed, maybe still mapped by an importer
std::vector<Stream*> streams;
constexpr size_t kTotal = 64ull << 30;
constexpr uint64_t kMagic = 0xfa4ec0da;

Stream* S(cudaStream_t s) { return reinterpret_cast<Stream*>(s); }
void run(cudaStream_t s, std::function<void()> f) {
  if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    f();  // the default stream: synchronous (the tests use it that way)
  } else {
    S(s)->push(std::move(f));
  }
}
}  // namespace

extern "C" {
cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 4; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  auto* x = new Stream;
  std::lock_guard l(mu);
  streams.push_back(x);
  *s = reinterpret_cast<cudaStream_t>(x);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { if (s) S(s)->sync(); return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t s) { return S(s)->done.load() >= S(s)->marker() ? cudaSuccess : cudaErrorNotReady; }
cudaError_t cudaDeviceSynchronize() {
  std::vector<Stream*> v;
  { std::lock_guard l(mu); v = streams; }
  for (auto* s : v) s->sync();
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) { *p = calloc(1, n); return cudaSuccess; }
cudaError_t cudaFreeHost(void* p) { free(p); return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) { *d = h; return cudaSuccess; }
cudaError_t cudaHostRegister(void*, size_t, unsigned) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "fake CUDA error"; }
cudaError_t cudaMalloc(void** p, size_t n) {
  int fd = memfd_create("fakegpu", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) return cudaErrorMemoryAllocation;
  void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
  std::lock_guard l(mu);
  allocs[reinterpret_cast<uintptr_t>(m)] = {fd, n};
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  std::lock_guard l(mu);
  auto it = allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocs.end()) return cudaErrorInvalidValue;
  munmap(p, it->second.size);
  zombies.push_back(it->second);
  allocs.erase(it);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  std::lock_guard l(mu);
  size_t used = 0;
  for (auto& [p, a] : allocs) used += a.size;
  for (auto it = zombies.begin(); it != zombies.end();) {
    if (flock(it->fd, LOCK_EX | LOCK_NB) == 0) {  // no importer maps it any more
      close(it->fd);
      it = zombies.erase(it);
    } else {
      used += it->size;
      ++it;
    }
  }
  *total = kTotal;
  *free_bytes = kTotal - used;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemset(void* d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { *e = reinterpret_cast<cudaEvent_t>(new Event); return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  auto* ev = reinterpret_cast<Event*>(e);
  while (ev->s && ev->s->done.load(std::memory_order_acquire) < ev->at) std::this_thread::yield();
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) { *ms = 1; return cudaSuccess; }
cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int) { snprintf(id, len, "0000:00:00.0"); return cudaSuccess; }
cudaError_t cudaDeviceEnablePeerAccess(int, unsigned) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete reinterpret_cast<Event*>(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto* ev = reinterpret_cast<Event*>(e);
  ev->s = S(s);
  ev->at = S(s)->marker();
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto* ev = reinterpret_cast<Event*>(e);
  return !ev->s || ev->s->done.load(std::memory_order_acquire) >= ev->at ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t st) {
  run(st, [=] { memcpy(d, s, n); });
  return cudaSuccess;
}
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  std::lock_guard l(mu);
  auto it = allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == allocs.end()) return cudaErrorInvalidValue;
  memset(h, 0, sizeof *h);
  uint64_t v[4] = {kMagic, static_cast<uint64_t>(getpid()), static_cast<uint64_t>(it->second.fd), it->second.size};
  memcpy(h->reserved, v, sizeof v);
  return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned) {
  uint64_t v[4];
  memcpy(v, h.reserved, sizeof v);
  if (v[0] != kMagic || v[1] == static_cast<uint64_t>(getpid())) return cudaErrorInvalidValue;
  char path[64];
  snprintf(path, sizeof path, "/proc/%llu/fd/%llu", (unsigned long long)v[1], (unsigned long long)v[2]);
  int fd = open(path, O_RDWR);
  if (fd < 0) return cudaErrorInvalidValue;
  flock(fd, LOCK_SH);
  void* m = mmap(nullptr, v[3], PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (m == MAP_FAILED) { close(fd); return cudaErrorInvalidValue; }
  std::lock_guard l(mu);
  imported[reinterpret_cast<uintptr_t>(m)] = {fd, v[3]};
  *p = m;
  return cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void* p) {
  std::lock_guard l(mu);
  auto it = imported.find(reinterpret_cast<uintptr_t>(p));
  if (it == imported.end()) return cudaErrorInvalidValue;
  munmap(p, it->second.size);
  close(it->second.fd);
  imported.erase(it);
  return cudaSuccess;
}

static CUresult fake_range(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  std::lock_guard l(mu);
  for (auto& [b, a] : allocs)
    if (p >= b && p < b + a.size) { *base = b; *size = a.size; return CUDA_SUCCESS; }
  return CUDA_ERROR_INVALID_VALUE;
}
static CUresult fake_unsupported() { return CUDA_ERROR_NOT_SUPPORTED; }
static CUresult fake_attr(int* v, CUdevice_attribute a, CUdevice) {
  *v = a == CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES ? 1 : 0;
  return CUDA_SUCCESS;
}
static CUresult fake_wait(CUstream s, CUdeviceptr word, cuuint64_t value, unsigned) {
  auto* w = reinterpret_cast<volatile uint64_t*>(word);
  run(reinterpret_cast<cudaStream_t>(s), [=] { while (*w < value) std::this_thread::yield(); });
  return CUDA_SUCCESS;
}
static CUresult fake_get_ctx(CUstream, CUcontext* c) { *c = reinterpret_cast<CUcontext>(1); return CUDA_SUCCESS; }
static CUresult fake_push(CUcontext) { return CUDA_SUCCESS; }
static CUresult fake_pop(CUcontext* c) { *c = reinterpret_cast<CUcontext>(1); return CUDA_SUCCESS; }
static CUresult fake_ctx_device(CUdevice* d) { *d = 0; return CUDA_SUCCESS; }
static CUresult fake_flush(int, int) { return CUDA_SUCCESS; }
cudaError_t cudaGetDriverEntryPointByVersion(const char* sym, void** fn, unsigned, unsigned long long,
                                             cudaDriverEntryPointQueryResult* r) {
  *r = cudaDriverEntryPointSuccess;
  std::string s = sym;
  if (s == "cuMemGetAddressRange") *fn = (void*)&fake_range;
  else if (s == "cuDeviceGetAttribute") *fn = (void*)&fake_attr;
  else if (s == "cuStreamWaitValue64") *fn = (void*)&fake_wait;
  else if (s == "cuStreamGetCtx") *fn = (void*)&fake_get_ctx;
  else if (s == "cuCtxPushCurrent") *fn = (void*)&fake_push;
  else if (s == "cuCtxPopCurrent") *fn = (void*)&fake_pop;
  else if (s == "cuCtxGetDevice") *fn = (void*)&fake_ctx_device;
  else if (s == "cuFlushGPUDirectRDMAWrites") *fn = (void*)&fake_flush;
  else *fn = (void*)&fake_unsupported;
  return cudaSuccess;
}
}  // extern "C"

namespace fabric::cuda {
cudaError_t load_gather_copy() { return cudaSuccess; }  // nothing is loaded lazily here
cudaError_t launch_gather_copy(const CopyDesc* d, uint32_t n, int, cudaStream_t s) {
  std::vector<CopyDesc> copy(d, d + n);
  run(s, [copy] { for (auto& c : copy) memcpy(c.dst, c.src, c.len); });
  return cudaSuccess;
}
}  // namespace fabric::cuda
namespace fabric::gpu_test {
static void sum_words(const uint8_t* data, uint64_t len, uint64_t* out) {
  uint64_t t = 0;
  for (uint64_t i = 0; i + 8 <= len; i += 8) { uint64_t w; memcpy(&w, data + i, 8); t += w; }
  *out += t;
}
cudaError_t launch_bump(uint64_t* word, uint64_t n, uint64_t gap_ns, cudaStream_t s) {
  run(s, [=] { for (uint64_t i = 1; i <= n; i++) { reinterpret_cast<std::atomic<uint64_t>*>(word)->store(i); std::this_thread::sleep_for(std::chrono::nanoseconds(gap_ns)); } });
  return cudaSuccess;
}
cudaError_t launch_ping_pong(uint64_t*, const volatile uint64_t*, uint32_t, uint64_t*, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t launch_ping_pong_signal(uint64_t*, const volatile uint64_t*, uint32_t, uint64_t*, PingPongSignal, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t launch_wait_then_sum(const volatile uint64_t* counter, uint64_t target, const uint8_t* data, uint64_t len, uint64_t* sum, cudaStream_t s) {
  run(s, [=] { while (*counter < target) std::this_thread::yield(); sum_words(data, len, sum); });
  return cudaSuccess;
}
cudaError_t launch_sum(const uint8_t* data, uint64_t len, uint64_t* sum, cudaStream_t s) {
  run(s, [=] { sum_words(data, len, sum); });
  return cudaSuccess;
}
}  // namespace fabric::gpu_test
extern "C" {
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) { return cudaErrorNotSupported; }
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t*) { return cudaErrorNotSupported; }
cudaError_t cudaGraphInstantiate(cudaGraphExec_t*, cudaGraph_t, unsigned long long) { return cudaErrorNotSupported; }
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) { return cudaErrorNotSupported; }
}
