// Which CUDA driver calls wait for a stream held by cuStreamWaitValue32 on a
// host word (implicit synchronization), and whether a second thread's calls
// block while the first is stuck in such a call.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <time.h>
#include <atomic>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("  %s -> %d %s\n", #x, r, s); } } while (0)
static CUcontext ctx; static CUstream held, other, other2; static volatile unsigned* word; static CUdeviceptr word_dev;
static unsigned value = 0;
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef void (*Op)(void);
static CUdeviceptr pre_dev, pre_dev2; static void* pre_host; static void* reg_host;
static CUdeviceptr scratch;
static void op_alloc() { CUdeviceptr p; CK(cuMemAlloc(&p, 1 << 20)); scratch = p; }
static void op_free() { CK(cuMemFree(pre_dev)); }
static void op_alloc_host() { void* p; CK(cuMemAllocHost(&p, 1 << 20)); CK(cuMemFreeHost(p)); }
static void op_free_host() { CK(cuMemFreeHost(pre_host)); }
static void op_host_register() { CK(cuMemHostRegister(reg_host, 1 << 20, 0)); }
static void op_host_unregister() { CK(cuMemHostUnregister(reg_host)); }
static void op_memcpy_sync() { static char b[4096]; CK(cuMemcpyHtoD(pre_dev2, b, 4096)); }
static void op_memcpy_async_other() { static char b[4096]; CK(cuMemcpyHtoDAsync(pre_dev2, b, 4096, other)); CK(cuStreamSynchronize(other)); }
static void op_memset_sync() { CK(cuMemsetD8(pre_dev2, 1, 4096)); }
static void op_stream_create_destroy() { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CK(cuStreamDestroy(s)); }
static void op_event() { CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING)); CK(cuEventRecord(e, other)); CK(cuEventSynchronize(e)); CK(cuEventDestroy(e)); }
static void op_dmabuf() { int fd = -1; CK(cuMemGetHandleForAddressRange(&fd, pre_dev2, 2 << 20, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)); if (fd >= 0) close(fd); }
static void op_ipc() { CUipcMemHandle h; CK(cuIpcGetMemHandle(&h, pre_dev2)); }
static void op_write_value_other() { CK(cuStreamWriteValue32(other, scratch ? scratch : pre_dev2, 7, 0)); CK(cuStreamSynchronize(other)); }
static void op_flush() { CK(cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)); }
static void op_ctx_sync() { CK(cuCtxSynchronize()); }
static void op_pointer_attr() { unsigned long long id; CK(cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, pre_dev2)); }
static void op_stream_query_other() { cuStreamQuery(other); }
static void op_free_async() { CUdeviceptr p; CK(cuMemAllocAsync(&p, 4096, other)); CK(cuMemFreeAsync(p, other)); CK(cuStreamSynchronize(other)); }
struct Named { const char* name; Op op; };
static Named ops[] = {
 {"cuMemAlloc", op_alloc}, {"cuMemFree", op_free}, {"cuMemAllocHost", op_alloc_host}, {"cuMemFreeHost", op_free_host},
 {"cuMemHostRegister", op_host_register}, {"cuMemHostUnregister", op_host_unregister}, {"cuMemcpyHtoD(sync)", op_memcpy_sync},
 {"cuMemcpyHtoDAsync(other)+sync(other)", op_memcpy_async_other}, {"cuMemsetD8(sync)", op_memset_sync},
 {"cuStreamCreate+Destroy", op_stream_create_destroy}, {"cuEvent create/record(other)/sync/destroy", op_event},
 {"cuMemGetHandleForAddressRange", op_dmabuf}, {"cuIpcGetMemHandle", op_ipc}, {"cuStreamWriteValue32(other)+sync", op_write_value_other},
 {"cuFlushGPUDirectRDMAWrites", op_flush}, {"cuPointerGetAttribute", op_pointer_attr}, {"cuStreamQuery(other)", op_stream_query_other},
 {"cuMemAllocAsync/FreeAsync(other)", op_free_async}, {"cuCtxSynchronize", op_ctx_sync},
};
struct Arg { Op op; double took; };
static void* runner(void* a) { Arg* arg = (Arg*)a; cuCtxSetCurrent(ctx); double t = now(); arg->op(); arg->took = now() - t; return 0; }
static void prepare() {
  CK(cuMemAlloc(&pre_dev, 1 << 20));
  CK(cuMemAllocHost(&pre_host, 1 << 20));
  reg_host = aligned_alloc(4096, 1 << 20);
}
static void hold() { value++; CK(cuStreamWaitValue32(held, word_dev, value, CU_STREAM_WAIT_VALUE_GEQ)); }
static void release() { __atomic_store_n(word, value, __ATOMIC_SEQ_CST); CK(cuStreamSynchronize(held)); }
int main(int argc, char** argv) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&held, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&other2, CU_STREAM_NON_BLOCKING));
  void* w; CK(cuMemHostAlloc(&w, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE)); word = (volatile unsigned*)w; *word = 0;
  CK(cuMemHostGetDevicePointer(&word_dev, w, 0));
  CK(cuMemAlloc(&pre_dev2, 2 << 20));
  // Phase 1: does X wait for the held stream?
  printf("== phase 1: one call while a non-blocking stream waits on a host word (released after 2 s)\n");
  int n = sizeof(ops) / sizeof(ops[0]);
  for (int i = 0; i < n; i++) {
    prepare(); if (ops[i].op == op_host_unregister) CK(cuMemHostRegister(reg_host, 1 << 20, 0));
    hold();
    Arg a = {ops[i].op, -1}; pthread_t t; pthread_create(&t, 0, runner, &a);
    usleep(2000000);
    double before_release = a.took;
    release(); pthread_join(t, 0);
    printf("%-45s %s (%.3f s)\n", ops[i].name, before_release < 0 ? "WAITS for the held stream" : "returns", a.took);
    fflush(stdout);
  }
  // Phase 2: while thread 1 is stuck in cuMemFree, does thread 2's Y block?
  Op blockers[] = {op_free, op_free_host, op_host_unregister, op_ctx_sync};
  const char* bnames[] = {"cuMemFree", "cuMemFreeHost", "cuMemHostUnregister", "cuCtxSynchronize"};
  for (int b = 0; b < 4; b++) {
    printf("== phase 2: thread 1 in %s (stuck on the held stream); thread 2's calls:\n", bnames[b]);
    for (int i = 0; i < n; i++) {
      if (ops[i].op == op_ctx_sync) continue;
      prepare(); if (ops[i].op == op_host_unregister || blockers[b] == op_host_unregister) CK(cuMemHostRegister(reg_host, 1 << 20, 0));
      hold();
      Arg a1 = {blockers[b], -1}; pthread_t t1; pthread_create(&t1, 0, runner, &a1);
      usleep(300000);
      Op y = ops[i].op;
      if (y == op_free) { CUdeviceptr p; CK(cuMemAlloc(&p, 4096)); pre_dev = p; }  // a different pointer
      if (y == op_free_host) { void* p; CK(cuMemAllocHost(&p, 4096)); pre_host = p; }
      if (y == op_host_unregister && blockers[b] == op_host_unregister) { reg_host = aligned_alloc(4096, 1 << 20); CK(cuMemHostRegister(reg_host, 1 << 20, 0)); }
      if (y == op_host_register && blockers[b] == op_host_unregister) { reg_host = aligned_alloc(4096, 1 << 20); }
      Arg a2 = {y, -1}; pthread_t t2; pthread_create(&t2, 0, runner, &a2);
      usleep(1500000);
      double y_before = a2.took, x_before = a1.took;
      release(); pthread_join(t1, 0); pthread_join(t2, 0);
      printf("  %-45s %s (%.3f s)%s\n", ops[i].name, y_before < 0 ? "BLOCKED" : "returns", a2.took, x_before >= 0 ? " [thread 1 was not stuck]" : "");
      fflush(stdout);
    }
  }
  printf("done\n");
  return 0;
}
