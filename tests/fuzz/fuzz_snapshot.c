/* fuzz_snapshot.c — the snapshot reader: any bytes through kvt_seq_restore into a small context
 * of every policy (snapshot_ctx.h). An input starting with 0x88 gets the magic and every CRC and
 * padding fixed (fuzz_fix_crcs), so mutations reach the META, ROWS and STATE parsers and the
 * policies' snap_load; other inputs fuzz the checksums.
 *
 * Checked: the status is in kvt_seq_restore's documented set; a refused input leaves every pool
 * with all its pages; an accepted one passes kvt_seq_check, snapshots again to a snapshot that
 * is refused beside it (its request id is live) and, once it is destroyed, restores to the same
 * state (the second snapshot equals the third byte for byte), runs a few
 * steps (closes, rounds) with checks after each, and gives every page back when destroyed.
 * kvt_snapshot_context must also accept or refuse it without harm. */
#include "fuzz.h"
#include "snapshot_ctx.h"

#define N_PAGES 64u

static void all_pages_free(kvt_ctx *ctx, const char *when) {
    for (uint32_t l = 0; l < 3; l++) {
        uint32_t f = 0;
        kvt_ctx_free_pages(ctx, l, &f);
        FUZZ_REQUIRE(f == N_PAGES, "layer %u: %u of %u pages free %s", l, f, N_PAGES, when);
    }
}

static uint8_t *snap(kvt_seq *seq, size_t *n) {
    kvt_status s = kvt_seq_snapshot_size(seq, n);
    FUZZ_REQUIRE(s == KVT_OK, "snapshot size of a restored request: %s", kvt_status_name(s));
    uint8_t *b = malloc(*n);
    FUZZ_REQUIRE(b, "oom");
    s = kvt_seq_snapshot(seq, b, *n, n);
    FUZZ_REQUIRE(s == KVT_OK, "snapshot of a restored request: %s", kvt_status_name(s));
    return b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *fixed = malloc(size ? size : 1);
    FUZZ_REQUIRE(fixed, "oom");
    memcpy(fixed, data, size);
    if (size > 0 && data[0] == 0x88)
        fuzz_fix_crcs(fixed, size);
    kvt_model *model = NULL;
    kvt_ctx *ctx = fuzz_snapshot_ctx(&model, N_PAGES);
    FUZZ_REQUIRE(ctx, "context");
    kvt_seq *seq = NULL;
    kvt_status s = kvt_seq_restore(ctx, fixed, size, &seq);
    FUZZ_STATUS("kvt_seq_restore", s, KVT_ERR_PARSE, KVT_ERR_CORRUPT, KVT_ERR_UNSUPPORTED,
                KVT_ERR_MISMATCH, KVT_ERR_CAPACITY, KVT_ERR_POOL_EXHAUSTED);
    if (s != KVT_OK) {
        FUZZ_REQUIRE(!seq, "a refused restore returned a request");
        all_pages_free(ctx, "after a refused restore");
    } else {
        s = kvt_seq_check(seq);
        FUZZ_REQUIRE(s == KVT_OK, "check of a restored request: %s", kvt_status_name(s));
        size_t n1, n2;
        uint8_t *b1 = snap(seq, &n1);
        kvt_seq *again = NULL;
        /* Beside the live request: its id is taken, refused with nothing changed. */
        uint32_t before[3] = {0}, after[3] = {0};
        for (uint32_t l = 0; l < 3; l++)
            kvt_ctx_free_pages(ctx, l, &before[l]);
        s = kvt_seq_restore(ctx, b1, n1, &again);
        FUZZ_REQUIRE(s == KVT_ERR_INVALID_ARGUMENT && !again,
                     "restore beside the live request: %s", kvt_status_name(s));
        for (uint32_t l = 0; l < 3; l++) {
            kvt_ctx_free_pages(ctx, l, &after[l]);
            FUZZ_REQUIRE(before[l] == after[l], "layer %u: %u free pages before a refused "
                         "restore, %u after", l, before[l], after[l]);
        }
        /* In its place (a preemption): the second round trip gives the same bytes. */
        kvt_seq_destroy(seq);
        s = kvt_seq_restore(ctx, b1, n1, &seq);
        FUZZ_REQUIRE(s == KVT_OK, "restore of a restored request's snapshot: %s",
                     kvt_status_name(s));
        uint8_t *b2 = snap(seq, &n2);
        FUZZ_REQUIRE(n1 == n2 && memcmp(b1, b2, n1) == 0, "second round trip differs");
        free(b2);
        free(b1);
        /* The restored request works: a few steps through closes and rounds. */
        kvt_batch *b = NULL;
        FUZZ_REQUIRE(kvt_batch_create(ctx, 1, &b) == KVT_OK, "batch");
        for (int i = 0; i < 6; i++) {
            uint32_t n = (uint32_t)(1 + (size + (size_t)i * 7) % 23);
            s = kvt_batch_reserve(b, &seq, &n, 1);
            FUZZ_STATUS("kvt_batch_reserve", s, KVT_ERR_POOL_EXHAUSTED, KVT_ERR_CAPACITY,
                        KVT_ERR_BAD_STATE);
            if (s != KVT_OK)
                break;
            s = kvt_batch_commit(b, NULL);
            FUZZ_REQUIRE(s == KVT_OK, "commit after restore: %s", kvt_status_name(s));
            s = kvt_seq_check(seq);
            FUZZ_REQUIRE(s == KVT_OK, "check after a step: %s", kvt_status_name(s));
        }
        kvt_batch_destroy(b);
        kvt_seq_destroy(seq);
        all_pages_free(ctx, "after destroying the restored request");
    }
    kvt_ctx *own = NULL;
    s = kvt_snapshot_context(fixed, size, KVT_BACKEND_CPU, &own);
    FUZZ_STATUS("kvt_snapshot_context", s, KVT_ERR_PARSE, KVT_ERR_CORRUPT, KVT_ERR_UNSUPPORTED,
                KVT_ERR_INVALID_ARGUMENT, KVT_ERR_POLICY_MISMATCH, KVT_ERR_OUT_OF_MEMORY);
    kvt_ctx_destroy(own);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(model);
    free(fixed);
    return 0;
}
