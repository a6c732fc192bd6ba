/* Transfers through the C ABI: two engines on two simulated contexts of this
 * process (nodes of its one simulated fabric). b listens on its NIC's
 * address and accepts on a second thread while a connects. b grants host
 * memory a WRITEs a pattern into and READs back (descriptors through both
 * the binary and the text form), then device memory (filled and checked
 * with gdr_buffer_copy_in/out); read-only memory (gdr_buffer_wrap_read_only)
 * granted for reading only, never READ into or copied into; then the
 * refusals: out of the grant, out of the region, a read-only grant written,
 * a forged descriptor, another engine's region, a revoked grant, nobody
 * listening; a batch waited with no time, a cancelled one. Where the contexts have a GPU, the
 * stream-ordered fences (stream_ordering below). Built with -fsanitize=address,undefined by
 * scripts/c-tests.sh, and run under Valgrind without them. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gdr.h"

#define LEN 8192u
#define WAIT_MS 30000u

static _Alignas(64) uint8_t src[LEN], dst[LEN], back[LEN];

static void pattern(uint8_t *bytes, size_t len, uint8_t seed) {
  for (size_t i = 0; i < len; i++) bytes[i] = (uint8_t)(i * 7 + seed + (i >> 8));
}

/* What freeing a handle gives: OK, or INVALID_HANDLE for the zero handles
 * of what was never made (the GPU part without a GPU). */
#define LIVE(handle) ((handle).id != 0 ? GDR_RESULT_OK : GDR_RESULT_INVALID_HANDLE)

/* A context of the backends GDR_BACKEND names (sim in CI, real in the
 * SoftRoCE guest: rdma-core's rxe0, no GPU). */
static gdr_context env_context(void) {
  gdr_context context = {0};
  EXPECT(gdr_context_new(NULL, &context), GDR_RESULT_OK);
  return context;
}

static gdr_buffer wrap(gdr_context context, uint8_t *bytes) {
  gdr_buffer buffer = {0};
  EXPECT(gdr_buffer_wrap(context, (uint64_t)(uintptr_t)bytes, LEN, &buffer), GDR_RESULT_OK);
  return buffer;
}

static gdr_region region(gdr_engine engine, gdr_buffer buffer, gdr_rung want) {
  gdr_region r = {0};
  EXPECT(gdr_region_register(engine, buffer, 0, LEN, &r), GDR_RESULT_OK);
  gdr_rung rungs[4] = {99, 99, 99, 99};
  size_t count = 0;
  EXPECT(gdr_region_rungs(r, NULL, 0, &count), GDR_RESULT_BUFFER_TOO_SMALL);
  EXPECT(gdr_region_rungs(r, rungs, 4, &count), GDR_RESULT_OK);
  CHECK(count == 1 && rungs[0] == want, "%zu NICs, rung %u, want %u", count, (unsigned)rungs[0],
        (unsigned)want);
  return r;
}

/* Submits `count` transfers on `peer` and waits for the batch: its result. */
static gdr_result run(gdr_peer peer, const gdr_transfer *transfers, size_t count) {
  gdr_batch batch = {0};
  gdr_result r = gdr_peer_submit(peer, transfers, count, 0, &batch);
  if (r != GDR_RESULT_OK) return r;
  r = gdr_batch_wait(batch, WAIT_MS);
  bool done = false;
  gdr_result outcome = 12345;
  EXPECT(gdr_batch_poll(batch, &done, &outcome), GDR_RESULT_OK);
  CHECK(done && outcome == r, "poll after the wait: done %d, %u vs %u", done, (unsigned)outcome,
        (unsigned)r);
  EXPECT(gdr_batch_free(batch), GDR_RESULT_OK);
  return r;
}

struct accepting {
  gdr_listener listener;
  gdr_peer peer;
  gdr_result result;
};

static void *accept_peer(void *arg) {
  struct accepting *a = arg;
  a->result = gdr_listener_accept(a->listener, WAIT_MS, &a->peer);
  return NULL;
}

