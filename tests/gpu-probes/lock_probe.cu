// While thread 1 is stuck in an implicitly synchronizing call (waiting for a
// stream held by cuStreamWaitValue32 on a host word), which calls of a
// second thread return and which block? One forked child per trial, killed
// if it hangs.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("    [%s -> %d %s]\n", #x, r, s); } } while (0)
static CUcontext ctx; static CUstream held, other; static volatile unsigned* word; static CUdeviceptr word_dev;
static CUdeviceptr dev_a, dev_b, dev_free; static void *pinned, *pinned_free, *registered, *to_register; static CUevent ev_done;
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef void (*Op)(void);
static void b_free() { CK(cuMemFree(dev_free)); }
static void b_free_host() { CK(cuMemFreeHost(pinned_free)); }
static void b_unregister() { CK(cuMemHostUnregister(registered)); }
static void o_htod_async() { CK(cuMemcpyHtoDAsync(dev_a, pinned, 4096, other)); }
static void o_dtoh_async() { CK(cuMemcpyDtoHAsync(pinned, dev_a, 4096, other)); }
static void o_dtod_async() { CK(cuMemcpyDtoDAsync(dev_b, dev_a, 4096, other)); }
static void o_memset_async() { CK(cuMemsetD8Async(dev_a, 1, 4096, other)); }
static void o_event_record() { CK(cuEventRecord(ev_done, other)); }
static void o_event_query() { cuEventQuery(ev_done); }
static void o_stream_query() { cuStreamQuery(other); }
static void o_write_value() { CK(cuStreamWriteValue32(other, dev_a, 7, 0)); }
static void o_wait_value() { CK(cuStreamWaitValue32(other, word_dev, 0, CU_STREAM_WAIT_VALUE_GEQ)); }
static void o_event_create() { CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING)); }
static void o_event_destroy() { CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING)); CK(cuEventDestroy(e)); }
static void o_stream_create() { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); }
static void o_mem_alloc() { CUdeviceptr p; CK(cuMemAlloc(&p, 1 << 20)); }
static void o_alloc_host() { void* p; CK(cuMemAllocHost(&p, 1 << 20)); }
static void o_host_register() { CK(cuMemHostRegister(to_register, 1 << 20, 0)); }
static void o_pointer_attr() { unsigned long long id; CK(cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, dev_a)); }
static void o_push_pop() { CK(cuCtxPushCurrent(ctx)); CUcontext c; CK(cuCtxPopCurrent(&c)); }
static void o_flush() { CK(cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)); }
static void o_address_range() { CUdeviceptr b; size_t s; CK(cuMemGetAddressRange(&b, &s, dev_a)); }
static void o_ipc_handle() { CUipcMemHandle h; CK(cuIpcGetMemHandle(&h, dev_a)); }
static void o_stream_sync_idle() { CK(cuStreamSynchronize(other)); }
static void o_event_sync() { CK(cuEventSynchronize(ev_done)); }
static void o_host_get_dev_ptr() { CUdeviceptr d; CK(cuMemHostGetDevicePointer(&d, pinned, 0)); }
static void o_dmabuf() { int fd = -1; CK(cuMemGetHandleForAddressRange(&fd, dev_a, 2 << 20, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)); }
struct Named { const char* name; Op op; };
static Named blockers[] = {{"cuMemFreeHost", b_free_host}, {"cuMemFree", b_free}, {"cuMemHostUnregister", b_unregister}};
static Named ops[] = {
 {"cuMemcpyHtoDAsync", o_htod_async}, {"cuMemcpyDtoHAsync", o_dtoh_async}, {"cuMemcpyDtoDAsync", o_dtod_async},
 {"cuMemsetD8Async", o_memset_async}, {"cuEventRecord", o_event_record}, {"cuEventQuery", o_event_query},
 {"cuStreamQuery", o_stream_query}, {"cuStreamWriteValue32", o_write_value}, {"cuStreamWaitValue32", o_wait_value},
 {"cuEventCreate", o_event_create}, {"cuEventCreate+Destroy", o_event_destroy}, {"cuStreamCreate", o_stream_create},
 {"cuMemAlloc", o_mem_alloc}, {"cuMemAllocHost", o_alloc_host}, {"cuMemHostRegister", o_host_register},
 {"cuPointerGetAttribute", o_pointer_attr}, {"cuCtxPushCurrent+Pop", o_push_pop}, {"cuFlushGPUDirectRDMAWrites", o_flush},
 {"cuMemGetAddressRange", o_address_range}, {"cuIpcGetMemHandle", o_ipc_handle}, {"cuStreamSynchronize(idle)", o_stream_sync_idle},
 {"cuEventSynchronize(done)", o_event_sync}, {"cuMemHostGetDevicePointer", o_host_get_dev_ptr}, {"cuMemGetHandleForAddressRange", o_dmabuf},
};
struct Arg { Op op; volatile double took; };
static void* runner(void* a) { Arg* arg = (Arg*)a; cuCtxSetCurrent(ctx); double t = now(); arg->op(); arg->took = now() - t; return 0; }
static void trial(Op blocker, Op op) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(cuStreamCreate(&held, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  void* w; CK(cuMemHostAlloc(&w, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE)); word = (volatile unsigned*)w; *word = 0;
  CK(cuMemHostGetDevicePointer(&word_dev, w, 0));
  CK(cuMemAlloc(&dev_a, 2 << 20)); CK(cuMemAlloc(&dev_b, 1 << 20)); CK(cuMemAlloc(&dev_free, 1 << 20));
  CK(cuMemAllocHost(&pinned, 1 << 20)); CK(cuMemAllocHost(&pinned_free, 1 << 20));
  registered = aligned_alloc(4096, 1 << 20); CK(cuMemHostRegister(registered, 1 << 20, 0)); to_register = aligned_alloc(4096, 1 << 20);
  CK(cuEventCreate(&ev_done, CU_EVENT_DISABLE_TIMING)); CK(cuEventRecord(ev_done, other)); CK(cuStreamSynchronize(other));
  CK(cuStreamWaitValue32(held, word_dev, 1, CU_STREAM_WAIT_VALUE_GEQ));
  Arg a1 = {blocker, -1}; pthread_t t1; pthread_create(&t1, 0, runner, &a1);
  usleep(300000);
  Arg a2 = {op, -1}; pthread_t t2; pthread_create(&t2, 0, runner, &a2);
  usleep(1200000);
  double op_took = a2.took, blocker_took = a1.took;
  __atomic_store_n(word, 1, __ATOMIC_SEQ_CST);
  pthread_join(t1, 0); pthread_join(t2, 0);
  printf("%s%s\n", op_took < 0 ? "BLOCKED" : "returns", blocker_took >= 0 ? " (thread 1 was not stuck!)" : "");
}
int main() {
  for (unsigned b = 0; b < sizeof(blockers) / sizeof(blockers[0]); b++) {
    printf("== thread 1 in %s, stuck on a held stream; thread 2:\n", blockers[b].name); fflush(stdout);
    for (unsigned i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
      printf("  %-32s ", ops[i].name); fflush(stdout);
      pid_t pid = fork();
      if (pid == 0) { trial(blockers[b].op, ops[i].op); fflush(stdout); _exit(0); }
      int status = 0; double start = now(); int done = 0;
      while (now() - start < 12) { if (waitpid(pid, &status, WNOHANG) == pid) { done = 1; break; } usleep(20000); }
      if (!done) { kill(pid, SIGKILL); waitpid(pid, &status, 0); printf("HUNG (killed after 12 s: a deadlock after the release)\n"); }
      fflush(stdout);
    }
  }
  return 0;
}
