/*
 * test_threads.c — the concurrency model of kvtier.h ("Threads"), exercised with real threads.
 *
 * A plain executable, not a Criterion suite: Criterion 2.4.1 aborts at start under
 * ThreadSanitizer ("Could not initialize inheritable arena"), and this test exists to run under
 * it (test.sh's build-test-tsan). It runs in every other configuration too.
 *
 * One schedule of steps over two batches of three requests each (step t uses batch t % 2) on a
 * context with three policy groups (salience, random eviction, sliding window), played four ways:
 *
 *   reference   one thread, in the scheduler's call order: prepare (reserve + plan) step t + 1,
 *               run step t (write the rows, run every layer), commit step t, kvt_seq_check.
 *   pipeline    a scheduler thread and a runner thread: the scheduler reserves and plans step
 *               t + 1 on one batch while the runner writes and runs step t on the other; the
 *               scheduler hands step t + 1 over before it commits and checks step t, so a commit
 *               (with policy work left to it: some steps skip a layer's run) and the checks
 *               overlap the next step's runs. Meanwhile the scheduler creates and destroys a
 *               request of its own.
 *   two runners the same with one runner thread per batch, so the runs of steps t and t + 1
 *               overlap each other as well; no stated max_rows_per_seq, so the runs grow their
 *               requests' state and the batch's workspace (host allocations on both threads).
 *   contexts    three threads, each playing the reference on a context of its own (one model
 *               shared read-only), and each checking that kvt_last_error is its own.
 *
 * Every way must emit exactly the reference's attended sets (slots, per step, layer and request:
 * the pool is used in the same order, so even the slots agree) and leave kvt_seq_check clean after
 * every step. Exit status 0 on success; the first mismatch is printed.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"

#define N_LAYERS 3
#define N_BATCHES 2
#define SEQS_PER_BATCH 3
#define N_SEQS (N_BATCHES * SEQS_PER_BATCH)
#define N_STEPS 96
#define N_CONTEXT_THREADS 3
#define N_ROUNDS 4 /* of the scheduler + runner plays */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "test_threads: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        kvt_status s_ = (call);                                                                    \
        if (s_ != KVT_OK)                                                                          \
            die("%s:%d: %s -> %s: %s", __FILE__, __LINE__, #call, kvt_status_name(s_),             \
                kvt_last_error());                                                                 \
    } while (0)

/* ------------------------------------------------------------------------------------------- */
/* The model, the context and the schedule                                                     */
/* ------------------------------------------------------------------------------------------- */

/* Layer 0: MLA-NoPE (salience), 1: GQA-RoPE with 2 KV heads (random eviction), 2: a sliding
 * window of 24 rows (policy none, pages returned behind the window). */
static kvt_model *make_model(void) {
    kvt_layer_spec s[N_LAYERS];
    CHECK_OK(kvt_layer_spec_mla(KVT_LAYER_MLA_NOPE, KVT_DTYPE_BF16, 128, 64, &s[0]));
    CHECK_OK(kvt_layer_spec_gqa(KVT_LAYER_GQA_ROPE, KVT_DTYPE_FP16, 2, 16, &s[1]));
    CHECK_OK(kvt_layer_spec_gqa(KVT_LAYER_SLIDING, KVT_DTYPE_FP16, 1, 16, &s[2]));
    s[2].sliding_window = 24;
    kvt_model *m;
    char err[256];
    if (kvt_model_create(s, N_LAYERS, "threads", &m, err, sizeof err) != KVT_OK)
        die("model: %s", err);
    return m;
}

static kvt_ctx *make_ctx(const kvt_model *m, uint32_t max_rows) {
    kvt_config c = kvt_config_default();
    c.block_rows = 64;
    c.kappa = 4;
    c.ratio = 8;
    c.evict_budget_rows = 32;
    c.recent_rows = 8;
    c.cadence_rows = 8;
    c.seed = 7;
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.config = &c;
    p.page_rows = 16;
    p.n_pages = 256;
    p.max_rows_per_seq = max_rows;
    kvt_ctx *ctx;
    char err[256];
    if (kvt_ctx_create(&p, &ctx, err, sizeof err) != KVT_OK)
        die("context: %s", err);
    return ctx;
}