/* A descriptor handle of grant `g` through its binary form; `bytes` gets a
 * copy (`*len` bytes, malloc'ed). */
static gdr_descriptor decoded(gdr_grant g, uint8_t **bytes, size_t *len) {
  size_t need = 0;
  EXPECT(gdr_grant_descriptor(g, NULL, 0, &need), GDR_RESULT_BUFFER_TOO_SMALL);
  CHECK(need > 30, "a binary descriptor of %zu bytes", need);
  *bytes = malloc(need);
  *len = need;
  EXPECT(gdr_grant_descriptor(g, *bytes, need - 1, NULL), GDR_RESULT_BUFFER_TOO_SMALL);
  EXPECT(gdr_grant_descriptor(g, *bytes, need, NULL), GDR_RESULT_OK);
  gdr_descriptor d = {0};
  EXPECT(gdr_descriptor_decode(*bytes, need, &d), GDR_RESULT_OK);
  return d;
}

/* The stream-ordered fences, both ways, on a stream of a's GPU 0 (b's GPU
 * memory `bgpu`, granted to a as `dgpu`, registered on b as `rgpu`):
 * 1. a stream waits for a READ of b's GPU memory into a's: a device-to-host
 *    copy queued after the fence sees the data the batch brought;
 * 2. a batch waits for a stream: a host-to-device copy into a's GPU memory,
 *    then a WRITE of it into b's gated on the stream: b gets what the
 *    stream copied, not what was there before;
 * and the streams' refusals: buffers held by queued copies are busy until
 * the stream is synchronized, ranges and kinds checked. */
