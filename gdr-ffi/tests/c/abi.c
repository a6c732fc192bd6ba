/* The C ABI from C: contexts on the simulation, buffers, gdr:// URIs shared
 * between two contexts (two simulated processes), capabilities, and every
 * refusal the ABI promises (NULL, misaligned and short outputs, zero, freed,
 * wrong-kind and foreign handles, malformed URIs), and the doctor's JSON
 * report. Built with -fsanitize=address,undefined by scripts/c-tests.sh,
 * and run under Valgrind without them. Usage: abi <path of a second copy
 * of libgdr.so>. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gdr.h"

static gdr_context sim_context(void) {
  gdr_options options = {.backend = GDR_BACKEND_SIM};
  gdr_context context = {0};
  EXPECT(gdr_context_new(&options, &context), GDR_RESULT_OK);
  return context;
}

static void buffers_and_uris(void) {
  gdr_context a = sim_context(), b = sim_context();
  CHECK(a.id != 0 && b.id != 0 && a.id != b.id, "two live contexts");

  /* What the contexts are: the length first, then the text. */
  size_t needed = 0;
  EXPECT(gdr_context_describe(a, NULL, 0, &needed), GDR_RESULT_BUFFER_TOO_SMALL);
  CHECK(needed > 1, "describe needs %zu bytes", needed);
  char *text = malloc(needed);
  EXPECT(gdr_context_describe(a, text, needed, NULL), GDR_RESULT_OK);
  CHECK(strstr(text, "sim") != NULL, "describe: %s", text);
  free(text);

  uint32_t gpus = 0, nics = 0;
  EXPECT(gdr_device_count(a, &gpus, &nics), GDR_RESULT_OK);
  CHECK(gpus >= 1 && nics >= 1, "%u GPUs, %u NICs", gpus, nics);
  gdr_rung rung = 99;
  char why[512];
  EXPECT(gdr_path_rung(a, 0, 0, &rung, why, sizeof why, NULL), GDR_RESULT_OK);
  CHECK(rung == GDR_RUNG_DMABUF, "the sim NIC takes the sim GPU by dma-buf: %u", (unsigned)rung);
  bool available = false;
  EXPECT(gdr_gpudirect_available(a, &available), GDR_RESULT_OK);
  CHECK(available, "GDR available on the sim");
  EXPECT(gdr_path_rung(a, 7, 0, &rung, NULL, 0, NULL), GDR_RESULT_NO_DEVICE);

  /* Device memory on a, shared with b by its URI. */
  gdr_buffer device = {0}, opened = {0}, host = {0};
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_DEVICE, 0, 1 << 20, &device), GDR_RESULT_OK);
  gdr_buffer_info info;
  EXPECT(gdr_buffer_get_info(device, &info), GDR_RESULT_OK);
  CHECK(info.size == 1 << 20 && info.memory == GDR_MEMORY_DEVICE && info.device == 0,
        "device info: %llu bytes, memory %u, device %d", (unsigned long long)info.size,
        (unsigned)info.memory, info.device);
  char uri[300];
  size_t uri_len = 0;
  EXPECT(gdr_buffer_export_uri(device, uri, 10, &uri_len), GDR_RESULT_BUFFER_TOO_SMALL);
  CHECK(uri_len > 10 && uri_len <= sizeof uri, "the URI needs %zu bytes", uri_len);
  EXPECT(gdr_buffer_export_uri(device, uri, sizeof uri, NULL), GDR_RESULT_OK);
  CHECK(strncmp(uri, "gdr://v2/device/0/allocation/", 29) == 0, "uri %s", uri);
  EXPECT(gdr_buffer_open_uri(b, uri, &opened), GDR_RESULT_OK);
  gdr_buffer_info seen;
  EXPECT(gdr_buffer_get_info(opened, &seen), GDR_RESULT_OK);
  CHECK(seen.size == info.size && seen.memory == GDR_MEMORY_DEVICE, "opened %llu bytes",
        (unsigned long long)seen.size);
  gdr_context owner = {0};
  EXPECT(gdr_buffer_context(opened, &owner), GDR_RESULT_OK);
  CHECK(owner.id == b.id, "the opened buffer is b's");
  /* Host memory has no URI. */
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_HOST, 0, 4096, &host), GDR_RESULT_OK);
  EXPECT(gdr_buffer_get_info(host, &info), GDR_RESULT_OK);
  CHECK(info.memory == GDR_MEMORY_HOST && info.device == -1, "host info");
  EXPECT(gdr_buffer_export_uri(host, uri, sizeof uri, NULL), GDR_RESULT_NOT_SUPPORTED);

  /* Wrapped memory the caller owns. */
  static uint64_t mine[512];
  gdr_buffer wrapped = {0};
  EXPECT(gdr_buffer_wrap(a, (uint64_t)(uintptr_t)mine, sizeof mine, &wrapped), GDR_RESULT_OK);
  EXPECT(gdr_buffer_free(wrapped), GDR_RESULT_OK);

  /* Malformed URIs: refused, the reason in the last error. */
  const char *bad[] = {
      "", "gdr://v3/device/0/size/1/ipc/00", "gdr://v1/device/00/size/1/ipc/x",
      "http://example.com", "gdr://v2/device/0/allocation/10/offset/10/size/1/ipc/"
      "00000000000000000000000000000000000000000000000000000000000000000000000000000000"
      "000000000000000000000000000000000000000000000000",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    gdr_buffer never = {12345};
    EXPECT(gdr_buffer_open_uri(b, bad[i], &never), GDR_RESULT_INVALID_ARGUMENT);
    CHECK(never.id == 12345, "no output on failure");
    CHECK(strstr(last_error(), "gdr URI") != NULL || strstr(last_error(), "not a gdr") != NULL,
          "message for %s: %s", bad[i], last_error());
  }

  /* Freed, zero and wrong-kind handles. */
  EXPECT(gdr_buffer_free(opened), GDR_RESULT_OK);
  EXPECT(gdr_buffer_get_info(opened, &info), GDR_RESULT_INVALID_HANDLE);
  EXPECT(gdr_buffer_free(opened), GDR_RESULT_INVALID_HANDLE);
  CHECK(strstr(last_error(), "freed") != NULL, "freed: %s", last_error());
  gdr_buffer zero = {0};
  EXPECT(gdr_buffer_get_info(zero, &info), GDR_RESULT_INVALID_HANDLE);
  gdr_buffer context_as_buffer = {a.id};
  EXPECT(gdr_buffer_get_info(context_as_buffer, &info), GDR_RESULT_INVALID_HANDLE);
  CHECK(strstr(last_error(), "another kind") != NULL, "kind: %s", last_error());

  /* NULL, misaligned, zero-size and out-of-range arguments. */
  EXPECT(gdr_buffer_get_info(device, NULL), GDR_RESULT_INVALID_ARGUMENT);
  char raw[sizeof(gdr_buffer_info) + 8];
  EXPECT(gdr_buffer_get_info(device, (gdr_buffer_info *)(raw + 1)), GDR_RESULT_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "aligned") != NULL, "misaligned: %s", last_error());
  gdr_buffer out = {0};
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_DEVICE, 0, 0, &out), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_buffer_alloc(a, 99, 0, 4096, &out), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_DEVICE, 9, 4096, &out), GDR_RESULT_NO_DEVICE);
  CHECK(out.id == 0, "no output on failure");
  /* Sizes the allocator refuses (64 TiB): an error, the process alive
   * (they were the allocator's abort), and the next allocation works. */
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_HOST, 0, 1ull << 46, &out), GDR_RESULT_OUT_OF_RESOURCES);
  CHECK(strstr(last_error(), "out of memory") != NULL, "host: %s", last_error());
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_PINNED, 0, 1ull << 46, &out),
         GDR_RESULT_OUT_OF_RESOURCES);
  CHECK(out.id == 0, "no output on failure");
  EXPECT(gdr_buffer_alloc(a, GDR_MEMORY_HOST, 0, 4096, &out), GDR_RESULT_OK);
  EXPECT(gdr_buffer_free(out), GDR_RESULT_OK);
  out.id = 0;
  EXPECT(gdr_buffer_open_uri(b, NULL, &out), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_buffer_wrap(a, 0, 4096, &out), GDR_RESULT_INVALID_ARGUMENT);
  gdr_options bogus;
  memset(&bogus, 0xff, sizeof bogus);
  gdr_context never = {0};
  EXPECT(gdr_context_new(&bogus, &never), GDR_RESULT_INVALID_ARGUMENT);
  CHECK(never.id == 0, "no context on failure");

  EXPECT(gdr_buffer_free(host), GDR_RESULT_OK);
  EXPECT(gdr_buffer_free(device), GDR_RESULT_OK);
  EXPECT(gdr_context_free(b), GDR_RESULT_OK);
  EXPECT(gdr_context_free(a), GDR_RESULT_OK);
  EXPECT(gdr_context_free(a), GDR_RESULT_INVALID_HANDLE);
}

