/*
 * run.c — full-cache references and the replay of a case through the real manager.
 *
 * Replay: one context with a model of one layer (the case's spec, so the policy table picks
 * salience tiering on MLA NoPE and random eviction on MLA RoPE and GQA-RoPE), ratio and B from
 * the run parameters. A GQA layer writes both planes and is measured per KV head (gqa.c). Rows
 * are committed in steps (kvt_batch_reserve / kvt_seq_write / kvt_batch_commit) of B rows on
 * salience layers, where chunking cannot change a block close, and r = c rows on eviction layers,
 * so rounds run at the cadence a decoder would see, up to each query's position. The step ending
 * at a query is planned and run: its emission (kvt_batch_run) is the attended set, once, after
 * the commit, it is checked against what the
 * library reports (check_attended); attention over it reads the rows from the pool through their
 * slots (kernels/attn.h) and is compared with attention over every row.
 *
 * Recall mode: the rows before the case's decode phase are committed in chunks, then each decode
 * step commits one row and runs the layer with that step's queries (kvt_batch_run's query
 * argument), so the trigger calibrates on the filler steps and meets the needle queries later;
 * each step's recall statistics are summed (recall_account), and the needle steps' emissions,
 * which hold exactly recall_last_fetched archived rows, are checked and measured as above.
 * With recall_adapt the decode queries' latents are accumulated after each decode step's commit
 * and, at the steps of ND_ADAPT_AT, the layer's basis is refitted to them between steps
 * (adapt_step); on a RoPE layer each KV head's key basis is refitted once, to the prompt's own
 * keys, before the first decode step (adapt_keys).
 */
#include "nd_internal.h"

#include "../../common/eigen.h"
#include "kvtier_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool near_edge(uint64_t pos, uint32_t B) {
    uint64_t u = pos % B;
    return u < ND_EDGE_ROWS || u >= (uint64_t)B - ND_EDGE_ROWS;
}

/* The block-edge counts of nd_result: attended rows in [sinks, closed) and those near an edge,
 * and the same over every row of [sinks, closed). */
static void edge_counts(const int64_t *pos_of_slot, const int32_t *slots, int32_t len, uint32_t B,
                        uint32_t sinks, uint64_t closed, nd_result *res) {
    for (int32_t j = 0; j < len; j++) {
        int64_t pos = pos_of_slot[slots[j]];
        if (pos < (int64_t)sinks || (uint64_t)pos >= closed)
            continue;
        res->kept_scored++;
        res->kept_edge += near_edge((uint64_t)pos, B);
    }
    for (uint64_t t = sinks; t < closed; t++) {
        res->scored_rows++;
        res->scored_edge += near_edge(t, B);
    }
}

nd_run_params nd_run_default_params(void) {
    nd_run_params p;
    memset(&p, 0, sizeof p);
    p.mode = ND_MODE_SALIENCE;
    const kvt_config lib = kvt_config_default(); /* the library's defaults, not copies */
    p.ratio = lib.ratio;
    p.block_rows = lib.block_rows;
    p.kappa = lib.kappa;
    p.sink_rows = lib.sink_rows;
    p.recent_rows = lib.recent_rows;
    p.seed = 1;
    p.scale = KVT_REF_ATTN_DEFAULT_SCALE;
    p.min_mass = 0.9;
    p.min_cos = 0.95;
    p.backend = KVT_BACKEND_CPU;
    p.batch = 1;
    p.request_base = 1;
    p.sigma_basis = lib.sigma_basis;
    p.recall = KVT_RECALL_CONFORMAL;
    p.recall_rank = 64;
    p.recall_basis = true;
    return p;
}

void nd_tally(const nd_result *r, size_t n, uint32_t *pass, uint32_t *counted, uint32_t *tail,
              uint32_t *band_miss) {
    uint32_t p = 0, c = 0, t = 0, b = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].status == ND_TAIL) {
            t++;
            continue;
        }
        if (r[i].status == ND_BAND_MISS) {
            b++;
            continue;
        }
        if (r[i].status == ND_INVALID)
            continue;
        c++;
        p += r[i].status == ND_PASS;
    }
    if (pass)
        *pass = p;
    if (counted)
        *counted = c;
    if (tail)
        *tail = t;
    if (band_miss)
        *band_miss = b;
}

uint32_t nd_count_status(const nd_result *r, size_t n, nd_status s) {
    uint32_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += r[i].status == s;
    return k;
}

/* Whether every targeted head's full-cache reference (output and needle mass) is finite. The
 * reference attention propagates non-finite values (kernels/attn.h): a NaN or Inf in any row
 * before the query, or in the query, makes the head's softmax maximum or its sums NaN / Inf. */
static bool ref_finite(const nd_ref *r, uint32_t n_heads, uint32_t value_dim) {
    for (uint32_t h = 0; h < n_heads; h++) {
        if (!isfinite(r->mass[h]))
            return false;
        for (uint32_t d = 0; d < value_dim; d++)
            if (!isfinite(r->out[(size_t)h * value_dim + d]))
                return false;
    }
    return true;
}

void nd_refs_free(nd_refs *r) {
    if (!r)
        return;
    if (r->t)
        for (uint32_t i = 0; i < r->n; i++)
            free(r->t[i].out);
    free(r->t);
    memset(r, 0, sizeof *r);
}

/* Compact copy of the targeted heads' queries: [n_heads][q_dim]. */
static void gather_q(const nd_case *c, const nd_target *tg, float *q) {
    for (uint32_t h = 0; h < tg->n_heads; h++)
        memcpy(q + (size_t)h * c->q_dim, tg->q + (size_t)tg->heads[h] * c->q_dim,
               sizeof(float) * c->q_dim);
}