static void stream_ordering(gdr_context ca, gdr_engine ea, gdr_peer ab, gdr_engine eb,
                            gdr_buffer bgpu, gdr_region rgpu, gdr_descriptor dgpu) {
  static uint8_t expected[LEN], seen[LEN], before[LEN], streamed[LEN];
  gdr_stream stream = {0};
  EXPECT(gdr_stream_new(ca, 7, &stream), GDR_RESULT_NO_DEVICE);
  EXPECT(gdr_stream_new(ca, 0, &stream), GDR_RESULT_OK);
  void *raw = NULL;
  EXPECT(gdr_stream_raw(stream, &raw), GDR_RESULT_OK);
  CHECK(raw != NULL, "a stream's native handle is never NULL");
  gdr_buffer agpu = {0}, ahost = {0}, abytes = {0};
  EXPECT(gdr_buffer_alloc(ca, GDR_MEMORY_DEVICE, 0, LEN, &agpu), GDR_RESULT_OK);
  EXPECT(gdr_buffer_alloc(ca, GDR_MEMORY_HOST, 0, LEN, &ahost), GDR_RESULT_OK);
  EXPECT(gdr_buffer_alloc(ca, GDR_MEMORY_PINNED, 0, LEN, &abytes), GDR_RESULT_OK);
  gdr_region ragpu = {0};
  EXPECT(gdr_region_register(ea, agpu, 0, LEN, &ragpu), GDR_RESULT_OK);

  /* 1. The fence: a's GPU memory starts as `before`, b's holds `expected`. */
  pattern(before, LEN, 77);
  EXPECT(gdr_buffer_copy_in(agpu, 0, before, LEN), GDR_RESULT_OK);
  EXPECT(gdr_buffer_copy_out(bgpu, 0, expected, LEN), GDR_RESULT_OK);
  CHECK(memcmp(expected, before, LEN) != 0, "b's data differs from a's before the READ");
  gdr_transfer read = {GDR_OP_READ, ragpu, 0, dgpu, 0, LEN};
  gdr_batch batch = {0};
  EXPECT(gdr_peer_submit(ab, &read, 1, 0, &batch), GDR_RESULT_OK);
  EXPECT(gdr_batch_fence_stream(batch, stream), GDR_RESULT_OK);
  EXPECT(gdr_stream_copy(stream, ahost, 0, agpu, 0, LEN), GDR_RESULT_OK);
  /* Held by the queued copy: not freed under it. */
  EXPECT(gdr_buffer_free(ahost), GDR_RESULT_BUSY);
  EXPECT(gdr_buffer_free(agpu), GDR_RESULT_BUSY);
  EXPECT(gdr_stream_synchronize(stream), GDR_RESULT_OK);
  EXPECT(gdr_batch_wait(batch, WAIT_MS), GDR_RESULT_OK);
  EXPECT(gdr_batch_free(batch), GDR_RESULT_OK);
  EXPECT(gdr_buffer_copy_out(ahost, 0, seen, LEN), GDR_RESULT_OK);
  CHECK(memcmp(seen, expected, LEN) == 0,
        "the copy queued after the fence ran after the READ and saw b's data");

  /* 2. The gate: the stream copies `streamed` into a's GPU memory; the
   * WRITE gated on it sends that to b. */
  pattern(streamed, LEN, 91);
  EXPECT(gdr_buffer_copy_in(abytes, 0, streamed, LEN), GDR_RESULT_OK);
  EXPECT(gdr_stream_copy(stream, agpu, 0, abytes, 0, LEN), GDR_RESULT_OK);
  gdr_transfer write = {GDR_OP_WRITE, ragpu, 0, dgpu, 0, LEN};
  EXPECT(gdr_peer_submit_after_stream(ab, stream, &write, 1, 0, &batch), GDR_RESULT_OK);
  EXPECT(gdr_batch_wait(batch, WAIT_MS), GDR_RESULT_OK);
  EXPECT(gdr_batch_free(batch), GDR_RESULT_OK);
  EXPECT(gdr_engine_fence_inbound_writes(eb, rgpu, NULL), GDR_RESULT_OK);
  EXPECT(gdr_buffer_copy_out(bgpu, 0, seen, LEN), GDR_RESULT_OK);
  CHECK(memcmp(seen, streamed, LEN) == 0,
        "the WRITE gated on the stream sent what the stream copied");
  /* Refused at the call: a transfer out of the grant, nothing queued. */
  gdr_transfer beyond = {GDR_OP_WRITE, ragpu, 0, dgpu, 1, LEN};
  EXPECT(gdr_peer_submit_after_stream(ab, stream, &beyond, 1, 0, &batch), GDR_RESULT_REFUSED);
  EXPECT(gdr_peer_submit_after_stream(ab, (gdr_stream){0}, &write, 1, 0, &batch),
         GDR_RESULT_INVALID_HANDLE);

  /* The copies' refusals. */
  EXPECT(gdr_stream_copy(stream, ahost, 1, agpu, 0, LEN), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_stream_copy(stream, ahost, 0, agpu, 0, 0), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_stream_copy(stream, ahost, 0, abytes, 0, LEN), GDR_RESULT_NOT_SUPPORTED);
  EXPECT(gdr_stream_copy(stream, agpu, 0, agpu, 16, 64), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_stream_copy(stream, agpu, 0, bgpu, 0, 64), GDR_RESULT_INVALID_ARGUMENT);
  /* Device to device, then freed with the stream: free waits for it. */
  EXPECT(gdr_stream_copy(stream, agpu, 0, agpu, LEN / 2, LEN / 2), GDR_RESULT_OK);
  EXPECT(gdr_stream_free(stream), GDR_RESULT_OK);
  EXPECT(gdr_stream_free(stream), GDR_RESULT_INVALID_HANDLE);
  EXPECT(gdr_stream_synchronize(stream), GDR_RESULT_INVALID_HANDLE);
  EXPECT(gdr_buffer_copy_out(agpu, 0, seen, LEN / 2), GDR_RESULT_OK);
  CHECK(memcmp(seen, streamed + LEN / 2, LEN / 2) == 0, "the device-to-device copy ran");
  EXPECT(gdr_region_free(ragpu), GDR_RESULT_OK);
  gdr_buffer buffers[] = {agpu, ahost, abytes};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++)
    EXPECT(gdr_buffer_free(buffers[i]), GDR_RESULT_OK);
}