/* The doctor's report as JSON, no context needed: the length first, then
 * the text; every top-level key there, and the simulation's facts in it. */
static void doctor_report(void) {
  gdr_options options = {.backend = GDR_BACKEND_SIM};
  size_t needed = 0;
  EXPECT(gdr_doctor_report(&options, NULL, 0, &needed), GDR_RESULT_BUFFER_TOO_SMALL);
  CHECK(needed > 2, "the report needs %zu bytes", needed);
  char short_buf[4] = "abc";
  EXPECT(gdr_doctor_report(&options, short_buf, sizeof short_buf, NULL),
         GDR_RESULT_BUFFER_TOO_SMALL);
  CHECK(strcmp(short_buf, "abc") == 0, "a short buffer is left alone");
  /* Room to spare: each call gathers the report anew. */
  size_t len = needed + 4096;
  char *json = malloc(len);
  CHECK(json != NULL, "malloc");
  if (json == NULL) return;
  EXPECT(gdr_doctor_report(&options, json, len, &needed), GDR_RESULT_OK);
  CHECK(strlen(json) + 1 == needed, "%zu bytes written, %zu needed", strlen(json) + 1, needed);
  CHECK(json[0] == '{', "JSON: %.40s", json);
  static const char *const keys[] = {"backends", "libraries", "nvidia", "kernel_release",
                                     "memlock",  "rdma",      "gpus",   "topology",
                                     "rungs",    "hints"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    char key[64];
    snprintf(key, sizeof key, "\n  \"%s\": ", keys[i]);
    CHECK(strstr(json, key) != NULL, "top-level key %s missing", keys[i]);
  }
  CHECK(strstr(json, "\"asked\": \"sim\"") != NULL, "asked sim");
  CHECK(strstr(json, "\"rung\": \"dma-buf\"") != NULL, "the sim's GPU takes dma-buf");
  free(json);
  /* NULL options: the defaults (GDR_BACKEND=sim under this test). */
  EXPECT(gdr_doctor_report(NULL, NULL, 0, &needed), GDR_RESULT_BUFFER_TOO_SMALL);
  /* A backend number out of range is refused. */
  uint32_t bogus = 9;
  EXPECT(gdr_doctor_report((const gdr_options *)&bogus, short_buf, sizeof short_buf, NULL),
         GDR_RESULT_INVALID_ARGUMENT);
}