/* New tokens of request i of the batch at step t: a prefill on the batch's first step, then
 * 1..3 tokens a step, and now and then a step that only attends (0 tokens). */
static uint32_t tokens_at(int t, int i) {
    if (t < N_BATCHES)
        return 40 + 7 * (uint32_t)i;
    if ((t + i) % 11 == 0)
        return 0;
    return 1 + (uint32_t)((t + 2 * i) % 3);
}

/* Layers whose run the step skips (their policy work is then left to the commit). */
static int skips_layer(int t, int layer) {
    return (layer == 0 && t % 7 == 3) || (layer == 1 && t % 5 == 2);
}

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes of one slot (all heads) of (request, layer, plane, position): values in [-1, 1) as
 * bf16 (MLA) or fp16-sized words whose top bits are clear (GQA; finite halves). */
static void row_bytes(uint64_t req, uint32_t layer, uint32_t plane, uint64_t pos, uint8_t *out,
                      size_t bytes) {
    for (size_t k = 0; k + 1 < bytes; k += 2) {
        uint64_t h = mix(req * 0x10001ull + layer * 977ull + plane * 131ull + pos * 7919ull + k);
        uint16_t v;
        if (layer == 0) {
            float f = (float)((double)(h >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
            uint32_t u;
            memcpy(&u, &f, sizeof u);
            v = (uint16_t)(u >> 16);
        } else {
            v = (uint16_t)(h & 0x3bff);
        }
        memcpy(out + k, &v, sizeof v);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* One play of the schedule                                                                    */
/* ------------------------------------------------------------------------------------------- */

/* What a step emitted: a hash of (lengths, slots) per layer, and which layers ran. */
typedef struct result {
    uint64_t hash[N_STEPS][N_LAYERS];
    uint8_t ran[N_STEPS][N_LAYERS];
    uint64_t rows[N_STEPS]; /* attended rows over the step's layers and requests */
} result;

/* A step prepared by the scheduler (reserve + plan) for a runner. */
typedef struct step {
    kvt_batch *b;
    kvt_seq *seqs[SEQS_PER_BATCH];
    uint64_t first_pos[SEQS_PER_BATCH]; /* committed length before the step */
    uint32_t n[SEQS_PER_BATCH];
    uint32_t topk[N_LAYERS], total[N_LAYERS];
} step;

typedef struct play {
    const kvt_model *m;
    kvt_ctx *ctx;
    kvt_batch *batch[N_BATCHES];
    kvt_seq *seqs[N_SEQS]; /* batch k holds seqs[k * SEQS_PER_BATCH ..] */
    step steps[N_STEPS];
    result *res;
    /* Hand-off between the scheduler and the runners. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int handed[N_STEPS], done[N_STEPS];
    int n_runners;
} play;

static void play_init(play *p, const kvt_model *m, uint32_t max_rows, result *res) {
    memset(p, 0, sizeof *p);
    p->m = m;
    p->ctx = make_ctx(m, max_rows);
    p->res = res;
    memset(res, 0, sizeof *res);
    for (int k = 0; k < N_BATCHES; k++)
        CHECK_OK(kvt_batch_create(p->ctx, SEQS_PER_BATCH, &p->batch[k]));
    for (int i = 0; i < N_SEQS; i++) {
        kvt_seq_params sp = kvt_seq_default_params();
        sp.request_id = 100 + (uint64_t)i;
        sp.prompt_rows = 20;
        CHECK_OK(kvt_seq_create(p->ctx, &sp, &p->seqs[i]));
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
}

static void play_fini(play *p) {
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    kvt_ctx_destroy(p->ctx); /* its batches and requests too */
}

/* Scheduler: reserve and plan step t on batch t % 2. */
static void prepare(play *p, int t) {
    step *s = &p->steps[t];
    int k = t % N_BATCHES;
    s->b = p->batch[k];
    for (int i = 0; i < SEQS_PER_BATCH; i++) {
        s->seqs[i] = p->seqs[k * SEQS_PER_BATCH + i];
        s->n[i] = tokens_at(t, i);
        s->first_pos[i] = kvt_seq_length(s->seqs[i]);
    }
    CHECK_OK(kvt_batch_reserve(s->b, s->seqs, s->n, SEQS_PER_BATCH));
    CHECK_OK(kvt_batch_plan(s->b));
    for (uint32_t l = 0; l < N_LAYERS; l++)
        CHECK_OK(kvt_batch_capacity(s->b, l, &s->topk[l], &s->total[l]));
}

static uint64_t hash_words(uint64_t h, const int32_t *w, size_t n) {
    for (size_t i = 0; i < n; i++)
        h = mix(h ^ (uint32_t)w[i]);
    return h;
}

/* Runner: write the step's rows (the engine's cache write) and run each layer, recording what it
 * emitted. Layer 0 emits FlashMLA's token layout, the others FlashInfer's CSR. */
static void run_step(play *p, int t) {
    const step *s = &p->steps[t];
    uint8_t buf[64 * 1024];
    for (int i = 0; i < SEQS_PER_BATCH; i++) {
        uint64_t req = 100 + (uint64_t)((t % N_BATCHES) * SEQS_PER_BATCH + i);
        for (uint32_t l = 0; l < N_LAYERS; l++) {
            const kvt_layer_spec *sp = kvt_model_layer(p->m, l);
            size_t slot = (size_t)sp->n_kv_heads * sp->row_bytes;
            if (s->n[i] * slot > sizeof buf)
                die("row buffer too small");
            for (uint32_t pl = 0; pl < sp->n_planes && s->n[i] > 0; pl++) {
                for (uint32_t j = 0; j < s->n[i]; j++)
                    row_bytes(req, l, pl, s->first_pos[i] + j, buf + j * slot, slot);
                CHECK_OK(kvt_seq_write(s->seqs[i], l, pl, 0, s->n[i], buf, s->n[i] * slot));
            }
        }
    }
    uint64_t rows = 0;
    for (uint32_t l = 0; l < N_LAYERS; l++) {
        if (skips_layer(t, (int)l))
            continue;
        kvt_emit e;
        memset(&e, 0, sizeof e);
        e.struct_size = sizeof e;
        int32_t lengths[SEQS_PER_BATCH], indptr[SEQS_PER_BATCH + 1];
        int32_t *idx;
        size_t n_idx;
        if (l == 0) {
            e.layout = KVT_EMIT_TOKENS;
            e.capacity = s->topk[l];
            n_idx = (size_t)SEQS_PER_BATCH * s->topk[l];
            e.lengths = lengths;
        } else {
            e.layout = KVT_EMIT_CSR;
            e.capacity = s->total[l];
            n_idx = s->total[l];
            e.indptr = indptr;
        }
        idx = malloc((n_idx ? n_idx : 1) * sizeof *idx);
        if (!idx)
            die("out of memory");
        e.indices = idx;
        CHECK_OK(kvt_batch_run(s->b, l, NULL, NULL, &e));
        uint64_t h = (uint64_t)l + 1;
        if (l == 0) {
            h = hash_words(h, lengths, SEQS_PER_BATCH);
            h = hash_words(h, idx, n_idx);
            for (int i = 0; i < SEQS_PER_BATCH; i++)
                rows += (uint64_t)lengths[i];
        } else {
            h = hash_words(h, indptr, SEQS_PER_BATCH + 1);
            h = hash_words(h, idx, (size_t)indptr[SEQS_PER_BATCH]);
            rows += (uint64_t)indptr[SEQS_PER_BATCH];
        }
        free(idx);
        p->res->hash[t][l] = h;
        p->res->ran[t][l] = 1;
    }
    p->res->rows[t] = rows;
}

/* Scheduler: commit step t and check every request of its batch. */
static void commit_check(play *p, int t) {
    const step *s = &p->steps[t];
    CHECK_OK(kvt_batch_commit(s->b, NULL));
    for (int i = 0; i < SEQS_PER_BATCH; i++) {
        CHECK_OK(kvt_seq_check(s->seqs[i]));
        if (kvt_seq_length(s->seqs[i]) != s->first_pos[i] + s->n[i])
            die("step %d: request %d holds %llu tokens, expected %llu", t, i,
                (unsigned long long)kvt_seq_length(s->seqs[i]),
                (unsigned long long)(s->first_pos[i] + s->n[i]));
    }
}

static void side_request(play *p, kvt_batch *side, int t);

/* The reference: one thread, in the scheduler's order (prepare t + 1 before commit t). */
static void play_serial(play *p) {
    kvt_batch *side;
    CHECK_OK(kvt_batch_create(p->ctx, 1, &side));
    prepare(p, 0);
    for (int t = 0; t < N_STEPS; t++) {
        if (t + 1 < N_STEPS)
            prepare(p, t + 1);
        if (t % 8 == 5)
            side_request(p, side, t);
        run_step(p, t);
        commit_check(p, t);
    }
    kvt_batch_destroy(side);
}

/* ---- Threads in the scheduler and runner roles -------------------------------------------- */

typedef struct runner_arg {
    play *p;
    int id; /* takes the steps t with t % n_runners == id */
} runner_arg;

static void *runner_main(void *arg) {
    runner_arg *r = arg;
    play *p = r->p;
    for (int t = r->id; t < N_STEPS; t += p->n_runners) {
        pthread_mutex_lock(&p->mu);
        while (!p->handed[t])
            pthread_cond_wait(&p->cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        run_step(p, t);
        pthread_mutex_lock(&p->mu);
        p->done[t] = 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static void hand(play *p, int t) {
    pthread_mutex_lock(&p->mu);
    p->handed[t] = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void wait_done(play *p, int t) {
    pthread_mutex_lock(&p->mu);
    while (!p->done[t])
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* A request of the scheduler's own, created, stepped and destroyed while runs are in flight (and
 * at the same point of the reference's order, so that the pool sees the same calls): the
 * context's request list and pool are the scheduler's, runs never touch them. */
static void side_request(play *p, kvt_batch *side, int t) {
    kvt_seq *q;
    kvt_seq_params sp = kvt_seq_default_params();
    sp.request_id = 1000 + (uint64_t)t;
    CHECK_OK(kvt_seq_create(p->ctx, &sp, &q));
    uint32_t n = 5;
    CHECK_OK(kvt_batch_reserve(side, &q, &n, 1));
    CHECK_OK(kvt_batch_commit(side, NULL)); /* no run: everything at commit */
    CHECK_OK(kvt_seq_check(q));
    kvt_seq_destroy(q);
}

/* The scheduler thread's loop. With one runner: prepare t + 1 while step t runs. With two:
 * steps t and t + 1 are both handed out before step t is committed. */
static void play_threads(play *p, int n_runners) {
    p->n_runners = n_runners;
    pthread_t th[N_BATCHES];
    runner_arg ra[N_BATCHES];
    for (int k = 0; k < n_runners; k++) {
        ra[k].p = p;
        ra[k].id = k;
        if (pthread_create(&th[k], NULL, runner_main, &ra[k]) != 0)
            die("pthread_create");
    }
    kvt_batch *side;
    CHECK_OK(kvt_batch_create(p->ctx, 1, &side));
    prepare(p, 0);
    hand(p, 0);
    for (int t = 0; t < N_STEPS; t++) {
        if (t + 1 < N_STEPS) {
            prepare(p, t + 1); /* overlaps the run of step t */
            if (n_runners > 1)
                hand(p, t + 1); /* the run of t + 1 overlaps the run of t */
        }
        if (t % 8 == 5)
            side_request(p, side, t);
        wait_done(p, t);
        if (n_runners == 1 && t + 1 < N_STEPS)
            hand(p, t + 1);
        commit_check(p, t); /* overlaps the run of step t + 1 */
    }
    for (int k = 0; k < n_runners; k++)
        pthread_join(th[k], NULL);
    kvt_batch_destroy(side);
}

static void compare(const result *ref, const result *got, const char *what) {
    for (int t = 0; t < N_STEPS; t++) {
        if (ref->rows[t] != got->rows[t])
            die("%s: step %d attends %llu rows, the reference %llu", what, t,
                (unsigned long long)got->rows[t], (unsigned long long)ref->rows[t]);
        for (int l = 0; l < N_LAYERS; l++)
            if (ref->ran[t][l] != got->ran[t][l] || ref->hash[t][l] != got->hash[t][l])
                die("%s: step %d layer %d emitted another attended set than the reference", what,
                    t, l);
    }
}

/* ---- Contexts of their own ----------------------------------------------------------------- */

typedef struct ctx_arg {
    const kvt_model *m;
    const result *ref;
    int id;
    result res;
} ctx_arg;

static void *context_main(void *arg) {
    ctx_arg *a = arg;
    play p;
    play_init(&p, a->m, 512, &a->res);
    play_serial(&p);
    /* kvt_last_error is the calling thread's: a failure here names this thread's layer, whatever
     * the other threads' calls wrote meanwhile. */
    uint32_t bad_layer = 100 + (uint32_t)a->id;
    kvt_row_state st;
    if (kvt_seq_row_state(p.seqs[0], bad_layer, 0, 0, &st, NULL) != KVT_ERR_OUT_OF_RANGE)
        die("context thread %d: row_state of layer %u did not fail", a->id, bad_layer);
    char want[64];
    snprintf(want, sizeof want, "layer %u of %u", bad_layer, N_LAYERS);
    for (int i = 0; i < 1000; i++)
        if (!strstr(kvt_last_error(), want))
            die("context thread %d: kvt_last_error is '%s', expected '%s'", a->id,
                kvt_last_error(), want);
    play_fini(&p);
    return NULL;
}

int main(void) {
    kvt_model *m = make_model();
    static result ref, got;

    /* Reference with a stated limit (steady state), and one that grows on demand: the same
     * decisions. */
    play p;
    play_init(&p, m, 512, &ref);
    play_serial(&p);
    play_fini(&p);
    play_init(&p, m, 0, &got);
    play_serial(&p);
    play_fini(&p);
    compare(&ref, &got, "serial, no stated limit");

    /* A few rounds: each meets other interleavings (cheap, also under TSan). */
    for (int round = 0; round < N_ROUNDS; round++) {
        play_init(&p, m, 512, &got);
        play_threads(&p, 1);
        play_fini(&p);
        compare(&ref, &got, "pipeline (scheduler + runner)");

        play_init(&p, m, 0, &got);
        play_threads(&p, 2);
        play_fini(&p);
        compare(&ref, &got, "two runners");
    }

    static ctx_arg ca[N_CONTEXT_THREADS];
    pthread_t th[N_CONTEXT_THREADS];
    for (int k = 0; k < N_CONTEXT_THREADS; k++) {
        ca[k].m = m;
        ca[k].ref = &ref;
        ca[k].id = k;
        if (pthread_create(&th[k], NULL, context_main, &ca[k]) != 0)
            die("pthread_create");
    }
    for (int k = 0; k < N_CONTEXT_THREADS; k++) {
        pthread_join(th[k], NULL);
        char what[64];
        snprintf(what, sizeof what, "context thread %d", k);
        compare(&ref, &ca[k].res, what);
    }

    uint64_t total = 0;
    for (int t = 0; t < N_STEPS; t++)
        total += ref.rows[t];
    printf("test_threads: %d steps x %d requests x %d layers: %d rounds of the pipeline and the "
           "two runners, and %d contexts on threads, equal the reference (%llu attended rows), "
           "kvt_seq_check clean after every step\n",
           N_STEPS, N_SEQS, N_LAYERS, N_ROUNDS, N_CONTEXT_THREADS, (unsigned long long)total);
    kvt_model_destroy(m);
    return 0;
}
