#define _POSIX_C_SOURCE 200809L
/* A GPU buffer shared between two processes by its gdr:// URI: the parent
 * allocates device memory on GPU 0, fills it, exports the URI and runs
 * this program again as the child with it; the child opens the URI (CUDA
 * IPC: the real driver's, or the simulated GPU's across OS processes),
 * reads the parent's bytes, writes its own; the parent then reads them.
 * The backend comes from GDR_BACKEND (sim in CI; auto on a GPU machine
 * without an RDMA NIC). Usage: uri_share [child <uri>]. */
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

#define LEN (1u << 20)

static unsigned char expected(size_t i, unsigned seed) { return (unsigned char)(i * 31 + seed); }

static gdr_context context(void) {
  gdr_context c = {0};
  EXPECT(gdr_context_new(NULL, &c), GDR_RESULT_OK);
  return c;
}

static int child(const char *uri) {
  gdr_context c = context();
  gdr_buffer opened = {0};
  EXPECT(gdr_buffer_open_uri(c, uri, &opened), GDR_RESULT_OK);
  gdr_buffer_info info;
  EXPECT(gdr_buffer_get_info(opened, &info), GDR_RESULT_OK);
  CHECK(info.size == LEN && info.memory == GDR_MEMORY_DEVICE, "opened %llu bytes, memory %u",
        (unsigned long long)info.size, (unsigned)info.memory);
  unsigned char *bytes = malloc(LEN);
  EXPECT(gdr_buffer_copy_out(opened, 0, bytes, LEN), GDR_RESULT_OK);
  size_t wrong = 0;
  for (size_t i = 0; i < LEN; i++) wrong += bytes[i] != expected(i, 7);
  CHECK(wrong == 0, "child: %zu bytes differ from the parent's", wrong);
  for (size_t i = 0; i < LEN; i++) bytes[i] = expected(i, 99);
  EXPECT(gdr_buffer_copy_in(opened, 0, bytes, LEN), GDR_RESULT_OK);
  free(bytes);
  EXPECT(gdr_buffer_free(opened), GDR_RESULT_OK);
  EXPECT(gdr_context_free(c), GDR_RESULT_OK);
  if (failures == 0) printf("uri_share child: read the parent's bytes, wrote its own\n");
  return failures != 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "child") == 0) return child(argv[2]);
  gdr_context c = context();
  char describe[2048];
  if (gdr_context_describe(c, describe, sizeof describe, NULL) == GDR_RESULT_OK)
    printf("context: %s\n", describe);
  gdr_buffer device = {0};
  EXPECT(gdr_buffer_alloc(c, GDR_MEMORY_DEVICE, 0, LEN, &device), GDR_RESULT_OK);
  unsigned char *bytes = malloc(LEN);
  for (size_t i = 0; i < LEN; i++) bytes[i] = expected(i, 7);
  EXPECT(gdr_buffer_copy_in(device, 0, bytes, LEN), GDR_RESULT_OK);
  char uri[300];
  EXPECT(gdr_buffer_export_uri(device, uri, sizeof uri, NULL), GDR_RESULT_OK);
  printf("uri: %.60s...\n", uri);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    execl(argv[0], argv[0], "child", uri, (char *)NULL);
    _exit(127);
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "the child ran");
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's checks passed (status %d)", status);
  EXPECT(gdr_buffer_copy_out(device, 0, bytes, LEN), GDR_RESULT_OK);
  size_t wrong = 0;
  for (size_t i = 0; i < LEN; i++) wrong += bytes[i] != expected(i, 99);
  CHECK(wrong == 0, "parent: %zu bytes differ from the child's", wrong);
  free(bytes);
  EXPECT(gdr_buffer_free(device), GDR_RESULT_OK);
  EXPECT(gdr_context_free(c), GDR_RESULT_OK);
  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("uri_share: all checks passed\n");
  return 0;
}
