/* The checks the C tests share: CHECK(cond, fmt, ...) and EXPECT(call, result)
 * count failures (reported at the end), naming the call, its result and the
 * message gdr gives for it. */
#ifndef GDR_TEST_CHECK_H
#define GDR_TEST_CHECK_H
#include <stdio.h>
#include <string.h>

#include "gdr.h"

static int failures = 0;

#define CHECK(cond, ...)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                    \
      fprintf(stderr, __VA_ARGS__);                                           \
      fprintf(stderr, "\n");                                                  \
      failures++;                                                             \
    }                                                                         \
  } while (0)

/* This thread's last error message (a static buffer). */
static const char *last_error(void) {
  static char buf[1024];
  if (gdr_last_error_message(buf, sizeof buf, NULL) != GDR_RESULT_OK)
    strcpy(buf, "(no message)");
  return buf;
}

#define EXPECT(call, want)                                                    \
  do {                                                                        \
    gdr_result got_ = (call);                                                 \
    CHECK(got_ == (want), "%s: %u (%s: %s), want %u", #call, (unsigned)got_,  \
          gdr_result_message(got_), got_ ? last_error() : "",                 \
          (unsigned)(want));                                                  \
  } while (0)

#endif