int nd_refs_compute(const nd_case *c, double scale, nd_refs *out, void (*progress)(void *, double),
                    void *ud, char *err, size_t err_len) {
    memset(out, 0, sizeof *out);
    const kvt_layer_spec *sp = &c->spec;
    uint64_t max_pos = 0;
    for (uint32_t i = 0; i < c->n_targets; i++) {
        if (c->targets[i].position > c->n_rows)
            return nd_fail(err, err_len, ND_EARG, "target %u at position %llu past %llu rows", i,
                           (unsigned long long)c->targets[i].position,
                           (unsigned long long)c->n_rows);
        if (c->targets[i].position > max_pos)
            max_pos = c->targets[i].position;
        for (uint32_t h = 0; h < c->targets[i].n_heads; h++)
            if (c->targets[i].heads[h] >= c->n_q_heads)
                return nd_fail(err, err_len, ND_EARG, "target %u: head %u of %u", i,
                               c->targets[i].heads[h], c->n_q_heads);
    }
    if (max_pos > UINT32_MAX)
        return nd_fail(err, err_len, ND_EARG, "more than 2^32 rows");
    out->t = calloc(c->n_targets ? c->n_targets : 1, sizeof *out->t);
    out->n = c->n_targets;
    const bool gqa = nd_case_gqa(c);
    out->value_dim = gqa ? sp->head_dim : sp->value_dim;
    uint32_t H = 1;
    for (uint32_t i = 0; i < c->n_targets; i++)
        if (c->targets[i].n_heads > H)
            H = c->targets[i].n_heads;
    size_t sd = kvt_ref_attn_scratch_doubles((uint32_t)max_pos, H, sp->value_dim, sp->head_dim);
    double *scratch = malloc(sizeof(double) * sd);
    uint8_t *mark = malloc(max_pos + 1);
    float *q = malloc(sizeof(float) * H * c->q_dim);
    int rc = ND_OK;
    if (!out->t || !scratch || !mark || !q) {
        rc = nd_fail(err, err_len, ND_ENOMEM, "reference scratch");
        goto done;
    }
    for (uint32_t i = 0; i < c->n_targets; i++) {
        const nd_target *tg = &c->targets[i];
        const nd_needle *nd = &c->needles[tg->needle];
        nd_ref *r = &out->t[i];
        r->out = malloc(sizeof(float) * tg->n_heads * out->value_dim);
        if (!r->out) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "reference output");
            goto done;
        }
        uint32_t n = (uint32_t)tg->position;
        memset(mark, 0, n);
        for (uint64_t k = nd->first_row; k < nd->first_row + nd->n_rows && k < n; k++)
            mark[k] = 1;
        if (gqa) { /* every position in every KV head: mark_stride 0 */
            nd_gqa_attn_args g = {.spec = sp, .k = c->rows, .v = c->vrows, .n_rows = n,
                                  .q = tg->q, .n_q_heads = c->n_q_heads, .heads = tg->heads,
                                  .n_heads = tg->n_heads, .scale = scale, .mark = mark,
                                  .out = r->out, .mass = r->mass};
            if ((rc = nd_gqa_attn(&g)) != ND_OK) {
                rc = nd_fail(err, err_len, rc, "reference attention: out of memory");
                goto done;
            }
            if (progress)
                progress(ud, (double)(i + 1) / c->n_targets);
            continue;
        }
        gather_q(c, tg, q);
        kvt_ref_attn_args a;
        memset(&a, 0, sizeof a);
        a.base = c->rows;
        a.n_rows = n;
        a.slot_stride = sp->row_bytes;
        a.dtype = sp->dtype;
        a.key_dim = sp->head_dim;
        a.value_dim = sp->value_dim;
        a.q = q;
        a.n_heads = tg->n_heads;
        a.q_stride = c->q_dim;
        a.scale = scale;
        a.mark = mark;
        a.out = r->out;
        a.mark_mass = r->mass;
        a.scratch = scratch;
        if (kvt_ref_attn(&a) != KVT_OK) {
            rc = nd_fail(err, err_len, ND_EARG, "reference attention: bad arguments");
            goto done;
        }
        if (progress)
            progress(ud, (double)(i + 1) / c->n_targets);
    }
done:
    free(scratch), free(mark), free(q);
    if (rc != ND_OK)
        nd_refs_free(out);
    return rc;
}

static int lib_fail(char *err, size_t len, kvt_ctx *ctx, kvt_status s, const char *what) {
    return nd_fail(err, len, ND_ELIB, "%s: %s%s%s", what, kvt_strerror(s), ctx ? ": " : "",
                   ctx ? kvt_last_error() : "");
}

/* Recall on a RoPE layer: the fetched rows are copies in the request's fetch area, listed after
 * the held rows in archive order, with no slot a position lookup knows. They are identified by
 * content: every row of the case by a 64-bit hash of its bytes (sorted), each fetched slot's pool
 * bytes matched to an archived position (kvt_seq_row_state) whose row is byte-identical and not
 * listed yet. */
typedef struct nd_rowmap {
    uint64_t *key;     /* [n_rows][2]: hash, position; sorted */
    uint64_t n;
    uint8_t *arch;     /* [n_rows]: 1 where the position is archived at this query */
    uint32_t *used;    /* [n_rows]: stamp of the check that matched it */
} nd_rowmap;

