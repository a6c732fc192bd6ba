/* The gdr C API in one program: a context, what it found, a GPU buffer
 * shared with a second context through its gdr:// URI, and clean-up.
 * Compiled and run by scripts/docs-check.sh on the simulation backend
 * (GDR_BACKEND=sim); on a machine with a GPU and an RDMA NIC, run it with
 * GDR_BACKEND unset to use the hardware. Build by hand:
 *
 *   cargo build --release -p gdr-ffi
 *   gcc -std=c11 -I gdr-ffi/include buffers.c -L target/release -lgdr \
 *       -Wl,-rpath,$PWD/target/release -o buffers
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "gdr.h"

/* Prints a failed call with the thread's last error message (the result
 * code says what kind of failure; the message says which call, the native
 * code and why) and returns 1. */
static int fail(const char *call, gdr_result result) {
  char message[1024];
  if (gdr_last_error_message(message, sizeof message, NULL) != GDR_RESULT_OK)
    message[0] = '\0';
  fprintf(stderr, "%s: %s (%u): %s\n", call, gdr_result_message(result), (unsigned)result,
          message);
  return 1;
}

#define TRY(call)                                                              \
  do {                                                                         \
    gdr_result result_ = (call);                                               \
    if (result_ != GDR_RESULT_OK) return fail(#call, result_);                 \
  } while (0)

/* Text outputs: ask for the length, then fetch into a buffer that fits. */
static char *describe(gdr_context context) {
  size_t needed = 0;
  if (gdr_context_describe(context, NULL, 0, &needed) != GDR_RESULT_BUFFER_TOO_SMALL)
    return NULL;
  char *text = malloc(needed);
  if (text != NULL && gdr_context_describe(context, text, needed, NULL) != GDR_RESULT_OK) {
    free(text);
    return NULL;
  }
  return text;
}

int main(void) {
  uint32_t abi = gdr_abi_version();
  if (abi >> 16 != GDR_ABI_VERSION >> 16) {
    fprintf(stderr, "libgdr ABI %u.%u, built against %u\n", abi >> 16, abi & 0xffff,
            GDR_ABI_VERSION);
    return 1;
  }
  printf("%s\n", gdr_version());

  /* NULL options: the backend GDR_BACKEND names, else the hardware (never
   * the simulation silently). */
  gdr_context context;
  TRY(gdr_context_new(NULL, &context));
  char *what = describe(context);
  printf("backends: %s\n", what != NULL ? what : "?");
  free(what);

  uint32_t gpus = 0, nics = 0;
  TRY(gdr_device_count(context, &gpus, &nics));
  printf("%" PRIu32 " GPUs, %" PRIu32 " RDMA NICs\n", gpus, nics);
  if (gpus == 0 || nics == 0) {
    printf("nothing to share without a GPU and a NIC\n");
    TRY(gdr_context_free(context));
    return 0;
  }

  /* Which rung NIC 0 takes for GPU 0, and why not a higher one. */
  gdr_rung rung;
  char why_not[512];
  TRY(gdr_path_rung(context, 0, 0, &rung, why_not, sizeof why_not, NULL));
  printf("GPU 0 via NIC 0: %s%s%s\n",
         rung == GDR_RUNG_DMABUF    ? "dma-buf"
         : rung == GDR_RUNG_PEERMEM ? "nvidia-peermem"
                                    : "staging",
         why_not[0] != '\0' ? "; " : "", why_not);

  /* 1 MiB of GPU memory, exported as a gdr://v2 URI (a capability for its
   * whole CUDA allocation: send it only to processes you trust). */
  gdr_buffer device;
  TRY(gdr_buffer_alloc(context, GDR_MEMORY_DEVICE, 0, 1 << 20, &device));
  char uri[512];
  TRY(gdr_buffer_export_uri(device, uri, sizeof uri, NULL));
  printf("exported %s\n", uri);

  /* Another context (here in this process; normally another process) opens
   * it and sees the same range. */
  gdr_context other;
  TRY(gdr_context_new(NULL, &other));
  gdr_buffer opened;
  TRY(gdr_buffer_open_uri(other, uri, &opened));
  gdr_buffer_info info;
  TRY(gdr_buffer_get_info(opened, &info));
  printf("opened: %" PRIu64 " bytes of device memory on GPU %" PRId32 "\n", info.size,
         info.device);
  if (info.size != 1 << 20 || info.memory != GDR_MEMORY_DEVICE) {
    fprintf(stderr, "the opened buffer is not the exported one\n");
    return 1;
  }

  /* Memory the caller owns (host memory here; a device address works the
   * same way): wrapped, never freed by gdr. It must stay allocated until
   * gdr_buffer_free has returned GDR_RESULT_OK. */
  size_t mine_len = 1 << 16;
  void *mine = aligned_alloc(4096, mine_len);
  if (mine == NULL) return 1;
  gdr_buffer wrapped;
  TRY(gdr_buffer_wrap(context, (uint64_t)(uintptr_t)mine, mine_len, &wrapped));
  TRY(gdr_buffer_get_info(wrapped, &info));
  printf("wrapped: %" PRIu64 " bytes of %s memory\n", info.size,
         info.memory == GDR_MEMORY_DEVICE ? "device" : "host");
  TRY(gdr_buffer_free(wrapped));
  free(mine);

  /* Importers close first, the exporter last. */
  TRY(gdr_buffer_free(opened));
  TRY(gdr_buffer_free(device));
  TRY(gdr_context_free(other));
  TRY(gdr_context_free(context));
  return 0;
}