int main(void) {
  gdr_context ca = env_context(), cb = env_context();
  char backends[1024] = "";
  EXPECT(gdr_context_describe(ca, backends, sizeof backends, NULL), GDR_RESULT_OK);
  printf("transfer on: %s\n", backends);
  gdr_engine_options options = {.qps_per_peer = 2, .default_timeout_ms = WAIT_MS};
  gdr_engine ea = {0}, eb = {0};
  EXPECT(gdr_engine_new(ca, &options, &ea), GDR_RESULT_OK);
  EXPECT(gdr_engine_new(cb, NULL, &eb), GDR_RESULT_OK);
  options.qps_per_peer = 70000;
  gdr_engine never = {0};
  EXPECT(gdr_engine_new(ca, &options, &never), GDR_RESULT_INVALID_ARGUMENT);

  /* b listens on its NIC's address; a connects while b accepts. */
  char ip[64], addr[96], bound[96];
  uint32_t nics = 0;
  EXPECT(gdr_engine_nic_count(eb, &nics), GDR_RESULT_OK);
  CHECK(nics == 1, "%u NICs", nics);
  EXPECT(gdr_engine_nic_address(eb, 0, ip, sizeof ip, NULL), GDR_RESULT_OK);
  EXPECT(gdr_engine_nic_address(eb, 1, ip + 32, 32, NULL), GDR_RESULT_NO_DEVICE);
  snprintf(addr, sizeof addr, "%s:0", ip);
  gdr_listener listener = {0};
  EXPECT(gdr_engine_listen(eb, addr, &listener), GDR_RESULT_OK);
  EXPECT(gdr_listener_local_addr(listener, bound, sizeof bound, NULL), GDR_RESULT_OK);
  const char *port = strrchr(bound, ':');
  CHECK(port != NULL && atoi(port + 1) > 0 && strncmp(bound, ip, strlen(ip)) == 0,
        "bound to %s (NIC %s)", bound, ip);
  struct accepting accepting = {.listener = listener};
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, accept_peer, &accepting) == 0, "a thread");
  gdr_peer ab = {0};
  EXPECT(gdr_engine_connect(ea, bound, WAIT_MS, &ab), GDR_RESULT_OK);
  pthread_join(thread, NULL);
  EXPECT(accepting.result, GDR_RESULT_OK);
  gdr_peer ba = accepting.peer;

  /* Host memory: a WRITEs into b's, READs it back into a third buffer. */
  pattern(src, LEN, 3);
  memset(dst, 0, LEN);
  memset(back, 0, LEN);
  gdr_buffer bsrc = wrap(ca, src), bback = wrap(ca, back), bdst = wrap(cb, dst);
  gdr_region rsrc = region(ea, bsrc, GDR_RUNG_HOST), rback = region(ea, bback, GDR_RUNG_HOST);
  gdr_region rdst = region(eb, bdst, GDR_RUNG_HOST);
  gdr_grant g = {0};
  EXPECT(gdr_peer_grant(ba, rdst, 0, LEN, GDR_RIGHTS_READ_WRITE, &g), GDR_RESULT_OK);
  EXPECT(gdr_peer_grant(ba, rdst, 0, LEN, 7, &(gdr_grant){0}), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_peer_grant(ba, rsrc, 0, LEN, GDR_RIGHTS_READ, &(gdr_grant){0}),
         GDR_RESULT_INVALID_ARGUMENT);
  uint64_t gid = 0;
  EXPECT(gdr_grant_id(g, &gid), GDR_RESULT_OK);
  gdr_descriptor announced = {0};
  EXPECT(gdr_peer_wait_grant(ab, gid, WAIT_MS, &announced), GDR_RESULT_OK);
  gdr_descriptor_info info;
  EXPECT(gdr_descriptor_get_info(announced, &info), GDR_RESULT_OK);
  CHECK(info.grant == gid && info.len == LEN && info.rights == GDR_RIGHTS_READ_WRITE &&
            info.device == -1,
        "announced: grant %llu, %llu bytes, rights %u, device %d", (unsigned long long)info.grant,
        (unsigned long long)info.len, info.rights, info.device);
  uint8_t *bytes = NULL;
  size_t nbytes = 0;
  gdr_descriptor binary = decoded(g, &bytes, &nbytes);
  char text[512];
  EXPECT(gdr_grant_descriptor_text(g, text, sizeof text, NULL), GDR_RESULT_OK);
  CHECK(strncmp(text, "gdr-md:v2:", 10) == 0, "text form %s", text);
  gdr_descriptor parsed = {0};
  EXPECT(gdr_descriptor_parse_text(text, &parsed), GDR_RESULT_OK);

  gdr_transfer write = {GDR_OP_WRITE, rsrc, 0, binary, 0, LEN};
  EXPECT(run(ab, &write, 1), GDR_RESULT_OK);
  CHECK(memcmp(dst, src, LEN) == 0, "b's memory holds what a WROTE");
  const uint64_t cut = LEN / 2 + 1;
  gdr_transfer reads[2] = {{GDR_OP_READ, rback, 0, parsed, 0, cut},
                           {GDR_OP_READ, rback, cut, parsed, cut, LEN - cut}};
  EXPECT(run(ab, reads, 2), GDR_RESULT_OK);
  CHECK(memcmp(back, src, LEN) == 0, "READ back: the data");

  /* Device memory on b, filled and read through copies (where the
   * context has a GPU: not in the SoftRoCE guest). */
  uint32_t gpus = 0;
  EXPECT(gdr_device_count(cb, &gpus, NULL), GDR_RESULT_OK);
  gdr_buffer bgpu = {0};
  gdr_region rgpu = {0};
  gdr_grant ggpu = {0};
  gdr_descriptor dgpu = {0};
  if (gpus > 0) {
    /* Device memory on b, filled and read through copies. */
    static uint8_t gpu_data[LEN], gpu_back[LEN];
    pattern(gpu_data, LEN, 41);
    EXPECT(gdr_buffer_alloc(cb, GDR_MEMORY_DEVICE, 0, LEN, &bgpu), GDR_RESULT_OK);
    EXPECT(gdr_buffer_copy_in(bgpu, 0, gpu_data, LEN), GDR_RESULT_OK);
    EXPECT(gdr_buffer_copy_in(bgpu, 1, gpu_data, LEN), GDR_RESULT_INVALID_ARGUMENT);
    rgpu = region(eb, bgpu, GDR_RUNG_DMABUF);
    EXPECT(gdr_peer_grant(ba, rgpu, 0, LEN, GDR_RIGHTS_READ_WRITE, &ggpu), GDR_RESULT_OK);
    uint64_t ggpu_id = 0;
    EXPECT(gdr_grant_id(ggpu, &ggpu_id), GDR_RESULT_OK);
    EXPECT(gdr_peer_wait_grant(ab, ggpu_id, WAIT_MS, &dgpu), GDR_RESULT_OK);
    EXPECT(gdr_descriptor_get_info(dgpu, &info), GDR_RESULT_OK);
    CHECK(info.device == 0, "GPU memory of GPU 0: %d", info.device);
    gdr_transfer read_gpu = {GDR_OP_READ, rback, 0, dgpu, 0, LEN};
    EXPECT(run(ab, &read_gpu, 1), GDR_RESULT_OK);
    CHECK(memcmp(back, gpu_data, LEN) == 0, "READ of b's GPU memory: the data");
    gdr_transfer write_gpu = {GDR_OP_WRITE, rsrc, 0, dgpu, 0, LEN};
    EXPECT(run(ab, &write_gpu, 1), GDR_RESULT_OK);
    EXPECT(gdr_engine_fence_inbound_writes(eb, rgpu, NULL), GDR_RESULT_OK);
    EXPECT(gdr_engine_fence_inbound_writes(ea, rgpu, NULL), GDR_RESULT_INVALID_ARGUMENT);
    EXPECT(gdr_buffer_copy_out(bgpu, 0, gpu_back, LEN), GDR_RESULT_OK);
    CHECK(memcmp(gpu_back, src, LEN) == 0, "WRITE into b's GPU memory: the data");
    /* Copies at an offset, device and host memory. */
    gdr_buffer at_offset[] = {bgpu, bdst};
    for (size_t i = 0; i < 2; i++) {
      uint8_t some[5] = {0};
      EXPECT(gdr_buffer_copy_in(at_offset[i], 100, "xyz", 3), GDR_RESULT_OK);
      EXPECT(gdr_buffer_copy_out(at_offset[i], 99, some, 5), GDR_RESULT_OK);
      CHECK(some[0] == src[99] && memcmp(some + 1, "xyz", 3) == 0 && some[4] == src[103],
            "buffer %zu: copies land at their offset", i);
    }
    stream_ordering(ca, ea, ab, eb, bgpu, rgpu, dgpu);
  } else {
    printf("transfer: no GPU in the context: device memory and streams skipped\n");
  }

  /* Read-only memory (gdr_buffer_wrap_read_only): b grants its constant
   * for reading only and a READs it; a grant of it with write rights, a
   * READ into a's read-only memory and copies into either are refused,
   * nothing written; a WRITE from it works. */
  static _Alignas(64) uint8_t constant[LEN], mine[LEN], constant_was[LEN], mine_was[LEN];
  pattern(constant, LEN, 61);
  pattern(mine, LEN, 62);
  memcpy(constant_was, constant, LEN);
  memcpy(mine_was, mine, LEN);
  gdr_buffer bconst = {0}, bmine = {0};
  EXPECT(gdr_buffer_wrap_read_only(cb, (uint64_t)(uintptr_t)constant, LEN, &bconst),
         GDR_RESULT_OK);
  EXPECT(gdr_buffer_wrap_read_only(ca, (uint64_t)(uintptr_t)mine, LEN, &bmine), GDR_RESULT_OK);
  EXPECT(gdr_buffer_wrap_read_only(ca, 0, LEN, &(gdr_buffer){0}), GDR_RESULT_INVALID_ARGUMENT);
  gdr_region rconst = region(eb, bconst, GDR_RUNG_HOST), rmine = region(ea, bmine, GDR_RUNG_HOST);
  EXPECT(gdr_peer_grant(ba, rconst, 0, LEN, GDR_RIGHTS_WRITE, &(gdr_grant){0}),
         GDR_RESULT_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "read-only") != NULL, "a write grant of read-only memory: %s",
        last_error());
  EXPECT(gdr_peer_grant(ba, rconst, 0, LEN, GDR_RIGHTS_READ_WRITE, &(gdr_grant){0}),
         GDR_RESULT_INVALID_ARGUMENT);
  gdr_grant gconst = {0};
  EXPECT(gdr_peer_grant(ba, rconst, 0, LEN, GDR_RIGHTS_READ, &gconst), GDR_RESULT_OK);
  uint64_t gconst_id = 0;
  EXPECT(gdr_grant_id(gconst, &gconst_id), GDR_RESULT_OK);
  gdr_descriptor dconst = {0};
  EXPECT(gdr_peer_wait_grant(ab, gconst_id, WAIT_MS, &dconst), GDR_RESULT_OK);
  gdr_transfer read_const = {GDR_OP_READ, rback, 0, dconst, 0, LEN};
  EXPECT(run(ab, &read_const, 1), GDR_RESULT_OK);
  CHECK(memcmp(back, constant_was, LEN) == 0, "a READ of b's read-only memory: the data");
  gdr_transfer into_mine[] = {{GDR_OP_READ, rmine, 0, dconst, 0, LEN},
                              {GDR_OP_READ, rmine, 0, binary, 0, LEN}};
  for (size_t i = 0; i < 2; i++) {
    EXPECT(run(ab, &into_mine[i], 1), GDR_RESULT_INVALID_ARGUMENT);
    CHECK(strstr(last_error(), "read-only") != NULL, "a READ into read-only memory: %s",
          last_error());
  }
  gdr_transfer from_mine = {GDR_OP_WRITE, rmine, 0, binary, 0, LEN};
  EXPECT(run(ab, &from_mine, 1), GDR_RESULT_OK);
  CHECK(memcmp(dst, mine_was, LEN) == 0, "a WRITE from a's read-only memory: the data");
  EXPECT(gdr_buffer_copy_in(bconst, 0, "xyz", 3), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_buffer_copy_in(bmine, 100, "xyz", 3), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_grant_revoke(gconst), GDR_RESULT_OK);
  EXPECT(gdr_descriptor_free(dconst), GDR_RESULT_OK);
  EXPECT(gdr_region_free(rconst), GDR_RESULT_OK);
  EXPECT(gdr_region_free(rmine), GDR_RESULT_OK);
  EXPECT(gdr_buffer_free(bconst), GDR_RESULT_OK);
  EXPECT(gdr_buffer_free(bmine), GDR_RESULT_OK);
  CHECK(memcmp(constant, constant_was, LEN) == 0 && memcmp(mine, mine_was, LEN) == 0,
        "read-only memory unchanged");

  /* Refusals, each before anything is posted. */
  gdr_transfer beyond = {GDR_OP_READ, rback, 0, binary, 1, LEN};
  EXPECT(run(ab, &beyond, 1), GDR_RESULT_REFUSED);
  CHECK(strstr(last_error(), "remote grant") != NULL, "beyond the grant: %s", last_error());
  gdr_transfer outside = {GDR_OP_READ, rback, 1, binary, 0, LEN};
  EXPECT(run(ab, &outside, 1), GDR_RESULT_INVALID_ARGUMENT);
  gdr_transfer theirs = {GDR_OP_READ, rdst, 0, binary, 0, 16};
  EXPECT(run(ab, &theirs, 1), GDR_RESULT_INVALID_ARGUMENT);
  gdr_transfer bad_op = {7, rback, 0, binary, 0, 16};
  EXPECT(run(ab, &bad_op, 1), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(run(ab, &write, 0), GDR_RESULT_INVALID_ARGUMENT);
  gdr_grant readonly = {0};
  EXPECT(gdr_peer_grant(ba, rdst, 0, 64, GDR_RIGHTS_READ, &readonly), GDR_RESULT_OK);
  uint64_t ro_id = 0;
  EXPECT(gdr_grant_id(readonly, &ro_id), GDR_RESULT_OK);
  gdr_descriptor ro = {0};
  EXPECT(gdr_peer_wait_grant(ab, ro_id, WAIT_MS, &ro), GDR_RESULT_OK);
  gdr_transfer write_ro = {GDR_OP_WRITE, rsrc, 0, ro, 0, 64};
  EXPECT(run(ab, &write_ro, 1), GDR_RESULT_REFUSED);
  /* A forged rkey (the first segment's, 24 bytes into it after the
   * 35-byte header): not what b announced. */
  bytes[35 + 24] ^= 1;
  gdr_descriptor forged = {0};
  EXPECT(gdr_descriptor_decode(bytes, nbytes, &forged), GDR_RESULT_OK);
  gdr_transfer with_forged = {GDR_OP_READ, rback, 0, forged, 0, 16};
  EXPECT(run(ab, &with_forged, 1), GDR_RESULT_REFUSED);
  EXPECT(gdr_descriptor_decode(bytes, 3, &(gdr_descriptor){0}), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_descriptor_parse_text("gdr-md:v2:zz", &(gdr_descriptor){0}),
         GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_peer_wait_grant(ab, gid + 1000, 10, &(gdr_descriptor){0}), GDR_RESULT_TIMEOUT);

  /* A batch waited with no time: over or still running, then waited. */
  gdr_batch batch = {0};
  EXPECT(gdr_peer_submit(ab, reads, 2, 0, &batch), GDR_RESULT_OK);
  gdr_result quick = gdr_batch_wait(batch, 0);
  CHECK(quick == GDR_RESULT_OK || quick == GDR_RESULT_TIMEOUT, "a 0 ms wait: %u", quick);
  EXPECT(gdr_batch_wait(batch, WAIT_MS), GDR_RESULT_OK);
  EXPECT(gdr_batch_poll(batch, NULL, NULL), GDR_RESULT_INVALID_ARGUMENT);
  EXPECT(gdr_batch_free(batch), GDR_RESULT_OK);
  EXPECT(gdr_batch_wait(batch, 0), GDR_RESULT_INVALID_HANDLE);
  /* A cancelled batch ends cancelled, or done if it won the race. */
  EXPECT(gdr_peer_submit(ab, reads, 2, 0, &batch), GDR_RESULT_OK);
  EXPECT(gdr_batch_cancel(batch), GDR_RESULT_OK);
  gdr_result cancelled = gdr_batch_wait(batch, WAIT_MS);
  CHECK(cancelled == GDR_RESULT_CANCELLED || cancelled == GDR_RESULT_OK, "cancelled: %u (%s)",
        cancelled, last_error());
  EXPECT(gdr_batch_free(batch), GDR_RESULT_OK);

  /* A revoked grant: refused at submit, or by b's NIC if a had not heard. */
  EXPECT(gdr_grant_revoke(g), GDR_RESULT_OK);
  EXPECT(gdr_grant_revoke(g), GDR_RESULT_INVALID_HANDLE);
  EXPECT(run(ab, reads, 1), GDR_RESULT_REFUSED);
  EXPECT(run(ab, &write, 1), GDR_RESULT_REFUSED);

  /* Nobody listening: the connect gives up. */
  char nobody[96];
  snprintf(nobody, sizeof nobody, "%s:1", ip);
  gdr_result lonely = gdr_engine_connect(ea, nobody, 200, &(gdr_peer){0});
  CHECK(lonely == GDR_RESULT_TIMEOUT || lonely == GDR_RESULT_CONNECTION_REJECTED,
        "nobody listening: %u (%s)", lonely, last_error());
  EXPECT(gdr_engine_connect(ea, "not an address", 10, &(gdr_peer){0}),
         GDR_RESULT_INVALID_ARGUMENT);

  /* Everything freed, each handle once. */
  free(bytes);
  gdr_descriptor descriptors[] = {announced, binary, parsed, dgpu, ro, forged};
  for (size_t i = 0; i < sizeof descriptors / sizeof descriptors[0]; i++)
    EXPECT(gdr_descriptor_free(descriptors[i]), LIVE(descriptors[i]));
  EXPECT(gdr_grant_revoke(ggpu), LIVE(ggpu));
  EXPECT(gdr_grant_revoke(readonly), GDR_RESULT_OK);
  EXPECT(gdr_peer_free(ab), GDR_RESULT_OK);
  EXPECT(gdr_peer_free(ba), GDR_RESULT_OK);
  EXPECT(gdr_peer_free(ba), GDR_RESULT_INVALID_HANDLE);
  EXPECT(gdr_listener_free(listener), GDR_RESULT_OK);
  gdr_region regions[] = {rsrc, rback, rdst, rgpu};
  for (size_t i = 0; i < sizeof regions / sizeof regions[0]; i++)
    EXPECT(gdr_region_free(regions[i]), LIVE(regions[i]));
  EXPECT(gdr_engine_free(ea), GDR_RESULT_OK);
  EXPECT(gdr_engine_free(eb), GDR_RESULT_OK);
  gdr_buffer buffers[] = {bsrc, bback, bdst, bgpu};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++)
    EXPECT(gdr_buffer_free(buffers[i]), LIVE(buffers[i]));
  EXPECT(gdr_context_free(ca), GDR_RESULT_OK);
  EXPECT(gdr_context_free(cb), GDR_RESULT_OK);
  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("transfer: all checks passed\n");
  return 0;
}