static uint64_t row_hash(const uint8_t *b, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static int key_cmp(const void *x, const void *y) {
    const uint64_t *a = x, *b = y;
    return a[0] != b[0] ? (a[0] < b[0] ? -1 : 1) : (a[1] < b[1] ? -1 : a[1] > b[1]);
}

static int rowmap_build(const nd_case *c, nd_rowmap *m) {
    const size_t tb = nd_token_bytes(&c->spec);
    m->n = c->n_rows;
    m->key = malloc(sizeof(uint64_t) * 2 * (m->n + 1));
    m->arch = calloc(m->n + 1, 1);
    m->used = calloc(m->n + 1, sizeof(uint32_t));
    if (!m->key || !m->arch || !m->used)
        return ND_ENOMEM;
    for (uint64_t t = 0; t < m->n; t++) {
        m->key[2 * t] = row_hash(c->rows + t * tb, tb);
        m->key[2 * t + 1] = t;
    }
    qsort(m->key, m->n, 2 * sizeof(uint64_t), key_cmp);
    return ND_OK;
}

static void rowmap_free(nd_rowmap *m) {
    free(m->key), free(m->arch), free(m->used);
}

/* The archived position below P, not matched by this check yet (stamp), whose row equals b[0 ..
 * tb); -1 when none. */
static int64_t rowmap_match(const nd_case *c, nd_rowmap *m, const uint8_t *b, size_t tb,
                            uint64_t P, uint32_t stamp) {
    const uint64_t h = row_hash(b, tb);
    uint64_t lo = 0, hi = m->n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (m->key[2 * mid] < h)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (; lo < m->n && m->key[2 * lo] == h; lo++) {
        const uint64_t t = m->key[2 * lo + 1];
        if (t < P && m->arch[t] && m->used[t] != stamp && !memcmp(c->rows + t * tb, b, tb)) {
            m->used[t] = stamp;
            return (int64_t)t;
        }
    }
    return -1;
}

/* The attended set the library returned at query ti (position P), checked against what the
 * library reports about the same layer before anything is measured over it:
 *   - len == the layer's attended_rows (kvt_seq_layer_stats; per head on eviction layers, and an
 *     MLA layer has one head) == the number of positions [0, P) in state ATTENDED;
 *   - every slot is in the pool, appears once, holds an attended position (the slot ->
 *     position map built from kvt_seq_row_state), and positions ascend (kvt_batch_run's
 *     contract);
 *   - each slot's pool bytes equal the case's row of that position.
 * Fills pos_of_slot[n_slots] (-1: no attended position) for the caller. ND_ELIB with a message
 * on the first mismatch. With recall (fetched = the step's recall_last_fetched, or UINT64_MAX
 * without recall) the set also holds exactly `fetched` archived positions: len ==
 * attended_rows + fetched, and slots of archived positions are accepted (archived[slot] = 1 for
 * them; archived may be NULL without recall). With recall on a RoPE layer (rm non-NULL) the
 * last `fetched` entries are fetch slots in archive order, each checked to hold a distinct
 * archived position's row (nd_rowmap), the others as without recall. */
static int check_attended(const nd_case *c, const kvt_seq *seq, kvt_ctx *ctx, const uint8_t *pool,
                          const uint8_t *vpool, size_t pool_bytes, uint32_t head,
                          const int32_t *slots, int32_t len, uint64_t P,
                          const kvt_layer_stats *ls, uint32_t ti, uint32_t stamp,
                          int64_t *pos_of_slot, uint64_t n_slots, uint32_t *seen,
                          uint64_t fetched, uint8_t *archived, nd_rowmap *rm, char *err,
                          size_t err_len) {
    const bool recall = fetched != UINT64_MAX;
    const bool table = recall && !rm; /* archived rows at their block table's slot (salience) */
    int32_t *pages = NULL; /* recall: the block table */
    const uint32_t rb = c->spec.row_bytes;
    const size_t stride = nd_token_bytes(&c->spec), at = (size_t)head * rb;
#define ND_CHECK_FAIL(...)                                                                         \
    do {                                                                                           \
        char m_[384];                                                                              \
        snprintf(m_, sizeof m_, __VA_ARGS__);                                                      \
        free(pages);                                                                               \
        return nd_fail(err, err_len, ND_ELIB, "attended set check: query %u at position %llu: %s", \
                       ti, (unsigned long long)P, m_);                                             \
    } while (0)
    if (len < 0 || (uint64_t)len != ls->attended_rows + (recall ? fetched : 0))
        ND_CHECK_FAIL("kvt_attended_tokens returned %d rows, kvt_seq_layer_stats says "
                      "attended_rows = %llu (+ %llu fetched by recall)", (int)len,
                      (unsigned long long)ls->attended_rows,
                      (unsigned long long)(recall ? fetched : 0));
    for (uint64_t k = 0; k < n_slots; k++)
        pos_of_slot[k] = -1;
    if (archived)
        memset(archived, 0, n_slots);
    /* Archived rows have no slot in kvt_seq_row_state; on a salience layer they stay where they
     * were written (the archive is an index partition of the pool), at the block table's slot
     * of their position, which is checked against row_state's slot for every attended row. */
    uint32_t n_pages = 0;
    const uint32_t page_rows = 64; /* nd_run's cp.page_rows */
    if (table) {
        uint64_t nr = 0;
        uint32_t cap = (uint32_t)(P / page_rows + 2);
        pages = malloc(sizeof(int32_t) * cap);
        if (!pages)
            return nd_fail(err, err_len, ND_ENOMEM, "block table");
        kvt_status s = kvt_seq_block_table(seq, 0, pages, cap, &n_pages, &nr);
        if (s != KVT_OK) {
            free(pages);
            return lib_fail(err, err_len, ctx, s, "kvt_seq_block_table");
        }
    }
#define ND_TABLE_SLOT(pos)                                                                         \
    ((pos) / page_rows < n_pages ? pages[(pos) / page_rows] * (int32_t)page_rows +                 \
                                       (int32_t)((pos) % page_rows)                                \
                                 : -1)
    uint64_t n_state = 0;
    for (uint64_t pos = 0; pos < P; pos++) {
        kvt_row_state st;
        int32_t slot = -1;
        kvt_status s = kvt_seq_row_state(seq, 0, head, pos, &st, &slot);
        if (s != KVT_OK) {
            free(pages);
            return lib_fail(err, err_len, ctx, s, "kvt_seq_row_state");
        }
        if (st == KVT_ROW_PENDING)
            ND_CHECK_FAIL("position %llu is still pending", (unsigned long long)pos);
        if (rm)
            rm->arch[pos] = st == KVT_ROW_ARCHIVED;
        if (st != KVT_ROW_ATTENDED && !(table && st == KVT_ROW_ARCHIVED))
            continue;
        n_state += st == KVT_ROW_ATTENDED;
        if (table) {
            int32_t ts = ND_TABLE_SLOT(pos);
            if (st == KVT_ROW_ATTENDED && ts != slot) {
                ND_CHECK_FAIL("position %llu: kvt_seq_row_state says slot %d, the block table "
                              "%d", (unsigned long long)pos, (int)slot, (int)ts);
            }
            slot = ts;
        }
        if (slot < 0 || (uint64_t)slot >= n_slots)
            ND_CHECK_FAIL("kvt_seq_row_state puts position %llu at slot %d, outside the pool "
                          "(%llu slots)", (unsigned long long)pos, (int)slot,
                          (unsigned long long)n_slots);
        if (pos_of_slot[slot] >= 0)
            ND_CHECK_FAIL("kvt_seq_row_state puts positions %lld and %llu at the same slot %d",
                          (long long)pos_of_slot[slot], (unsigned long long)pos, (int)slot);
        pos_of_slot[slot] = (int64_t)pos;
        if (archived)
            archived[slot] = st == KVT_ROW_ARCHIVED;
    }
    if (n_state + (recall ? fetched : 0) != (uint64_t)len)
        ND_CHECK_FAIL("kvt_attended_tokens returned %d rows, kvt_seq_row_state has %llu "
                      "positions attended", (int)len, (unsigned long long)n_state);
    uint64_t n_arch = 0;
    int64_t prev = -1;
    const int32_t held = rm ? len - (int32_t)fetched : len; /* entries before the fetch slots */
    for (int32_t j = 0; j < len; j++) {
        int32_t slot = slots[j];
        if (slot < 0 || (uint64_t)slot >= n_slots)
            ND_CHECK_FAIL("entry %d: slot %d outside the pool (%llu slots)", (int)j, (int)slot,
                          (unsigned long long)n_slots);
        if (seen[slot] == stamp)
            ND_CHECK_FAIL("entry %d: slot %d appears twice", (int)j, (int)slot);
        seen[slot] = stamp;
        if (j >= held) { /* a fetch slot: which archived row does it hold? */
            if (pos_of_slot[slot] >= 0)
                ND_CHECK_FAIL("entry %d: fetch slot %d also holds attended position %lld", (int)j,
                              (int)slot, (long long)pos_of_slot[slot]);
            if ((size_t)slot * stride + at + rb > pool_bytes)
                ND_CHECK_FAIL("entry %d: fetch slot %d past the pool", (int)j, (int)slot);
            int64_t t = rowmap_match(c, rm, pool + (size_t)slot * stride, stride, P, stamp);
            if (t < 0)
                ND_CHECK_FAIL("entry %d: fetch slot %d holds no archived row's bytes (or one "
                              "listed twice)", (int)j, (int)slot);
            pos_of_slot[slot] = t;
            archived[slot] = 1;
            n_arch++;
            continue;
        }
        int64_t pos = pos_of_slot[slot];
        if (pos < 0)
            ND_CHECK_FAIL("entry %d: slot %d holds no attended position", (int)j, (int)slot);
        n_arch += archived && archived[slot];
        if (pos <= prev)
            ND_CHECK_FAIL("entry %d: position %lld after %lld (not ascending)", (int)j,
                          (long long)pos, (long long)prev);
        prev = pos;
        if ((size_t)slot * stride + at + rb > pool_bytes ||
            memcmp(pool + (size_t)slot * stride + at, c->rows + (size_t)pos * stride + at, rb) ||
            (vpool && memcmp(vpool + (size_t)slot * stride + at,
                             c->vrows + (size_t)pos * stride + at, rb)))
            ND_CHECK_FAIL("entry %d: slot %d holds position %lld (KV head %u) but its %u pool "
                          "bytes differ from that row", (int)j, (int)slot, (long long)pos, head,
                          rb);
    }
    if (recall && n_arch != fetched)
        ND_CHECK_FAIL("%llu archived positions in the set, recall_last_fetched says %llu",
                      (unsigned long long)n_arch, (unsigned long long)fetched);
#undef ND_CHECK_FAIL
#undef ND_TABLE_SLOT
    free(pages);
    return ND_OK;
}

/* After a decode step's commit: its recall statistics (every request) into st. */
static int recall_account(kvt_ctx *ctx, kvt_seq *const *seqs, uint32_t n, bool needle,
                          nd_recall_stats *st, char *err, size_t err_len) {
    for (uint32_t r = 0; r < n; r++) {
        kvt_layer_stats ls;
        memset(&ls, 0, sizeof ls);
        ls.struct_size = sizeof ls;
        kvt_status s = kvt_seq_layer_stats(seqs[r], 0, &ls);
        if (s != KVT_OK)
            return lib_fail(err, err_len, ctx, s, "kvt_seq_layer_stats");
        st->steps++;
        st->z = ls.recall_z;
        st->phase = ls.recall_phase;
        /* a calibration step: dense without overflow (a one-token step attends every row
         * otherwise only while the trigger calibrates) */
        const bool calib = ls.recall_last_dense && !ls.recall_last_overflow;
        if (!needle && calib) {
            st->calib_steps++;
            continue;
        }
        st->visited += ls.recall_last_visited;
        st->archived += ls.recall_last_archived;
        if (needle) {
            st->needle_steps++;
            st->needle_overflow += ls.recall_last_overflow;
            st->needle_dense += ls.recall_last_dense;
        } else {
            st->other_steps++;
            st->other_overflow += ls.recall_last_overflow;
            st->other_dense += ls.recall_last_dense;
            if (!ls.recall_last_dense) {
                st->other_fetched += ls.recall_last_fetched;
                st->other_archived += ls.recall_last_archived;
            }
        }
    }
    return ND_OK;
}

const uint32_t ND_ADAPT_AT[ND_ADAPT_N] = {8, 16, 32, 64};

/* recall_adapt's state: the decode latents' sums, the fitted basis, the refits so far. */
typedef struct nd_adapt {
    eig_acc acc;
    float *V;      /* [rank][value_dim] */
    uint32_t rank; /* the layer's basis rank */
    uint32_t refits;
} nd_adapt;

/* After decode step k's commit: its latents (every query head, once whatever the batch) into the
 * sums; when k + 1 queries seen is a step of ND_ADAPT_AT, the top-rank eigenvectors of their
 * centred covariance become the layer's basis (the first refit restarts z's calibration, the
 * later ones keep z: cert_study.py's candidate cs, bench/RESULTS.md "branch certify"). */
static int adapt_step(nd_adapt *a, kvt_ctx *ctx, const nd_case *c, uint64_t k,
                      nd_recall_stats *st, char *err, size_t err_len) {
    const size_t qn = (size_t)c->n_q_heads * c->q_dim;
    /* a non-finite latent would make the covariance NaN (and LAPACK's behaviour undefined) */
    for (uint32_t h = 0; h < c->n_q_heads; h++)
        for (uint32_t d = 0; d < a->acc.dim; d++)
            if (!isfinite(c->decode_q[k * qn + (size_t)h * c->q_dim + d]))
                return nd_fail(err, err_len, ND_EIO,
                               "recall_adapt: decode step %llu's query of head %u holds a NaN "
                               "or Inf in its latent; no basis can be fitted to it",
                               (unsigned long long)k, h);
    for (uint32_t h = 0; h < c->n_q_heads; h++)
        eig_acc_add(&a->acc, c->decode_q + k * qn + (size_t)h * c->q_dim);
    bool due = false;
    for (int i = 0; i < ND_ADAPT_N; i++)
        due |= k + 1 == ND_ADAPT_AT[i];
    if (!due)
        return ND_OK;
    char e2[512];
    int e = eig_top(&a->acc, a->rank, a->V, NULL, NULL, e2, sizeof e2);
    if (e != EIG_OK)
        return nd_fail(err, err_len, e == EIG_ENOMEM ? ND_ENOMEM : ND_ELIB,
                       "recall_adapt: the fit after decode step %llu: %s",
                       (unsigned long long)(k + 1), e2);
    kvt_status s = kvt_ctx_refit_recall_basis(ctx, 0, a->V, a->rank,
                                              a->refits ? KVT_REFIT_KEEP_Z : 0u, NULL);
    if (s != KVT_OK)
        return lib_fail(err, err_len, ctx, s, "kvt_ctx_refit_recall_basis");
    a->refits++;
    if (st)
        st->refits = a->refits;
    return ND_OK;
}

/* recall_adapt on a RoPE layer (GQA/MHA-RoPE, MLA-RoPE), once, between the prompt's last step and
 * the first decode step: each KV head with a key basis gets the top-rank eigenvectors of the
 * uncentred second moment of its own keys over the prompt (positions [0, decode_start), at most
 * ND_ADAPT_KEY_ROWS (65,536) of them evenly spaced; a row holding a NaN or Inf skipped) — what
 * kvtier-inspect calibrate fits from other traces, fitted on the request itself — through
 * kvt_ctx_refit_recall_head_basis (flags 0: the trigger has not calibrated yet). */
#define ND_ADAPT_KEY_ROWS 65536u

static int adapt_keys(kvt_ctx *ctx, const nd_case *c, nd_adapt *a, nd_recall_stats *st,
                      char *err, size_t err_len) {
    const kvt_layer_spec *sp = &c->spec;
    const uint32_t D = sp->kind == KVT_LAYER_MLA_ROPE ? sp->value_dim : sp->head_dim;
    const size_t tb = nd_token_bytes(sp);
    const uint64_t N = c->decode_start;
    const uint64_t step = N > ND_ADAPT_KEY_ROWS ? (N + ND_ADAPT_KEY_ROWS - 1) / ND_ADAPT_KEY_ROWS
                                                : 1;
    float *x = malloc(sizeof(float) * D), *V = malloc(sizeof(float) * KVT_RECALL_MAX_RANK * D);
    eig_acc acc = {0};
    int rc = x && V ? ND_OK : nd_fail(err, err_len, ND_ENOMEM, "recall_adapt: key fit scratch");
    for (uint32_t h = 0; rc == ND_OK && h < sp->n_kv_heads; h++) {
        uint32_t rank = 0;
        kvt_status s = kvt_ctx_recall_head_basis(ctx, 0, h, &rank, NULL);
        if (s != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_ctx_recall_head_basis");
            break;
        }
        if (rank == 0)
            continue;
        if (eig_acc_init(&acc, D, false) != EIG_OK) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "recall_adapt: key sums");
            break;
        }
        for (uint64_t p = 0; p < N; p += step) {
            const uint8_t *row = c->rows + p * tb + (size_t)h * sp->row_bytes;
            bool finite = true;
            for (uint32_t d = 0; d < D; d++)
                finite &= isfinite(x[d] = kvt_ref_load(row, sp->dtype, d)) != 0;
            if (finite)
                eig_acc_add(&acc, x);
        }
        char e2[512];
        int e = eig_top(&acc, rank, V, NULL, NULL, e2, sizeof e2);
        eig_acc_free(&acc);
        if (e != EIG_OK) {
            rc = nd_fail(err, err_len, e == EIG_ENOMEM ? ND_ENOMEM : ND_ELIB,
                         "recall_adapt: KV head %u's key fit: %s", h, e2);
            break;
        }
        if ((s = kvt_ctx_refit_recall_head_basis(ctx, 0, h, V, rank, 0, NULL)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_ctx_refit_recall_head_basis");
            break;
        }
        a->refits++;
    }
    if (st)
        st->refits = a->refits;
    free(x);
    free(V);
    return rc;
}