/* A second loaded copy of the library: its handles are not ours. */
static void foreign_instance(const char *copy) {
  void *lib = dlopen(copy, RTLD_NOW | RTLD_LOCAL);
  CHECK(lib != NULL, "dlopen %s: %s", copy, dlerror());
  if (lib == NULL) return;
  gdr_result (*their_new)(const gdr_options *, gdr_context *) =
      (gdr_result(*)(const gdr_options *, gdr_context *))dlsym(lib, "gdr_context_new");
  gdr_result (*their_free)(gdr_context) = (gdr_result(*)(gdr_context))dlsym(lib, "gdr_context_free");
  CHECK(their_new != NULL && their_free != NULL, "symbols of the copy");
  if (their_new == NULL || their_free == NULL) return;
  CHECK((void *)their_new != (void *)gdr_context_new, "a distinct copy");
  gdr_options options = {.backend = GDR_BACKEND_SIM};
  gdr_context theirs = {0};
  EXPECT(their_new(&options, &theirs), GDR_RESULT_OK);
  uint32_t gpus = 0;
  EXPECT(gdr_device_count(theirs, &gpus, NULL), GDR_RESULT_INVALID_HANDLE);
  CHECK(strstr(last_error(), "another instance") != NULL, "foreign: %s", last_error());
  EXPECT(gdr_context_free(theirs), GDR_RESULT_INVALID_HANDLE);
  EXPECT(their_free(theirs), GDR_RESULT_OK);
  /* (The copy stays loaded: Rust libraries do not support dlclose.) */
}

int main(int argc, char **argv) {
  CHECK(gdr_abi_version() == GDR_ABI_VERSION, "ABI %u", gdr_abi_version());
  CHECK(strncmp(gdr_version(), "gdr ", 4) == 0, "version %s", gdr_version());
  CHECK(strcmp(gdr_result_message(GDR_RESULT_INVALID_HANDLE), "unknown result") != 0,
        "every result has a message");
  CHECK(strcmp(gdr_rung_name(GDR_RUNG_STAGING), "staging") == 0, "rung %s",
        gdr_rung_name(GDR_RUNG_STAGING));
  CHECK(strcmp(gdr_rung_name(99), "unknown rung") == 0, "rung 99");
  CHECK(strcmp(gdr_memory_kind_name(GDR_MEMORY_DEVICE), "device") == 0, "memory %s",
        gdr_memory_kind_name(GDR_MEMORY_DEVICE));
  CHECK(strcmp(gdr_memory_kind_name(99), "unknown memory kind") == 0, "memory 99");
  buffers_and_uris();
  doctor_report();
  if (argc > 1) foreign_instance(argv[1]);
  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("abi: all checks passed\n");
  return 0;
}
