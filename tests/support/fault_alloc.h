/* fault_alloc.h — host allocation faults for the tests that inject them (test_faults,
 * test_snapshot): include it in exactly one file of a test executable. A context created with
 * KVT_ALLOC_LIBC allocates through aligned_alloc, which this defines (interposing libc's): with
 * fault_countdown = k the k-th allocation from then on fails (returns NULL) and counts in
 * fault_hits; -1 turns faults off. */
#ifndef KVT_TESTS_FAULT_ALLOC_H
#define KVT_TESTS_FAULT_ALLOC_H

#include <stdlib.h>

static int fault_countdown = -1; /* -1: off; 0: the next allocation fails */
static int fault_hits;

void *aligned_alloc(size_t align, size_t size) {
    if (fault_countdown == 0) {
        fault_countdown = -1;
        fault_hits++;
        return NULL;
    }
    if (fault_countdown > 0)
        fault_countdown--;
    void *p = NULL;
    if (posix_memalign(&p, align < sizeof(void *) ? sizeof(void *) : align, size) != 0)
        return NULL;
    return p;
}

#endif