/* nd_run_params.snapshot_at: every request to a file, destroyed, restored from it. */
static int snapshot_drill(kvt_ctx *ctx, const nd_run_params *p, kvt_seq **seqs, uint32_t n,
                          char *err, size_t err_len) {
    char path[4096];
    for (uint32_t r = 0; r < n; r++) {
        snprintf(path, sizeof path, "%s/r%llu.kvts", p->snapshot_dir ? p->snapshot_dir : ".",
                 (unsigned long long)(p->request_base + r));
        kvt_status s = kvt_seq_snapshot_file(seqs[r], path);
        if (s != KVT_OK)
            return lib_fail(err, err_len, ctx, s, "kvt_seq_snapshot_file");
        kvt_seq_destroy(seqs[r]);
        seqs[r] = NULL;
        if ((s = kvt_seq_restore_file(ctx, path, &seqs[r])) != KVT_OK)
            return lib_fail(err, err_len, ctx, s, "kvt_seq_restore_file");
    }
    return 0;
}

int nd_run(const nd_case *c, const nd_refs *refs, const nd_run_params *p, nd_result *out,
           void (*progress)(void *, double), void *ud, char *err, size_t err_len) {
    if (p->mode == ND_MODE_PROMOTE)
        return nd_fail(err, err_len, ND_ENOTIMPL,
                       "mode '%s' is not implemented yet; nothing was measured",
                       nd_mode_name(p->mode));
    const bool recall = p->mode == ND_MODE_RECALL;
    if (recall && !c->decode_start)
        return nd_fail(err, err_len, ND_ENOTIMPL,
                       "mode 'recall' needs a decode phase: a query step for each of the "
                       "trace's last rows (two or more, step k at position rows - steps + k + "
                       "1); this case has none, so recall was not measured on it");
    if (recall && nd_case_gqa(c))
        return nd_fail(err, err_len, ND_EARG,
                       "mode 'recall' needs an MLA layer (NoPE: salience; RoPE: random eviction "
                       "with the archive)");
    if (recall && (p->recall == KVT_RECALL_OFF || p->recall_rank < 1 ||
                   p->recall_rank > KVT_RECALL_MAX_RANK))
        return nd_fail(err, err_len, ND_EARG, "recall: mode %d, sketch rank %u", (int)p->recall,
                       p->recall_rank);
    const bool adapt = recall && p->recall_adapt;
    if (adapt && !p->recall_basis)
        return nd_fail(err, err_len, ND_EARG, "recall_adapt needs a basis to start from (the "
                       "case's query subspace or a basis file), not recall without a basis");
    if (adapt && !eig_have_lapacke())
        return nd_fail(err, err_len, ND_ENOTIMPL,
                       "recall_adapt: built without LAPACKE, which the eigenvectors need "
                       "(install Debian's liblapacke-dev, scripts/deps.sh, and reconfigure); "
                       "recall was not measured");
    if (p->recall_stats)
        memset(p->recall_stats, 0, sizeof *p->recall_stats);
    if ((unsigned)p->mode >= ND_MODE_COUNT)
        return nd_fail(err, err_len, ND_EARG, "unknown mode");
    if (!refs || refs->n != c->n_targets)
        return nd_fail(err, err_len, ND_EARG, "references do not match the case");
    if (p->ratio < 1)
        return nd_fail(err, err_len, ND_EARG, "ratio must be >= 1");
    if (p->batch < 1 || p->batch > ND_MAX_BATCH)
        return nd_fail(err, err_len, ND_EARG, "batch %u not in 1..%u", p->batch, ND_MAX_BATCH);
    const uint32_t NB = p->batch;
    const kvt_layer_spec *sp = &c->spec;
    const bool gqa = nd_case_gqa(c);
    char e2[512];
    if (gqa) {
        if (nd_gqa_layout_check(sp, c->n_q_heads, c->q_dim, e2, sizeof e2) != 0 || !c->vrows)
            return nd_fail(err, err_len, ND_EARG, "case layer: %s", c->vrows ? e2 : "no V rows");
    } else if (sp->n_kv_heads != 1 || sp->n_planes != 1 ||
               (sp->kind != KVT_LAYER_MLA_NOPE && sp->kind != KVT_LAYER_MLA_ROPE)) {
        return nd_fail(err, err_len, ND_EARG, "the case is not one MLA layer (1 head, 1 plane)");
    } else if (nd_spec_layout_check(sp, e2, sizeof e2) != 0) {
        return nd_fail(err, err_len, ND_EARG, "case layer: %s", e2);
    }
    const bool rope = sp->kind != KVT_LAYER_MLA_NOPE;
    const bool dense = p->mode == ND_MODE_DENSE;
    kvt_model *model = NULL;
    kvt_ctx *ctx = NULL;
    kvt_seq *seqs[ND_MAX_BATCH] = {0};
    int32_t lens[ND_MAX_BATCH] = {0};
    uint32_t ntok[ND_MAX_BATCH];
    kvt_batch *batch = NULL;
    uint8_t *pool_copy = NULL, *vpool_copy = NULL;
    int32_t *slots = NULL;
    kvt_buffer *em_idx = NULL, *em_len = NULL; /* freed with the context */
    uint8_t *mark = NULL;
    int64_t *pos_of_slot = NULL;
    uint32_t *seen = NULL;
    double *scratch = NULL;
    float *q = NULL, *o = NULL;
    float *qhost = NULL;                          /* recall: the step's queries, every request */
    kvt_buffer *q_buf = NULL, *d_buf = NULL;      /* their backend copies (not the CPU backend) */
    uint8_t dense_of[ND_MAX_BATCH] = {0};
    uint8_t *archived = NULL;
    nd_rowmap rmap = {0}; /* recall on RoPE: fetched rows identified by content */
    nd_adapt ad = {0};    /* recall_adapt */
    bool keys_fitted = false; /* recall_adapt on a RoPE layer: adapt_keys ran */
    const size_t qn = (size_t)c->n_q_heads * c->q_dim;
    int rc = ND_OK;
    kvt_status s = kvt_model_create(sp, 1, "kvtier-needle", &model, e2, sizeof e2);
    if (s != KVT_OK)
        return nd_fail(err, err_len, ND_ELIB, "model: %s", e2);

    kvt_ctx_params cp = kvt_ctx_default_params();
    kvt_config cp_cfg = kvt_config_default();
    cp.config = &cp_cfg;
    cp.model = model;
    cp.backend = p->backend;
    cp.archive_space = p->archive_space;
    cp.page_rows = 64;
    /* recall on RoPE: a fetch area of as many rows as the request holds (kvt_seq_pages_needed) */
    cp.n_pages = (uint32_t)(((c->n_rows + 63) / 64 + 4) * NB * (recall && rope ? 2 : 1));
    kvt_config *cfg = &cp_cfg;
    cfg->ratio = dense ? 1 : p->ratio;
    cfg->block_rows = p->block_rows;
    cfg->kappa = p->kappa;
    cfg->sink_rows = p->sink_rows;
    cfg->seed = p->seed;
    cfg->selector = p->mode == ND_MODE_RANDOM ? KVT_SELECT_RANDOM : KVT_SELECT_SIGMA;
    cfg->sigma_basis = p->sigma_basis;
    cfg->salience_budget = p->salience_budget;
    if (p->budget_min_kept)
        cfg->budget_min_kept = p->budget_min_kept;
    cfg->recent_rows = p->recent_rows;
    cfg->cadence_rows = 0;
    cfg->protect_prompt = true;
    if (recall) {
        cfg->recall = p->recall;
        if (p->recall_cap_rows)
            cfg->recall_cap_rows = p->recall_cap_rows;
        cp.recall_sketch_rank = p->recall_rank;
        if (p->recall_scan_bits)
            cp.recall_scan_bits = p->recall_scan_bits;
        cfg->evict_archive = rope; /* what a RoPE layer's recall brings back */
    }
    /* Eviction budget at this ratio: K = context / ratio rows (kvt_model_census's convention),
     * at least the recent window (kvt_config_check wants K >= r: a short context at a high
     * ratio keeps r + r rows). */
    uint64_t K = (c->n_rows + p->ratio / 2) / p->ratio;
    if (K < cfg->recent_rows)
        K = cfg->recent_rows;
    cfg->evict_budget_rows = (uint32_t)(K < 1 ? 1 : K);
    kvt_policy pol = KVT_POLICY_NONE;
    if (dense && rope)
        cp.layer_policies = &pol; /* everything attended */
    s = kvt_ctx_create(&cp, &ctx, e2, sizeof e2);
    if (s != KVT_OK) {
        rc = nd_fail(err, err_len, ND_ELIB, "kvt_ctx_create: %s: %s", kvt_strerror(s), e2);
        goto done;
    }
    const kvt_policy policy = kvt_ctx_layer_policy(ctx, 0);
    /* The basis: the query subspace's first min(rank, sketch rank) rows (its directions carry
     * equal variance, so any of them are top eigenvectors of the filler queries' covariance). */
    if (recall && p->recall_basis_file &&
        (s = rope ? kvt_ctx_load_recall_head_basis(ctx, 0, 0, p->recall_basis_file)
                  : kvt_ctx_load_recall_basis(ctx, 0, p->recall_basis_file)) != KVT_OK) {
        rc = lib_fail(err, err_len, ctx, s,
                      rope ? "kvt_ctx_load_recall_head_basis" : "kvt_ctx_load_recall_basis");
        goto done;
    }
    if (recall && p->recall_basis && !p->recall_basis_file && !c->qbasis) {
        rc = nd_fail(err, err_len, ND_ENOTIMPL, "recall: the case has no query subspace to use "
                     "as the basis (a trace): give a basis file (kvtier-inspect calibrate) or "
                     "--recall-basis none; recall was not measured on it");
        goto done;
    }
    const uint32_t qrank = c->qbasis_rank < p->recall_rank ? c->qbasis_rank : p->recall_rank;
    if (recall && p->recall_basis && !p->recall_basis_file && c->qbasis &&
        (s = rope ? kvt_ctx_set_recall_head_basis(ctx, 0, 0, c->qbasis, qrank)
                  : kvt_ctx_set_recall_basis(ctx, 0, c->qbasis, qrank)) != KVT_OK) {
        rc = lib_fail(err, err_len, ctx, s, "kvt_ctx_set_recall_basis");
        goto done;
    }
    if (adapt && !rope) { /* (a RoPE layer's key bases: adapt_keys, at the decode phase) */
        if ((s = kvt_ctx_recall_basis(ctx, 0, &ad.rank, NULL)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_ctx_recall_basis");
            goto done;
        }
        if (eig_acc_init(&ad.acc, sp->value_dim, true) != EIG_OK ||
            !(ad.V = malloc(sizeof(float) * ad.rank * sp->value_dim))) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "recall_adapt scratch");
            goto done;
        }
    }
    for (uint32_t r = 0; r < NB; r++) {
        kvt_seq_params sprm = kvt_seq_default_params();
        sprm.request_id = p->request_base + r;
        sprm.prompt_rows = c->prompt_rows;
        s = kvt_seq_create(ctx, &sprm, &seqs[r]);
        if (s != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_seq_create");
            goto done;
        }
    }
    if ((s = kvt_batch_create(ctx, NB, &batch)) != KVT_OK) {
        rc = lib_fail(err, err_len, ctx, s, "kvt_batch_create");
        goto done;
    }
    const uint32_t chunk = policy == KVT_POLICY_EVICT ? (p->recent_rows ? p->recent_rows : 64)
                                                      : p->block_rows;
    uint32_t H = 1;
    for (uint32_t i = 0; i < c->n_targets; i++)
        if (c->targets[i].n_heads > H)
            H = c->targets[i].n_heads;
    const uint32_t V = gqa ? sp->head_dim : sp->value_dim;
    const uint32_t n_kv = gqa ? sp->n_kv_heads : 1;
    const size_t tb = nd_token_bytes(sp);
    uint32_t stamp = 0;
    size_t sd = kvt_ref_attn_scratch_doubles((uint32_t)c->n_rows, H, V, sp->head_dim);
    slots = malloc(sizeof(int32_t) * (c->n_rows + 1) * NB);
    mark = malloc((c->n_rows + 1) * n_kv);
    scratch = malloc(sizeof(double) * sd);
    q = malloc(sizeof(float) * H * c->q_dim);
    o = malloc(sizeof(float) * H * V);
    void *pool_base = NULL;
    size_t pool_bytes = 0;
    if ((s = kvt_layer_data(ctx, 0, 0, &pool_base, &pool_bytes)) != KVT_OK) {
        rc = lib_fail(err, err_len, ctx, s, "kvt_layer_data");
        goto done;
    }
    const uint64_t n_slots = pool_bytes / ((size_t)sp->n_kv_heads * sp->row_bytes);
    /* The pool is in the backend's memory space (on the guarded or a device backend the host may
     * not dereference kvt_layer_data's pointer): each query reads it into this host copy through
     * kvt_layer_read and measures over the copy. */
    pool_copy = malloc(pool_bytes ? pool_bytes : 1);
    if (gqa)
        vpool_copy = malloc(pool_bytes ? pool_bytes : 1);
    /* The emission lives in the backend's memory space too: on any backend but the CPU one it
     * goes into kvt_buffer memory and is read back after each query's run. */
    if (strcmp(kvt_ctx_backend_name(ctx), "cpu") != 0) {
        if ((s = kvt_buffer_alloc(ctx, sizeof(int32_t) * (c->n_rows + 1) * NB, &em_idx)) !=
                KVT_OK ||
            (s = kvt_buffer_alloc(ctx, sizeof(int32_t) * NB, &em_len)) != KVT_OK ||
            (s = kvt_buffer_alloc(ctx, NB, &d_buf)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_buffer_alloc (emission)");
            goto done;
        }
    }
    if (recall) {
        qhost = malloc(sizeof(float) * qn * NB);
        archived = malloc(n_slots + 1);
        if (em_idx && (s = kvt_buffer_alloc(ctx, sizeof(float) * qn * NB, &q_buf)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_buffer_alloc (recall queries)");
            goto done;
        }
        if (!qhost || !archived) {
            rc = nd_fail(err, err_len, ND_ENOMEM, "recall scratch");
            goto done;
        }
    }
    if (recall && rope && (rc = rowmap_build(c, &rmap)) != ND_OK) {
        rc = nd_fail(err, err_len, rc, "row map");
        goto done;
    }
    pos_of_slot = malloc(sizeof(int64_t) * (n_slots + 1));
    seen = calloc(n_slots + 1, sizeof(uint32_t));
    if (!slots || !mark || !scratch || !q || !o || !pos_of_slot || !seen || !pool_copy ||
        (gqa && !vpool_copy)) {
        rc = nd_fail(err, err_len, ND_ENOMEM, "replay scratch");
        goto done;
    }
    uint64_t committed = 0, steps = 0;
    for (uint32_t ti = 0; ti < c->n_targets; ti++) {
        const nd_target *tg = &c->targets[ti];
        const nd_needle *nd = &c->needles[tg->needle];
        const uint64_t P = tg->position;
        if (P < committed || P > c->n_rows) {
            rc = nd_fail(err, err_len, ND_EARG, "targets not sorted by position");
            goto done;
        }
        /* The replay is an engine's step loop (kvtier.h's timeline): each chunk is a step —
         * reserve, write the rows, commit. The step that ends at the query position P is
         * planned and run, and its emission (the rows of the step included: positions < P) is
         * the attended set the query sees. Two queries at the same position: a step of no new
         * token emits it. */
        bool emitted = false;
        uint32_t topk = 0;
        while (!emitted) {
            if (adapt && rope && !keys_fitted && committed == c->decode_start) {
                if ((rc = adapt_keys(ctx, c, &ad, p->recall_stats, err, err_len)) != ND_OK)
                    goto done;
                keys_fitted = true;
            }
            uint64_t n64 = P - committed;
            /* Recall: the prompt (rows before the decode phase) in chunks, then one row per
             * decode step, each run with its step's queries. */
            const bool dec = recall && committed >= c->decode_start;
            if (recall && !dec && c->decode_start - committed < n64)
                n64 = c->decode_start - committed;
            if (dec)
                n64 = 1;
            /* align salience chunks to blocks so every commit closes at most one block */
            uint32_t n = (uint32_t)(n64 < chunk ? n64 : chunk);
            for (uint32_t r = 0; r < NB; r++)
                ntok[r] = n;
            if ((s = kvt_batch_reserve(batch, seqs, ntok, NB)) != KVT_OK) {
                rc = lib_fail(err, err_len, ctx, s, "kvt_batch_reserve");
                goto done;
            }
            for (uint32_t r = 0; n > 0 && r < NB; r++) {
                s = kvt_seq_write(seqs[r], 0, 0, 0, n, c->rows + committed * tb, (size_t)n * tb);
                if (s == KVT_OK && gqa)
                    s = kvt_seq_write(seqs[r], 0, 1, 0, n, c->vrows + committed * tb,
                                      (size_t)n * tb);
                if (s != KVT_OK) {
                    rc = lib_fail(err, err_len, ctx, s, "kvt_seq_write");
                    goto done;
                }
            }
            const uint64_t k_dec = committed - c->decode_start; /* decode step (dec only) */
            if (dec && k_dec >= c->n_decode) {
                rc = nd_fail(err, err_len, ND_EARG, "target %u past the decode phase", ti);
                goto done;
            }
            if (committed + n == P || dec) {
                if ((s = kvt_batch_plan(batch)) != KVT_OK ||
                    (s = kvt_batch_capacity(batch, 0, &topk, NULL)) != KVT_OK) {
                    rc = lib_fail(err, err_len, ctx, s, "kvt_batch_plan");
                    goto done;
                }
                if (topk > P) {
                    rc = nd_fail(err, err_len, ND_ELIB, "attended set check: query %u at "
                                 "position %llu: kvt_batch_capacity says %u rows, more than "
                                 "exist", ti, (unsigned long long)P, topk);
                    goto done;
                }
                kvt_emit em = {.struct_size = sizeof em, .layout = KVT_EMIT_TOKENS,
                               .indices = em_idx ? kvt_buffer_ptr(em_idx) : slots,
                               .capacity = topk,
                               .lengths = em_len ? kvt_buffer_ptr(em_len) : lens,
                               .dense = d_buf ? kvt_buffer_ptr(d_buf) : dense_of};
                const float *qrun = tg->q;
                if (dec) {
                    for (uint32_t r = 0; r < NB; r++)
                        memcpy(qhost + (size_t)r * qn, c->decode_q + k_dec * qn,
                               sizeof(float) * qn);
                    qrun = qhost;
                    if (q_buf) {
                        if ((s = kvt_buffer_write(q_buf, 0, qhost, sizeof(float) * qn * NB)) !=
                            KVT_OK) {
                            rc = lib_fail(err, err_len, ctx, s, "kvt_buffer_write (queries)");
                            goto done;
                        }
                        qrun = kvt_buffer_ptr(q_buf);
                    }
                }
                if ((s = kvt_batch_run(batch, 0, qrun, NULL, &em)) != KVT_OK ||
                    (d_buf && (s = kvt_buffer_read(d_buf, 0, dense_of, NB)) != KVT_OK) ||
                    (em_idx && (s = kvt_buffer_read(em_idx, 0, slots,
                                                    sizeof(int32_t) * topk * NB)) != KVT_OK) ||
                    (em_len && (s = kvt_buffer_read(em_len, 0, lens, sizeof(int32_t) * NB)) !=
                                   KVT_OK)) {
                    rc = lib_fail(err, err_len, ctx, s, "kvt_batch_run");
                    goto done;
                }
                emitted = committed + n == P;
            }
            if ((s = kvt_batch_commit(batch, NULL)) != KVT_OK) {
                rc = lib_fail(err, err_len, ctx, s, "kvt_batch_commit");
                goto done;
            }
            committed += n;
            if (dec && p->recall_stats &&
                (rc = recall_account(ctx, seqs, NB, c->decode_target[k_dec] >= 0,
                                     p->recall_stats, err, err_len)) != ND_OK)
                goto done;
            if (dec && adapt && !rope &&
                (rc = adapt_step(&ad, ctx, c, k_dec, p->recall_stats, err, err_len)) != ND_OK)
                goto done;
            if (++steps == p->snapshot_at && (rc = snapshot_drill(ctx, p, seqs, NB, err,
                                                                    err_len)) != 0)
                goto done;
            if (progress)
                progress(ud, 0.9 * (double)committed / (double)c->n_rows);
        }
        /* The pool once per query: every request's slots index it. */
        if ((s = kvt_layer_read(ctx, 0, 0, 0, n_slots, pool_copy, pool_bytes)) != KVT_OK ||
            (gqa && (s = kvt_layer_read(ctx, 0, 1, 0, n_slots, vpool_copy, pool_bytes)) !=
                        KVT_OK)) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_layer_read");
            goto done;
        }
        for (uint32_t r = 0; r < NB; r++) {
        kvt_seq *seq = seqs[r];
        int32_t *rslots = slots + (size_t)r * topk;
        int32_t len = lens[r];
        /* Between steps: the committed state the emission must describe. */
        if ((s = kvt_seq_check(seq)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_seq_check");
            goto done;
        }
        kvt_layer_stats ls;
        memset(&ls, 0, sizeof ls);
        ls.struct_size = sizeof ls;
        if ((s = kvt_seq_layer_stats(seq, 0, &ls)) != KVT_OK) {
            rc = lib_fail(err, err_len, ctx, s, "kvt_seq_layer_stats");
            goto done;
        }
        void *base = pool_copy;
        size_t bytes = pool_bytes;
        if (p->tamper)
            p->tamper(p->tamper_ud, base, bytes, rslots, &len);
        /* Needle rows in the attended set, by the positions their slots hold: per KV head on a
         * GQA layer (random eviction keeps different positions in each head at the same slots;
         * the fewest any head keeps is reported). */
        uint32_t n_att = UINT32_MAX;
        const uint64_t nd_end = nd->first_row + nd->n_rows;
        uint32_t n_fetched_needle = 0; /* needle rows in the set that are archived (recall) */
        for (uint32_t g = 0; g < n_kv; g++) {
            rc = check_attended(c, seq, ctx, base, vpool_copy, bytes, g, rslots, len, P, &ls, ti,
                                ++stamp, pos_of_slot, n_slots, seen,
                                recall ? ls.recall_last_fetched : UINT64_MAX, archived,
                                recall && rope ? &rmap : NULL, err, err_len);
            if (rc != ND_OK)
                goto done;
            uint32_t k = 0;
            for (int32_t j = 0; j < len; j++) {
                int64_t pos = pos_of_slot[rslots[j]];
                uint8_t m = (uint64_t)pos >= nd->first_row && (uint64_t)pos < nd_end;
                mark[(size_t)g * (size_t)len + (size_t)j] = m;
                k += m;
                n_fetched_needle += m && archived && archived[rslots[j]];
            }
            if (k < n_att)
                n_att = k;
        }
        /* Rows attended without ever being scored: the unclosed tail (salience); on eviction
         * layers every row before the first round, then the newest attended_rows - K (the r
         * recent rows of the last round plus the rows committed since). */
        uint64_t unscored = 0;
        if (policy == KVT_POLICY_SALIENCE)
            unscored = ls.tail_rows;
        else if (policy == KVT_POLICY_EVICT)
            unscored = ls.rounds == 0 ? ls.attended_rows
                       : ls.attended_rows > cfg->evict_budget_rows
                           ? ls.attended_rows - cfg->evict_budget_rows
                           : 0;
        uint64_t scored_end = P;
        if (policy == KVT_POLICY_SALIENCE)
            scored_end = ls.closed_rows;
        else if (policy == KVT_POLICY_EVICT)
            scored_end = P - (unscored < P ? unscored : P);
        /* (Partly) in the unscored rows, or not even written yet: reported, not counted. */
        const bool in_tail = nd_end > scored_end;
        double mass[ND_MAX_HEADS];
        if (gqa) {
            nd_gqa_attn_args g = {.spec = sp, .k = base, .v = vpool_copy, .slots = rslots,
                                  .n_rows = (uint32_t)len, .q = tg->q,
                                  .n_q_heads = c->n_q_heads, .heads = tg->heads,
                                  .n_heads = tg->n_heads, .scale = p->scale, .mark = mark,
                                  .mark_stride = (size_t)len, .out = o, .mass = mass};
            if ((rc = nd_gqa_attn(&g)) != ND_OK) {
                rc = nd_fail(err, err_len, rc, "attention over the attended set: out of memory");
                goto done;
            }
        } else {
        gather_q(c, tg, q);
        kvt_ref_attn_args a;
        memset(&a, 0, sizeof a);
        a.base = base;
        a.slots = rslots;
        a.n_rows = (uint32_t)len;
        a.slot_stride = sp->row_bytes;
        a.dtype = sp->dtype;
        a.key_dim = sp->head_dim;
        a.value_dim = V;
        a.q = q;
        a.n_heads = tg->n_heads;
        a.q_stride = c->q_dim;
        a.scale = p->scale;
        a.mark = mark;
        a.out = o;
        a.mark_mass = mass;
        a.scratch = scratch;
        if (kvt_ref_attn(&a) != KVT_OK) {
            rc = nd_fail(err, err_len, ND_EARG, "attention over the attended set: bad arguments");
            goto done;
        }
        } /* MLA */
        const nd_ref *ref = &refs->t[ti];
        nd_result *res = &out[(size_t)r * c->n_targets + ti];
        memset(res, 0, sizeof *res);
        res->request = p->request_base + r;
        res->target = ti;
        res->needle = tg->needle;
        res->position = P;
        res->first_row = nd->first_row;
        res->n_rows = nd->n_rows;
        res->depth = nd->depth;
        res->salience = nd->salience;
        res->mass_ratio = INFINITY;
        res->out_cos = INFINITY;
        res->full_mass = INFINITY;
        res->out_rel_err = 0;
        for (uint32_t h = 0; h < tg->n_heads; h++) {
            const float *x = o + (size_t)h * V, *y = ref->out + (size_t)h * V;
            double xy = 0, xx = 0, yy = 0, dd = 0;
            for (uint32_t d = 0; d < V; d++) {
                xy += (double)x[d] * y[d];
                xx += (double)x[d] * x[d];
                yy += (double)y[d] * y[d];
                dd += ((double)x[d] - y[d]) * ((double)x[d] - y[d]);
            }
            double cosv = xx > 0 && yy > 0 ? xy / sqrt(xx * yy) : 0.0;
            double rel = yy > 0 ? sqrt(dd / yy) : INFINITY;
            double mr = ref->mass[h] > 0 ? mass[h] / ref->mass[h] : 0.0;
            if (mr < res->mass_ratio)
                res->mass_ratio = mr;
            if (cosv < res->out_cos)
                res->out_cos = cosv;
            if (rel > res->out_rel_err)
                res->out_rel_err = rel;
            if (ref->mass[h] < res->full_mass)
                res->full_mass = ref->mass[h];
        }
        res->needle_rows_attended = n_att;
        res->policy = policy;
        res->attended_rows = (uint64_t)len;
        res->archived_rows = ls.archived_rows;
        res->dropped_rows = ls.dropped_rows;
        res->fetched_rows = recall ? ls.recall_last_fetched : 0;
        if (recall) {
            res->recall_visited = ls.recall_last_visited;
            res->recall_archived = ls.recall_last_archived;
            res->recall_overflow = ls.recall_last_overflow;
            res->recall_dense = dense_of[r] != 0;
            res->recall_z = ls.recall_z;
        }
        res->closed_rows = ls.closed_rows;
        res->tail_rows = unscored;
        res->kept_rows = ls.kept_rows;
        res->sink_rows = ls.sink_rows;
        if (policy == KVT_POLICY_SALIENCE)
            res->m_rows = ls.closed_rows ? (ls.closed_rows + cfg->ratio / 2) / cfg->ratio : 0;
        else if (policy == KVT_POLICY_EVICT)
            res->m_rows = cfg->evict_budget_rows;
        else
            res->m_rows = committed;
        if (res->m_rows == 0 && ls.closed_rows)
            res->m_rows = 1;
        if (policy == KVT_POLICY_SALIENCE && cfg->salience_budget)
            res->m_rows = ls.kept_rows; /* budget mode: m as the last close set it */
        res->budget = cfg->salience_budget;
        res->eff_ratio = ls.effective_ratio;
        res->read_bytes_per_token = ls.attended_bytes_per_token;
        if (policy == KVT_POLICY_SALIENCE)
            edge_counts(pos_of_slot, rslots, len, cfg->block_rows, cfg->sink_rows,
                        ls.closed_rows, res);
        bool pass = res->mass_ratio >= p->min_mass && res->out_cos >= p->min_cos;
        res->status = in_tail ? ND_TAIL : nd->band_miss ? ND_BAND_MISS : pass ? ND_PASS : ND_FAIL;
        if (recall && res->status == ND_PASS)
            res->pass_by = dense_of[r] ? 'd' : n_fetched_needle ? 'f' : 'k';
        /* A non-finite reference leaves nothing to measure against: the ratio and cosine above
         * come out 0 (a NaN compares false) or NaN, and a 0 reads as a lost needle ("fail").
         * Report the query as invalid instead, whatever else holds (a tail or band-miss label
         * would suggest the query was measurable), and blank the metrics so no one averages
         * them. */
        if (!ref_finite(ref, tg->n_heads, V)) {
            res->status = ND_INVALID;
            res->mass_ratio = NAN;
            res->out_cos = NAN;
            res->out_rel_err = NAN;
            res->full_mass = NAN;
        }
        } /* requests */
    }
    if (progress)
        progress(ud, 1.0);
done:
    kvt_batch_destroy(batch);
    free(slots), free(mark), free(scratch), free(q), free(o), free(pos_of_slot), free(seen);
    free(pool_copy), free(vpool_copy), free(qhost), free(archived);
    rowmap_free(&rmap);
    eig_acc_free(&ad.acc);
    free(ad.V);
    for (uint32_t r = 0; r < ND_MAX_BATCH; r++)
        kvt_seq_destroy(seqs[r]);
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(model);
    return rc;
}
