/* fault_alloc.h — allocation and I/O faults for the tests that inject them (test_faults,
 * test_snapshot, test_fork): include it in exactly one file of a test executable. It installs a
 * hook on the library's seams (lib/base/seam.h) at start-up: with fault_countdown = k the k-th
 * allocation of the library from then on fails (returns NULL) and counts in fault_hits; -1 turns
 * faults off. fault_io_countdown does the same for the I/O seam (the call fails with EIO and
 * fault_io_what names its operation), and fault_io_chunk > 0 makes every read and write transfer
 * at most that many bytes (short transfers). */
#ifndef KVT_TESTS_FAULT_ALLOC_H
#define KVT_TESTS_FAULT_ALLOC_H

#include "lib/base/seam.h"

#include <errno.h>
#include <string.h>

static int fault_countdown = -1; /* -1: off; 0: the next allocation fails */
static int fault_hits;
static int fault_io_countdown = -1; /* -1: off; 0: the next I/O call fails */
static const char *fault_io_what;   /* the operation of the I/O call that failed */
static size_t fault_io_chunk;       /* 0: whole transfers */

static int fault_hook(void *user, kvt__seam_call *c) {
    (void)user;
    if (c->kind == KVT__SEAM_IO) {
        if (fault_io_chunk && c->bytes > fault_io_chunk &&
            (!strcmp(c->op, "read") || !strcmp(c->op, "write")))
            c->bytes = fault_io_chunk;
        if (fault_io_countdown == 0) {
            fault_io_countdown = -1;
            fault_io_what = c->op;
            return EIO;
        }
        if (fault_io_countdown > 0)
            fault_io_countdown--;
        return 0;
    }
    if (fault_countdown == 0) {
        fault_countdown = -1;
        fault_hits++;
        return ENOMEM;
    }
    if (fault_countdown > 0)
        fault_countdown--;
    return 0;
}

__attribute__((constructor)) static void fault_install(void) {
    kvt__seam_set_hook(fault_hook, NULL);
}

#endif
