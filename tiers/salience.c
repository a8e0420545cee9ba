/*
 * salience.c — the attended tier / archive split of an MLA-NoPE layer (DESIGN §2.1).
 *
 * Rows arrive one decode step at a time into the unclosed tail. When the tail reaches B rows the
 * block closes: every row of it gets a query-independent salience, fixed forever (σ: the norm of
 * what is left of its 64-dim branch after removing the 2κ−1 lowest Fourier components along the
 * block). Then the attended tier is re-selected globally:
 *
 *     attended = sinks (first S rows) ∪ top-m closed rows by score ∪ tail,
 *     m = max(1, round(closed / ratio)),
 *
 * and every other closed row is archived. Archiving is an index partition: bytes never move, so a
 * row can come back at a later close (rows move both ways) and the archive is exact by
 * construction. Ties in the score go to the lower position, so replicas on several GPUs choose
 * the same rows with no communication.
 */
#include "tiers_internal.h"

#include "kernels/philox.h"
#include "recall/kernels/recall_scan.h"
#include "kernels/sigma.h"
#include "recall/kernels/sketch.h"
#include "kernels/topm.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

kvt_status kvt__sal_shared_init(kvt__sal_shared *sh, const kvt__alloc *a, const kvt__backend *be,
                                const kvt_config *cfg) {
    memset(sh, 0, sizeof *sh);
    sh->block_rows = cfg->block_rows;
    sh->n_basis = 2 * cfg->kappa - 1;
    size_t bytes = sizeof(float) * (size_t)sh->n_basis * sh->block_rows;
    /* Built on the host once, then kept in the backend's memory, where σ reads it. */
    float *host = kvt__malloc(a, bytes);
    if (!host)
        return KVT_ERR_OUT_OF_MEMORY;
    kvt_status s = KVT_OK;
    if (kvt__sigma_basis((int)cfg->sigma_basis, cfg->block_rows, cfg->kappa, host) != 0)
        s = KVT_ERR_INVALID_ARGUMENT;
    void *dev = NULL;
    if (s == KVT_OK && (s = be->ops->buf_alloc(be, bytes, &dev)) == KVT_OK) {
        sh->be = be;
        sh->basis = dev;
        s = be->ops->write(be, dev, host, bytes, NULL);
    }
    kvt__free(a, host, bytes);
    if (s != KVT_OK)
        kvt__sal_shared_fini(sh);
    return s;
}

void kvt__sal_shared_fini(kvt__sal_shared *sh) {
    if (sh->be && sh->basis)
        sh->be->ops->buf_free(sh->be, sh->basis,
                              sizeof(float) * (size_t)sh->n_basis * sh->block_rows);
    memset(sh, 0, sizeof *sh);
}

void kvt__sal_init(kvt__sal *s, const kvt__backend *home, uint32_t sk_stride) {
    s->be = home;
    s->sk_stride = sk_stride;
}

/* The state's own closed-row planes (score, csk, rho): where each is, its cap and its bytes per
 * row (0: the state has no such plane). */
typedef struct closed_planes {
    void **p[3];
    uint64_t *cap[3];
    size_t elt[3];
} closed_planes;

static closed_planes closed_planes_of(kvt__sal *s) {
    closed_planes c = {{(void **)&s->score, (void **)&s->csk, (void **)&s->rho},
                       {&s->score_cap, &s->csk_cap, &s->rho_cap},
                       {sizeof *s->score, sizeof *s->csk * s->sk_stride,
                        s->sk_stride ? sizeof *s->rho : 0}};
    return c;
}

/* A shared set's planes, with the element sizes of the states that hold it. */
static closed_planes head_planes_of(kvt__sal_head *h, const kvt__sal *s) {
    closed_planes c = {{(void **)&h->score, (void **)&h->csk, (void **)&h->rho},
                       {&h->cap[0], &h->cap[1], &h->cap[2]},
                       {sizeof *s->score, sizeof *s->csk * s->sk_stride,
                        s->sk_stride ? sizeof *s->rho : 0}};
    return c;
}

static uint64_t planes_bytes(closed_planes c) {
    uint64_t n = 0;
    for (int k = 0; k < 3; k++)
        n += *c.cap[k] * c.elt[k];
    return n;
}

static void planes_free(const kvt__backend *be, closed_planes c) {
    for (int k = 0; k < 3; k++) {
        if (be && *c.p[k])
            be->ops->buf_free(be, *c.p[k], *c.cap[k] * c.elt[k]);
        *c.p[k] = NULL;
        *c.cap[k] = 0;
    }
}

/* Let go of the shared set: freed by its last holder. The state then reads no shared rows. */
static void head_drop(kvt__sal *s, const kvt__alloc *a) {
    kvt__sal_head *h = s->head;
    s->head = NULL;
    s->n_head = 0;
    kvt__sal_tail_forget(s);
    if (!h || --h->holders > 0)
        return;
    planes_free(s->be, head_planes_of(h, s));
    kvt__free(a, h, sizeof *h);
}

/* Make src's closed rows one shared set (src->n_head = closed_rows afterwards). Its own planes
 * move into a new set when it has none (no copy: its later closes take own planes at their
 * reserve); when it already reads a set and closed blocks since, that set and its own rows are
 * copied into a new one, its own planes kept for the rows it closes next. Nothing changes on
 * failure. */
static kvt_status head_make(kvt__sal *s, const kvt__alloc *a) {
    if (s->n_head == s->closed_rows)
        return KVT_OK;
    kvt__sal_head *h = kvt__malloc(a, sizeof *h);
    if (!h)
        return KVT_ERR_OUT_OF_MEMORY;
    memset(h, 0, sizeof *h);
    h->rows = s->closed_rows;
    h->holders = 1;
    closed_planes own = closed_planes_of(s), hp = head_planes_of(h, s);
    if (!s->head) { /* move */
        for (int k = 0; k < 3; k++) {
            *hp.p[k] = *own.p[k];
            *hp.cap[k] = *own.cap[k];
            *own.p[k] = NULL;
            *own.cap[k] = 0;
        }
        s->head = h;
        s->n_head = s->closed_rows;
        kvt__sal_tail_forget(s); /* (its rows moved with the planes) */
        return KVT_OK;
    }
    /* copy: the old set's rows [0, n_head), then the own rows */
    const kvt__backend *be = s->be;
    closed_planes old = head_planes_of(s->head, s);
    kvt_status rc = KVT_OK;
    for (int k = 0; k < 3 && rc == KVT_OK; k++)
        if (own.elt[k]) {
            *hp.cap[k] = h->rows;
            rc = be->ops->buf_alloc(be, h->rows * own.elt[k], hp.p[k]);
        }
    for (int k = 0; k < 3 && rc == KVT_OK; k++) {
        if (!own.elt[k])
            continue;
        uint8_t *dst = *hp.p[k];
        rc = be->ops->copy(be, dst, *old.p[k], s->n_head * own.elt[k], NULL);
        if (rc == KVT_OK)
            rc = be->ops->copy(be, dst + s->n_head * own.elt[k], *own.p[k],
                               (s->closed_rows - s->n_head) * own.elt[k], NULL);
    }
    if (rc != KVT_OK) {
        planes_free(be, hp);
        kvt__free(a, h, sizeof *h);
        return rc;
    }
    head_drop(s, a);
    s->head = h;
    s->n_head = h->rows;
    kvt__sal_tail_forget(s);
    return KVT_OK;
}

kvt_status kvt__sal_share(kvt__sal *dst, kvt__sal *src, uint64_t rows, const kvt__alloc *a) {
    if (rows == 0)
        return KVT_OK; /* nothing closed: nothing to share */
    if (dst->sk_stride != src->sk_stride || dst->be != src->be || dst->closed_rows != 0 ||
        rows > src->closed_rows || dst == src)
        return KVT_ERR_INVARIANT;
    if (rows > src->n_head) {
        kvt_status rc = head_make(src, a);
        if (rc != KVT_OK)
            return rc;
    }
    kvt__sal_head *h = src->head;
    h->holders++;
    head_drop(dst, a); /* (a fresh state reads none) */
    dst->head = h;
    dst->n_head = rows;
    kvt__sal_tail_forget(dst);
    return KVT_OK;
}

void kvt__sal_unshare(kvt__sal *s, const kvt__alloc *a) {
    head_drop(s, a);
}

void kvt__sal_side_bytes(const kvt__sal *s, uint64_t *own, uint64_t *shared) {
    kvt__sal *w = (kvt__sal *)(uintptr_t)s;
    const uint64_t head = s->head ? planes_bytes(head_planes_of(s->head, s)) : 0;
    const bool sh = s->head && s->head->holders > 1;
    *own = sizeof *s->kept * s->kept_cap + planes_bytes(closed_planes_of(w)) + (sh ? 0 : head);
    *shared = sh ? head : 0;
}

void kvt__sal_fini(kvt__sal *s, const kvt__alloc *a) {
    head_drop(s, a);
    planes_free(s->be, closed_planes_of(s));
    if (s->be)
        s->be->ops->buf_free(s->be, s->kept, sizeof *s->kept * s->kept_cap);
    memset(s, 0, sizeof *s);
}

/* Rows [0, rows) of closed-row plane k (0 score, 1 csk, 2 rho) into host memory: the shared
 * set's, then the state's own (synchronising: inspection and snapshots). */
static kvt_status planes_read(const kvt__sal *s, int k, void *dst, uint64_t rows) {
    kvt__sal *w = (kvt__sal *)(uintptr_t)s;
    closed_planes own = closed_planes_of(w);
    const size_t elt = own.elt[k];
    const uint64_t nh = rows < s->n_head ? rows : s->n_head;
    kvt_status rc = KVT_OK;
    if (nh && elt)
        rc = s->be->ops->read(s->be, dst, *head_planes_of(s->head, s).p[k], nh * elt, NULL);
    if (rc == KVT_OK && rows > nh && elt)
        rc = s->be->ops->read(s->be, (uint8_t *)dst + nh * elt, *own.p[k], (rows - nh) * elt,
                              NULL);
    return rc;
}

/* Grow a side plane in the backend's memory to hold n elements of elt bytes (grow-only, 1.5x):
 * a new buffer, the old contents copied over on the device on `stream` (NULL: synchronously),
 * the old one freed. */
static kvt_status plane_grow(const kvt__backend *be, void **p, uint64_t *cap, uint64_t n,
                             size_t elt, void *stream) {
    if (n <= *cap)
        return KVT_OK;
    uint64_t want = *cap + *cap / 2;
    if (want < n)
        want = n;
    void *q = NULL;
    kvt_status s = be->ops->buf_alloc(be, want * elt, &q);
    if (s != KVT_OK)
        return s;
    if (*cap && (s = be->ops->copy(be, q, *p, *cap * elt, stream)) != KVT_OK) {
        be->ops->buf_free(be, q, want * elt);
        return s;
    }
    if (*p)
        be->ops->buf_free(be, *p, *cap * elt);
    *p = q;
    *cap = want;
    return KVT_OK;
}

/* The sketch planes (csk, ρ) to `need` own rows at least; to `grown` (>= need) when they must
 * grow, so that one growth leaves room for what comes next. */
static kvt_status sketch_planes_grow(kvt__sal *s, uint64_t need, uint64_t grown, void *stream) {
    const uint64_t n = need > s->csk_cap || need > s->rho_cap ? grown : need;
    void *p = s->csk;
    kvt_status st = plane_grow(s->be, &p, &s->csk_cap, n, sizeof *s->csk * s->sk_stride, stream);
    s->csk = p;
    if (st != KVT_OK)
        return st;
    p = s->rho;
    st = plane_grow(s->be, &p, &s->rho_cap, n, sizeof *s->rho, stream);
    s->rho = p;
    return st;
}

/* The close of new_closed rows: the own closed-row planes (rows n_head on; sized at least for
 * the rows kvt__sal_prepare asked for, so that a state whose planes moved into a shared set
 * takes them back in one allocation) and the kept plane. Capacity only. Sketch planes that grow
 * take `ahead` rows more (kvt__sal_prepare: the rows past the last closed block, which the
 * commits sketch ahead; sketch_ahead). */
static kvt_status sal_reserve(kvt__sal *s, uint64_t new_closed, uint64_t m, uint64_t ahead,
                              void *stream) {
    KVT_ASSERT(new_closed >= s->n_head);
    uint64_t own = new_closed - s->n_head;
    if (own > s->score_cap && s->prep_rows > new_closed)
        own = s->prep_rows - s->n_head;
    void *p = s->score;
    kvt_status st = plane_grow(s->be, &p, &s->score_cap, own, sizeof *s->score, stream);
    s->score = p;
    if (st != KVT_OK)
        return st;
    p = s->kept;
    st = plane_grow(s->be, &p, &s->kept_cap, m ? m : 1, sizeof *s->kept, stream);
    s->kept = p;
    if (st != KVT_OK || s->sk_stride == 0)
        return st;
    /* The recall sketches of the closed rows, grown with σ. */
    return sketch_planes_grow(s, own, own + ahead, stream);
}

kvt_status kvt__sal_prepare(kvt__sal *s, const kvt__alloc *a, const kvt_config *cfg,
                            uint64_t rows) {
    (void)a;
    uint64_t closed = rows / cfg->block_rows * cfg->block_rows;
    if (closed > s->prep_rows)
        s->prep_rows = closed;
    return sal_reserve(s, closed < s->n_head ? s->n_head : closed, kvt__sal_m(closed, cfg),
                       rows - closed, NULL);
}

/* The top-m size before promotion's reserve (kvt__sal_m without it). */
static uint64_t budget_m(uint64_t closed_rows, const kvt_config *cfg) {
    if (closed_rows == 0)
        return 0;
    const uint64_t ratio = cfg->ratio;
    if (!cfg->salience_budget) {
        uint64_t m = (closed_rows + ratio / 2) / ratio;
        return m < 1 ? 1 : m;
    }
    /* Budget mode: the attended rows over the next block, sinks + m + its mean tail B/2, match
     * the mean context (closed + B/2) / ratio, never below the floor nor above the closed rows. */
    const uint64_t half = cfg->block_rows / 2;
    const uint64_t want = (closed_rows + half + ratio - 1) / ratio;
    const uint64_t other = cfg->sink_rows + half;
    uint64_t m = want > other ? want - other : 0;
    if (m < cfg->budget_min_kept)
        m = cfg->budget_min_kept;
    return m > closed_rows ? closed_rows : m;
}

uint64_t kvt__sal_promote_room(uint64_t closed_rows, const kvt_config *cfg) {
    if (cfg->recall == KVT_RECALL_OFF || cfg->recall_promote_capacity == 0)
        return 0;
    const uint64_t m = budget_m(closed_rows, cfg);
    return m <= 1 ? 0 : m - 1 < cfg->recall_promote_capacity ? m - 1 : cfg->recall_promote_capacity;
}

uint64_t kvt__sal_m(uint64_t closed_rows, const kvt_config *cfg) {
    return budget_m(closed_rows, cfg) - kvt__sal_promote_room(closed_rows, cfg);
}

/* The scoring of the block starting at position `first` of a job's layer into out[0..B). */
static kvt__score_args score_args(const kvt__env *env, const kvt__sal_job *j, uint64_t first,
                                  float *out) {
    const kvt_layer_spec *sp = &j->st->spec;
    kvt__score_args a;
    memset(&a, 0, sizeof a);
    a.selector = j->cfg->selector;
    a.base = j->st->plane[0];
    a.pages = j->pt->dpages; /* the table's mirror: the backend expands the block's slots */
    a.first_page = j->pt->first_page;
    a.pdiv = env->pdiv;
    a.first_row = first;
    a.n_rows = j->sh->block_rows;
    a.slot_stride = j->st->slot_bytes;
    a.branch_offset = sp->branch_offset;
    a.branch_dtype = (int)sp->branch_dtype;
    a.branch_dim = sp->branch_dim;
    a.dtype = (int)sp->dtype;
    a.n_values = sp->head_dim;
    a.basis = j->sh->basis;
    a.n_basis = j->sh->n_basis;
    a.key = j->philox_key;
    a.subseq = kvt__philox_subseq(0, j->st->layer + env->layer_offset, 0); /* global layer id */
    a.first_position = first;
    a.out = out;
    return a;
}

/* Bytes of a row the selector reads. */
static uint64_t score_bytes_per_row(const kvt_config *cfg, const kvt_layer_spec *sp) {
    switch (cfg->selector) {
    case KVT_SELECT_SIGMA:
    case KVT_SELECT_BRANCH_NORM:
        return (uint64_t)sp->branch_dim * kvt_dtype_bytes(sp->branch_dtype);
    case KVT_SELECT_ROW_NORM:
        return sp->row_bytes;
    case KVT_SELECT_RANDOM:
        return 0;
    }
    return 0;
}

/* Blocks and selections handed to the backend per call (stack arrays: a close allocates
 * nothing on the host). A decode step closes at most one block per request and layer. */
#define KVT__SAL_CHUNK 32u

/* Mark every job of [lo, hi) that is still running failed with rc (its blocks stay unclosed:
 * their rows remain attended in the tail, and the next commit closes them). */
static void fail_jobs(const kvt__env *env, kvt__sal_job *jobs, uint32_t lo, uint32_t hi,
                      kvt_status rc, const char *what) {
    for (uint32_t i = lo; i < hi; i++)
        if (jobs[i].status == KVT_OK && jobs[i].n_close) {
            jobs[i].status = rc;
            jobs[i].n_close = 0;
            kvt__fail(env->err, env->err_len, rc, "salience: %s", what);
        }
}

/* The sketching of the `B` rows from position `first` of a state's layer (recall/kernels/sketch.h)
 * into the planes' rows at csk and rho, the rows read through the request's table pt. */
static kvt__sketch_args sketch_args_at(const kvt__env *env, const kvt__store *st,
                                       const kvt__ptable *pt, const kvt__sal *s, uint32_t B,
                                       uint64_t first, uint16_t *csk, float *rho) {
    const kvt_layer_spec *sp = &st->spec;
    const kvt__rbasis *rb = &st->rbasis;
    kvt__sketch_args a;
    memset(&a, 0, sizeof a);
    a.base = st->plane[0];
    a.pages = pt->dpages;
    a.first_page = pt->first_page;
    a.pdiv = env->pdiv;
    a.first_row = first;
    a.n_rows = B;
    a.slot_stride = st->slot_bytes;
    a.dtype = (int)sp->dtype;
    a.latent_dim = sp->value_dim;
    a.basis = rb->rank ? rb->V : NULL;
    a.rank = rb->rank;
    a.csk_stride = s->sk_stride;
    a.csk = csk;
    a.q8_off = s->sk_q8;
    a.branch_offset = sp->branch_offset;
    a.branch_dtype = (int)sp->branch_dtype;
    a.branch_dim = sp->branch_dim;
    a.rho = rho;
    return a;
}

/* The sketching of rows [first, first + n) of a job's layer into its own rows of the sketch
 * planes. */
static kvt__sketch_args sketch_args(const kvt__env *env, const kvt__sal_job *j, uint64_t first,
                                    uint32_t n) {
    const kvt__sal *s = j->s;
    return sketch_args_at(env, j->st, j->pt, s, n, first,
                          s->csk + (first - s->n_head) * s->sk_stride, s->rho + (first - s->n_head));
}

/* Rows from closed_rows on that hold their sketches already (kvt__sal.sk_rows). */
static uint64_t sketched_to(const kvt__sal *s) {
    return s->sk_rows > s->closed_rows ? s->sk_rows : s->closed_rows;
}

/* Rows a commit sketches ahead at a time: the CPU's widest sketch tile (recall/kernels/sketch.c),
 * so that sketching a block a tile at a time costs what sketching it whole does. */
#define KVT__SAL_AHEAD_ROWS 32u

/* Arguments of one batched call: σ of blocks, or their sketches. */
typedef union block_args {
    kvt__score_args score[KVT__SAL_CHUNK];
    kvt__sketch_args sketch[KVT__SAL_CHUNK];
} block_args;

static void block_call(const kvt__env *env, kvt__sal_job *jobs, uint32_t lo, uint32_t hi,
                       const block_args *a, uint32_t k, bool sketch) {
    const kvt__backend *be = env->backend;
    kvt_status rc = sketch ? be->ops->sketch_rows(be, a->sketch, k, env->stream)
                           : be->ops->score_rows(be, a->score, k, env->stream);
    if (rc != KVT_OK)
        fail_jobs(env, jobs, lo, hi, rc,
                  sketch ? "sketching a closed block" : "scoring a closed block");
}

/* Score (σ) or sketch every block the jobs close: chunks of KVT__SAL_CHUNK blocks, one backend
 * call each. Sketches only for states with sketch planes. */
static void block_jobs(const kvt__env *env, kvt__sal_job *jobs, uint32_t n, bool sketch) {
    block_args args;
    uint32_t k = 0, first_job = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvt__sal_job *j = &jobs[i];
        if (sketch && j->s->sk_stride == 0)
            continue;
        for (uint64_t b = 0; j->status == KVT_OK && b < j->n_close; b++) {
            const uint32_t B = j->sh->block_rows;
            uint64_t first = j->s->closed_rows + b * B;
            /* the rows a commit sketched ahead are not sketched again */
            const uint64_t from = sketch && sketched_to(j->s) > first ? sketched_to(j->s) : first;
            if (from >= first + B)
                continue;
            if (k == 0)
                first_job = i;
            if (sketch)
                args.sketch[k++] = sketch_args(env, j, from, (uint32_t)(first + B - from));
            else
                args.score[k++] = score_args(env, j, first, j->s->score + (first - j->s->n_head));
            if (k == KVT__SAL_CHUNK) {
                block_call(env, jobs, first_job, i + 1, &args, k, sketch);
                k = 0;
            }
        }
    }
    if (k)
        block_call(env, jobs, first_job, n, &args, k, sketch);
}

/* The sketches of committed rows of the open blocks, ahead of their close (4. of
 * kvt__sal_commit_many): for every job whose rows are final, whole tiles of KVT__SAL_AHEAD_ROWS
 * rows past what it sketched already, into its own planes where they have room (a close then
 * sketches only the rows after them: the same bits, each row's sketch being its own). Spreads a
 * close's sketching over the block's commits. Allocates nothing and changes no decision: a job
 * whose planes lack the room, or whose call fails, sketches those rows at its close. */
static void sketch_ahead(const kvt__env *env, kvt__sal_job *jobs, uint32_t n) {
    kvt__sketch_args a[KVT__SAL_CHUNK];
    kvt__sal *who[KVT__SAL_CHUNK];
    uint64_t to[KVT__SAL_CHUNK];
    uint32_t k = 0;
    for (uint32_t i = 0; i <= n; i++) {
        if (i < n) {
            kvt__sal_job *j = &jobs[i];
            kvt__sal *s = j->s;
            const uint64_t from = sketched_to(s);
            const uint64_t rows = j->new_n_rows > from ? j->new_n_rows - from : 0;
            const uint64_t t = from + rows / KVT__SAL_AHEAD_ROWS * KVT__SAL_AHEAD_ROWS;
            if (j->final && j->status == KVT_OK && s->sk_stride && t > from &&
                s->closed_rows >= s->n_head && t - s->n_head <= s->csk_cap &&
                t - s->n_head <= s->rho_cap) {
                a[k] = sketch_args(env, j, from, (uint32_t)(t - from));
                who[k] = s;
                to[k++] = t;
            }
        }
        if (k == KVT__SAL_CHUNK || (i == n && k)) {
            if (env->backend->ops->sketch_rows(env->backend, a, k, env->stream) == KVT_OK)
                for (uint32_t x = 0; x < k; x++)
                    who[x]->sk_rows = to[x];
            k = 0;
        }
    }
}

kvt_status kvt__sal_commit_many(const kvt__env *env, kvt__sal_job *jobs, uint32_t n) {
    /* 1. What closes, and capacity (grow-only; nothing to do when sized for a stated limit). */
    for (uint32_t i = 0; i < n; i++) {
        kvt__sal_job *j = &jobs[i];
        kvt__sal *s = j->s;
        uint32_t B = j->sh->block_rows;
        KVT_ASSERT(j->new_n_rows >= s->n_rows);
        j->status = KVT_OK;
        j->n_close = (j->new_n_rows - s->closed_rows) / B;
        if (j->n_close == 0)
            continue;
        j->new_closed = s->closed_rows + j->n_close * B;
        j->m = kvt__sal_m(j->new_closed, j->cfg);
        /* growth on the run's stream: ordered with its earlier closes */
        kvt_status st = sal_reserve(s, j->new_closed, j->m, 0, env->stream);
        if (st == KVT_OK && j->new_closed > UINT32_MAX)
            st = kvt__fail(env->err, env->err_len, KVT_ERR_UNSUPPORTED,
                           "salience: more than 2^32 closed rows");
        else if (st != KVT_OK)
            kvt__fail(env->err, env->err_len, st, "salience: scores and close scratch");
        if (st != KVT_OK) {
            j->status = st;
            j->n_close = 0;
        }
    }
    /* 2. σ of every closing block (a batched op), and the recall sketches of their rows when the
     * context builds them (another batched op; docs/recall.md). */
    block_jobs(env, jobs, n, false);
    block_jobs(env, jobs, n, true);
    /* 3. The selections, one segment per job. A row whose branch holds NaN or Inf was left out
     * of its block's fit and scored +Inf (sigma.h); a huge finite branch can still overflow to
     * Inf, and the ablation selectors give NaN/Inf for such a row. The selection canonicalises
     * every one to +Inf: the row ranks first (ties to the lower position), stays attended and
     * takes one slot of the budget — only its own — and is counted in nonfinite_sigma. */
    kvt__select_args sel[KVT__SAL_CHUNK];
    uint32_t at[KVT__SAL_CHUNK];
    uint32_t k = 0;
    for (uint32_t i = 0; i <= n; i++) {
        if (i < n && jobs[i].status == KVT_OK && jobs[i].n_close) {
            kvt__sal_job *j = &jobs[i];
            uint64_t S = j->cfg->sink_rows;
            sel[k] = (kvt__select_args){.score = j->s->score,
                                        .score_head = j->s->head ? j->s->head->score : NULL,
                                        .n_head = j->s->n_head,
                                        .first_new = j->s->closed_rows,
                                        .n_closed = j->new_closed,
                                        .m = (uint32_t)j->m,
                                        .sinks = S < j->new_closed ? S : j->new_closed,
                                        .kept = j->s->kept};
            at[k++] = i;
        }
        if (k == KVT__SAL_CHUNK || (i == n && k)) {
            kvt_status rc = env->backend->ops->select(env->backend, sel, k, env->stream);
            for (uint32_t x = 0; x < k; x++) {
                kvt__sal_job *j = &jobs[at[x]];
                if (rc != KVT_OK) {
                    fail_jobs(env, jobs, at[x], at[x] + 1, rc, "top-m select");
                    continue;
                }
                /* Commit point: nothing below can fail. */
                kvt__sal *s = j->s;
                s->n_kept = j->m;
                s->kept_in_sinks = sel[x].kept_in_sinks;
                s->closes += j->n_close;
                s->nonfinite += sel[x].nonfinite;
                s->score_bytes_read +=
                    j->n_close * j->sh->block_rows * score_bytes_per_row(j->cfg, &j->st->spec);
                s->closed_rows = j->new_closed;
                kvt__sal_tail_forget(s); /* (every row it had sketched ahead is closed now) */
            }
            k = 0;
        }
    }
    /* On failure the blocks stay unclosed: their rows remain attended as part of the tail
     * (never lost from the attended set) and the next commit closes them. Scores written for
     * them are rewritten by that close.
     * 4. The committed rows of the open blocks sketched ahead of their close. */
    sketch_ahead(env, jobs, n);
    kvt_status first = KVT_OK;
    for (uint32_t i = 0; i < n; i++) {
        jobs[i].s->n_rows = jobs[i].new_n_rows;
        if (first == KVT_OK)
            first = jobs[i].status;
    }
    return first;
}

kvt_status kvt__sal_commit(kvt__sal *s, const kvt__env *env, const kvt__sal_shared *sh,
                           const kvt__store *st, const kvt__ptable *pt, uint64_t new_n_rows) {
    kvt__sal_job j = {.s = s, .sh = sh, .st = st, .pt = pt, .cfg = env->cfg,
                      .philox_key = env->philox_key, .new_n_rows = new_n_rows, .final = true};
    return kvt__sal_commit_many(env, &j, 1);
}

/* Sinks that lie in the closed region (the others are part of the tail). */
static uint64_t closed_sinks(const kvt__sal *s, const kvt_config *cfg) {
    return cfg->sink_rows < s->closed_rows ? cfg->sink_rows : s->closed_rows;
}

void kvt__sal_attended(const kvt__sal *s, const kvt_config *cfg, uint64_t n_rows,
                       kvt__attended_desc *d) {
    /* Kept rows inside the sinks are attended as sinks: the list starts after them (a count the
     * close brought back; the list itself stays in the backend's memory). */
    /* The tail ends at the view's rows, or at the state's when a run closed over rows its step
     * never committed (a batch destroyed after a run: the request can only be destroyed, but
     * still answers inspection). */
    uint64_t end = n_rows > s->n_rows ? n_rows : s->n_rows;
    *d = (kvt__attended_desc){.lo_end = closed_sinks(s, cfg),
                              .list = s->n_kept > s->kept_in_sinks ? s->kept + s->kept_in_sinks
                                                                   : NULL,
                              .n_list = s->n_kept - s->kept_in_sinks,
                              .hi_begin = s->closed_rows,
                              .hi_end = end};
}

/* kept[i], read through the backend (inspection). */
static uint32_t kept_at(const kvt__sal *s, uint64_t i) {
    uint32_t v = 0;
    if (s->be->ops->read(s->be, &v, s->kept + i, sizeof v, NULL) != KVT_OK)
        return UINT32_MAX;
    return v;
}

static bool in_kept(const kvt__sal *s, uint64_t pos) {
    uint64_t lo = 0, hi = s->n_kept;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (kept_at(s, mid) < pos)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->n_kept && kept_at(s, lo) == pos;
}

bool kvt__sal_is_attended(const kvt__sal *s, const kvt_config *cfg, uint64_t pos) {
    return pos < cfg->sink_rows || pos >= s->closed_rows || in_kept(s, pos);
}

/* The checks over host copies of the score and kept planes. */
static kvt_status check_host(const kvt__sal *s, const kvt_config *cfg, const float *score,
                             const uint32_t *kept, char *err, size_t len) {
    uint32_t B = cfg->block_rows;
    /* A tail of B rows or more is legal only while a failed close waits for its retry. */
    if (s->closed_rows % B != 0 || s->closed_rows > s->n_rows)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "salience: closed %llu / rows %llu inconsistent with block %u",
                         (unsigned long long)s->closed_rows, (unsigned long long)s->n_rows, B);
    if (s->n_kept != kvt__sal_m(s->closed_rows, cfg))
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "salience: %llu kept rows, m = %llu",
                         (unsigned long long)s->n_kept,
                         (unsigned long long)kvt__sal_m(s->closed_rows, cfg));
    for (uint64_t i = 0; i < s->n_kept; i++) {
        if (kept[i] >= s->closed_rows || (i > 0 && kept[i] <= kept[i - 1]))
            return kvt__fail(err, len, KVT_ERR_INVARIANT,
                             "salience: kept[%llu] = %u not ascending inside the closed rows",
                             (unsigned long long)i, kept[i]);
    }
    uint64_t S = closed_sinks(s, cfg), below = 0;
    while (below < s->n_kept && kept[below] < S)
        below++;
    if (below != s->kept_in_sinks)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "salience: %llu kept rows lie in the sinks, %llu recorded",
                         (unsigned long long)below, (unsigned long long)s->kept_in_sinks);
    /* Top-m property: every kept key >= every archived key; on equal keys, kept positions come
     * first. Walk positions once, merging with the sorted kept list. */
    uint32_t min_kept = UINT32_MAX, max_arch = 0;
    uint64_t min_kept_pos = 0, max_arch_pos = 0, k = 0;
    bool any_arch = false;
    for (uint64_t p = 0; p < s->closed_rows; p++) {
        float v = score[p];
        if (!(v <= FLT_MAX) && !isinf(v))
            return kvt__fail(err, len, KVT_ERR_INVARIANT, "salience: NaN score stored at %llu",
                             (unsigned long long)p);
        uint32_t key = kvt__score_key(v);
        if (k < s->n_kept && kept[k] == p) {
            k++;
            if (key < min_kept || (key == min_kept && p > min_kept_pos)) {
                min_kept = key;
                min_kept_pos = p;
            }
        } else if (!any_arch || key > max_arch || (key == max_arch && p < max_arch_pos)) {
            any_arch = true;
            max_arch = key;
            max_arch_pos = p;
        }
    }
    if (any_arch && s->n_kept > 0 &&
        (max_arch > min_kept || (max_arch == min_kept && max_arch_pos < min_kept_pos)))
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "salience: archived row %llu outranks kept row %llu",
                         (unsigned long long)max_arch_pos, (unsigned long long)min_kept_pos);
    return KVT_OK;
}

kvt_status kvt__sal_check(const kvt__sal *s, const kvt_config *cfg, char *err, size_t len) {
    /* Inspection: the planes come to the host through the backend (synchronising). */
    const kvt__backend *be = s->be;
    float *score = s->closed_rows ? kvt__malloc(be->alloc, sizeof *score * s->closed_rows) : NULL;
    uint32_t *kept = s->n_kept ? kvt__malloc(be->alloc, sizeof *kept * s->n_kept) : NULL;
    kvt_status rc = KVT_OK;
    if ((s->closed_rows && !score) || (s->n_kept && !kept))
        rc = kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "salience check: host copies");
    if (rc == KVT_OK && s->closed_rows &&
        (rc = planes_read(s, 0, score, s->closed_rows)) != KVT_OK)
        kvt__fail(err, len, rc, "salience check: reading the score plane");
    if (rc == KVT_OK && s->n_kept &&
        (rc = be->ops->read(be, kept, s->kept, sizeof *kept * s->n_kept, NULL)) != KVT_OK)
        kvt__fail(err, len, rc, "salience check: reading the kept set");
    if (rc == KVT_OK)
        rc = check_host(s, cfg, score, kept, err, len);
    kvt__free(be->alloc, score, sizeof *score * s->closed_rows);
    kvt__free(be->alloc, kept, sizeof *kept * s->n_kept);
    return rc;
}

/* The recall sketches of the closed rows (read through the backend): ρ is never NaN nor
 * negative; a row with ρ = +Inf (undescribable, recall/kernels/sketch.h) has an all-zero sketch;
 * every other coefficient is finite, and the entries past the layer's basis rank are 0. */
static kvt_status check_sketches(const kvt__sal *s, uint32_t rank, char *err, size_t len) {
    if (s->sk_stride == 0 || s->closed_rows == 0)
        return KVT_OK;
    const kvt__backend *be = s->be;
    size_t n_csk = (size_t)s->closed_rows * s->sk_stride;
    uint16_t *csk = kvt__malloc(be->alloc, sizeof *csk * n_csk);
    float *rho = kvt__malloc(be->alloc, sizeof *rho * s->closed_rows);
    kvt_status rc = KVT_OK;
    if (!csk || !rho)
        rc = kvt__fail(err, len, KVT_ERR_OUT_OF_MEMORY, "salience check: sketch copies");
    if (rc == KVT_OK && ((rc = planes_read(s, 1, csk, s->closed_rows)) != KVT_OK ||
                         (rc = planes_read(s, 2, rho, s->closed_rows)) != KVT_OK))
        kvt__fail(err, len, rc, "salience check: reading the sketch planes");
    for (uint64_t u = 0; rc == KVT_OK && u < s->closed_rows; u++) {
        const uint16_t *c = csk + u * s->sk_stride;
        if (!(rho[u] >= 0.0f))
            rc = kvt__fail(err, len, KVT_ERR_INVARIANT, "salience: ρ of row %llu is %g",
                           (unsigned long long)u, (double)rho[u]);
        for (uint32_t k = 0; rc == KVT_OK && k < (s->sk_q8 ? s->sk_q8 : s->sk_stride); k++)
            if ((k >= rank || isinf(rho[u])) ? (c[k] & 0x7fffu) != 0 : !kvt__f16_finite(c[k]))
                rc = kvt__fail(err, len, KVT_ERR_INVARIANT,
                               "salience: sketch of row %llu, coefficient %u (rank %u, ρ %g): "
                               "0x%04x",
                               (unsigned long long)u, k, rank, (double)rho[u], c[k]);
    }
    kvt__free(be->alloc, csk, sizeof *csk * n_csk);
    kvt__free(be->alloc, rho, sizeof *rho * s->closed_rows);
    return rc;
}

/* ------------------------------------------------------------------------------------------- */
/* The policy table (policy.h)                                                                  */
/* ------------------------------------------------------------------------------------------- */
/* σ is a content score only where the branch is cached without rotation (DESIGN §2.1); the
 * kernels take branches up to KVT__SIGMA_MAX_BRANCH_DIM; the row-norm ablation reads values it
 * cannot decode in fp8 rows without their scales. */
static kvt_status sal_supports_layer(const kvt_layer_spec *sp, uint32_t i, const kvt_config *cfg,
                                     char *err, size_t len) {
    if (sp->kind != KVT_LAYER_MLA_NOPE)
        return kvt__fail(err, len, KVT_ERR_POLICY_MISMATCH,
                         "salience tiering needs an MLA-NoPE layer, layer %u is %s (on a rotated "
                         "branch σ carries position, not content: needle 0.89 -> 0.08 at 32x in "
                         "the source paper)",
                         i, kvt_layer_kind_name(sp->kind));
    if (sp->branch_dim > KVT__SIGMA_MAX_BRANCH_DIM)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "layer %u: branch_dim %u exceeds the %u the salience kernels take", i,
                         sp->branch_dim, KVT__SIGMA_MAX_BRANCH_DIM);
    if (cfg->selector == KVT_SELECT_ROW_NORM && sp->dtype == KVT_DTYPE_FP8_E4M3)
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "config.selector: the row-norm ablation cannot read fp8 rows (layer %u) "
                         "without their scales",
                         i);
    return KVT_OK;
}

/* params.recall_sketch_rank against a salience layer (docs/recall.md): the sketch reads a row's
 * latent, which kvtier can decode in bf16, fp16 and fp32 rows, and in fp8 rows of one layout. */
static kvt_status sal_supports_sketch(const kvt_layer_spec *sp, uint32_t i, uint32_t r, char *err,
                                      size_t len) {
    /* fp8 rows are read in one layout only: FlashMLA's 656-B ds_mla row (kvt_hd.h). */
    if (sp->dtype == KVT_DTYPE_FP8_E4M3 && !kvt__spec_ds_mla(sp))
        return kvt__fail(err, len, KVT_ERR_UNSUPPORTED,
                         "params.recall_sketch_rank: layer %u stores fp8 rows in a layout "
                         "other than the 656-B ds_mla row (512 fp8 values, 4 fp32 scales, "
                         "64 bf16 branch values at byte 528), the only one kvtier decodes",
                         i);
    if (sp->value_dim > KVT__SKETCH_MAX_DIM || r > sp->value_dim)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "params.recall_sketch_rank: %u with layer %u's value_dim %u (the "
                         "sketch takes 1..%u latent values and a rank up to them)",
                         r, i, sp->value_dim, KVT__SKETCH_MAX_DIM);
    return KVT_OK;
}

/* A close's scoring takes σ's scratch and the block's slots in one piece; its sketches, when
 * the context builds them, the same piece (after σ) for their scratch and the slots. */
static size_t sal_close_scratch_floats(const kvt_layer_spec *sp, const kvt_config *cfg,
                                       uint32_t rank) {
    size_t f = sp->branch_dim ? kvt__sigma_scratch_floats(cfg->block_rows, 2 * cfg->kappa - 1,
                                                          sp->branch_dim) +
                                    cfg->block_rows
                              : 0;
    const size_t sk = rank ? kvt__backend_sketch_floats(cfg->block_rows, sp->value_dim) : 0;
    return sk > f ? sk : f;
}

/* The archive stays in the pool, in place: nothing is freed; the budget is attended. */
static void sal_census(uint64_t stored, uint64_t budget, uint64_t *attended, uint64_t *freed) {
    *attended = budget;
    *freed = 0;
}

static kvt_status sal_layer_init(kvt__tier_state *s, const kvt__env *env, const kvt__store *st) {
    const uint32_t q8 = env->sketch_stride && env->scan_bits == 8 ? env->sketch_stride : 0;
    kvt__sal_init(&s->sal, env->home,
                  env->sketch_stride + (q8 ? kvt__recall_q8_words(st->spec.branch_dim, q8) : 0));
    s->sal.sk_q8 = q8;
    if (env->max_rows == 0)
        return KVT_OK;
    kvt_status rc = kvt__sal_prepare(&s->sal, env->alloc, env->cfg, env->max_rows);
    return rc == KVT_OK ? KVT_OK
                        : kvt__fail(env->err, env->err_len, rc,
                                    "salience state of layer %u for %llu rows", st->layer,
                                    (unsigned long long)env->max_rows);
}

static kvt_status sal_group_init(kvt__group *gr, const kvt__store *stores, const kvt__alloc *a,
                                 const kvt_config *cfg, char *err, size_t len) {
    kvt_status s = kvt__sal_shared_init(&gr->state->sal, a, gr->home, cfg);
    if (s != KVT_OK)
        return kvt__fail(err, len, s, "salience basis table (B %u, kappa %u)", cfg->block_rows,
                         cfg->kappa);
    return KVT_OK;
}

static kvt_status sal_layer_reset(kvt__tier_state *s, const kvt__env *env,
                                  const kvt__store *st) {
    kvt__sal *sa = &s->sal;
    kvt__sal_unshare(sa, env->alloc); /* parked slots have given theirs up already */
    sa->n_rows = sa->closed_rows = sa->n_kept = sa->kept_in_sinks = 0;
    kvt__sal_tail_forget(sa);
    sa->closes = sa->nonfinite = sa->score_bytes_read = 0;
    /* The new request's ratio may keep more rows: grow only then. */
    if (env->max_rows == 0)
        return KVT_OK;
    kvt_status rc = kvt__sal_prepare(sa, env->alloc, env->cfg, env->max_rows);
    return rc == KVT_OK ? KVT_OK
                        : kvt__fail(env->err, env->err_len, rc,
                                    "salience state of layer %u for %llu rows", st->layer,
                                    (unsigned long long)env->max_rows);
}

static void sal_group_fini(kvt__group *gr, const kvt__alloc *a) {
    (void)a;
    kvt__sal_shared_fini(&gr->state->sal);
}

static void sal_layer_fini(kvt__tier_state *s, const kvt__alloc *a) {
    kvt__sal_fini(&s->sal, a);
}

/* Each layer closes its own blocks; a failed layer does not stop the others (each retries from
 * its own state at the next commit). */
static kvt_status sal_group_commit(const kvt__env *env, const kvt__tier_group *g) {
    kvt_status first_err = KVT_OK;
    for (uint32_t k = 0; k < g->gr->n_layers; k++) {
        uint32_t i = g->gr->layers[k];
        kvt_status s = kvt__sal_commit(&g->states[i].sal, env, &g->gr->state->sal, &g->stores[i],
                                       g->pt, g->pt->n_rows);
        if (s != KVT_OK && first_err == KVT_OK)
            first_err = s;
    }
    return first_err;
}

/* The blocks complete once the step's rows count close now, exactly as a commit of the same rows
 * would close them (σ reads only this layer's rows, all written before the step's run). */
static kvt_status sal_layer_step(const kvt__env *env, kvt__tier_step *t, uint32_t n) {
    kvt__sal_job jobs[KVT__SAL_CHUNK];
    kvt_status first = KVT_OK;
    for (uint32_t i0 = 0; i0 < n; i0 += KVT__SAL_CHUNK) {
        uint32_t k = n - i0 < KVT__SAL_CHUNK ? n - i0 : KVT__SAL_CHUNK;
        for (uint32_t x = 0; x < k; x++) {
            kvt__tier_step *q = &t[i0 + x];
            jobs[x] = (kvt__sal_job){.s = &q->state->sal,
                                     .sh = &q->gr->state->sal,
                                     .st = q->st,
                                     .pt = q->pt,
                                     .cfg = q->cfg,
                                     .philox_key = q->philox_key,
                                     .new_n_rows = q->pt->n_rows + q->step_rows};
        }
        kvt_status s = kvt__sal_commit_many(env, jobs, k);
        if (first == KVT_OK)
            first = s;
        for (uint32_t x = 0; x < k; x++)
            t[i0 + x].status = jobs[x].status;
    }
    return first;
}

/* A block completes at the step's rows (kvt__sal_commit_many's rule). */
static bool sal_step_due(const kvt__tier_step *t) {
    return (t->pt->n_rows + t->step_rows - t->state->sal.closed_rows) /
               t->gr->state->sal.block_rows >
           0;
}

/* Room for a kept set of m rows (grow-only). */
static kvt_status kept_reserve(kvt__sal *s, uint64_t m) {
    void *p = s->kept;
    kvt_status rc = plane_grow(s->be, &p, &s->kept_cap, m ? m : 1, sizeof *s->kept, NULL);
    s->kept = p;
    return rc;
}

/* The forked request shares its parent's closed-row planes (σ, sketches: fixed once written)
 * for as long as both live, each writing its later closes into planes of its own; its kept set
 * is copied on the backend; the counts as they are. */
static kvt_status sal_layer_fork(kvt__tier_state *dst_s, kvt__tier_state *src_s,
                                 const kvt__env *env, const kvt__store *st, uint64_t rows) {
    (void)rows;
    kvt__sal *d = &dst_s->sal;
    kvt__sal *s = &src_s->sal;
    const kvt__backend *be = d->be;
    kvt_status rc = kept_reserve(d, s->n_kept);
    if (rc == KVT_OK)
        rc = kvt__sal_share(d, s, s->closed_rows, env->alloc);
    if (rc == KVT_OK && s->n_kept)
        rc = be->ops->copy(be, d->kept, s->kept, sizeof *s->kept * s->n_kept, NULL);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "forking the salience state of layer %u",
                         st->layer);
    d->n_rows = s->n_rows;
    d->closed_rows = s->closed_rows;
    kvt__sal_tail_forget(d);
    d->n_kept = s->n_kept;
    d->kept_in_sinks = s->kept_in_sinks;
    d->closes = s->closes;
    d->nonfinite = s->nonfinite;
    d->score_bytes_read = s->score_bytes_read;
    return KVT_OK;
}

/* An attached request holds the first `rows` rows: the blocks closed within them keep their σ
 * and sketches (src's planes, shared: it reads their first rows only), and its global top-m over
 * them is selected anew (one select; the shared scores are canonical already, so counting from 0
 * gives their non-finite rows and rewrites nothing: +Inf stays +Inf). */
static kvt_status sal_layer_attach(kvt__tier_state *dst_s, kvt__tier_state *src_s,
                                   const kvt__env *env, const kvt__store *st, uint64_t rows,
                                   uint64_t src_prompt_rows) {
    (void)src_prompt_rows;
    kvt__sal *d = &dst_s->sal;
    kvt__sal *s = &src_s->sal;
    const kvt_config *cfg = env->cfg;
    uint64_t closed = rows / cfg->block_rows * cfg->block_rows;
    if (closed > s->closed_rows) /* a close src has not done yet (it retries at its commit) */
        closed = s->closed_rows;
    uint64_t m = kvt__sal_m(closed, cfg);
    kvt_status rc = kept_reserve(d, m);
    if (rc == KVT_OK && closed)
        rc = kvt__sal_share(d, s, closed, env->alloc);
    kvt__select_args sel = {.score = d->score, .score_head = d->head ? d->head->score : NULL,
                            .n_head = d->n_head, .first_new = 0, .n_closed = closed,
                            .m = (uint32_t)m,
                            .sinks = cfg->sink_rows < closed ? cfg->sink_rows : closed,
                            .kept = d->kept};
    if (rc == KVT_OK && closed)
        rc = env->backend->ops->select(env->backend, &sel, 1, NULL);
    if (rc != KVT_OK)
        return kvt__fail(env->err, env->err_len, rc, "attaching the salience state of layer %u",
                         st->layer);
    d->n_rows = rows;
    d->closed_rows = closed;
    kvt__sal_tail_forget(d);
    d->n_kept = closed ? m : 0;
    d->kept_in_sinks = closed ? sel.kept_in_sinks : 0;
    d->closes = closed / cfg->block_rows;
    d->nonfinite = closed ? sel.nonfinite : 0;
    d->score_bytes_read = closed * score_bytes_per_row(cfg, &st->spec);
    return KVT_OK;
}

/* A step that closes a block writes its rows into the state's own planes: a state whose planes
 * moved into a shared set (kvt__sal_share) takes new ones here, at the step's reserve, so that
 * the step's run allocates nothing. The sketch planes take room for every row the reserve
 * counts, so that the commits can sketch the open block's rows ahead (sketch_ahead). */
static kvt_status sal_reserve_shared(kvt__tier_state *s, const kvt__env *env,
                                     const kvt__store *st, uint64_t rows) {
    kvt__sal *sa = &s->sal;
    const uint64_t closed = rows / env->cfg->block_rows * env->cfg->block_rows;
    kvt_status rc = sa->head && closed > sa->closed_rows
                        ? sal_reserve(sa, closed, kvt__sal_m(closed, env->cfg), 0, NULL)
                        : KVT_OK;
    /* planes that must grow take room to the end of the block the last row is in: one growth
     * a block at most */
    const uint64_t B = env->cfg->block_rows;
    if (rc == KVT_OK && sa->sk_stride && rows > sa->n_head)
        rc = sketch_planes_grow(sa, rows - sa->n_head, (rows + B - 1) / B * B - sa->n_head, NULL);
    return rc == KVT_OK ? KVT_OK
                        : kvt__fail(env->err, env->err_len, rc,
                                    "the salience planes of layer %u for its rows past the shared "
                                    "ones and its open block's sketches",
                                    st->layer);
}

static void sal_layer_unshare(kvt__tier_state *s, const kvt__alloc *a) {
    kvt__sal_unshare(&s->sal, a);
}

static void sal_side_bytes(const kvt__tier_state *s, uint64_t *own, uint64_t *shared,
                           const void **key, uint32_t *holders) {
    kvt__sal_side_bytes(&s->sal, own, shared);
    *key = *shared ? (const void *)s->sal.head : NULL;
    *holders = *shared ? s->sal.head->holders : 1;
}

static void sal_attended(const kvt__tier_layer *l, kvt__attended_desc *d) {
    kvt__sal_attended(&l->state->sal, l->cfg, l->pt->n_rows, d);
}

/* The archive is every closed row past the sinks outside the kept set, in place in the pool; the
 * sketches are the planes the closes wrote. */
static bool sal_recall_view(const kvt__tier_layer *l, kvt__nope_view *a) {
    const kvt__sal *sa = &l->state->sal;
    const kvt_layer_spec *sp = &l->st->spec;
    if (sa->sk_stride == 0)
        return false;
    memset(a, 0, sizeof *a);
    a->base = l->st->plane[0];
    a->pages = l->pt->dpages;
    a->first_page = l->pt->first_page;
    a->pdiv = l->pdiv;
    a->slot_stride = l->st->slot_bytes;
    a->dtype = (int)sp->dtype;
    a->latent_dim = sp->value_dim;
    a->branch_offset = sp->branch_offset;
    a->branch_dtype = (int)sp->branch_dtype;
    a->branch_dim = sp->branch_dim;
    a->csk = sa->csk;
    a->rho = sa->rho;
    a->csk_head = sa->head ? sa->head->csk : NULL;
    a->rho_head = sa->head ? sa->head->rho : NULL;
    a->n_head = sa->n_head;
    a->csk_stride = sa->sk_stride;
    a->q8_off = sa->sk_q8;
    a->basis = l->st->rbasis.rank ? l->st->rbasis.V : NULL;
    a->rank = l->st->rbasis.rank;
    a->n_closed = sa->closed_rows;
    a->sinks = closed_sinks(sa, l->cfg);
    a->kept = sa->kept;
    a->m = (uint32_t)sa->n_kept;
    return true;
}

/* The rows [lo, hi) of the state's closed rows (whole blocks), sketched again with the store's
 * basis into the planes at csk / rho (their row lo), KVT__SAL_CHUNK blocks a backend call. */
static kvt_status resketch_rows(const kvt__env *env, const kvt__tier_layer *l, const kvt__sal *s,
                                uint64_t lo, uint64_t hi, uint16_t *csk, float *rho) {
    const uint32_t B = l->cfg->block_rows;
    kvt__sketch_args a[KVT__SAL_CHUNK];
    uint32_t k = 0;
    for (uint64_t first = lo; first < hi; first += B) {
        a[k++] = sketch_args_at(env, l->st, l->pt, s, B, first, csk + (first - lo) * s->sk_stride,
                                rho + (first - lo));
        if (k == KVT__SAL_CHUNK || first + B >= hi) {
            kvt_status rc = env->backend->ops->sketch_rows(env->backend, a, k, env->stream);
            if (rc != KVT_OK)
                return kvt__fail(env->err, env->err_len, rc,
                                 "salience: sketching the closed rows of layer %u again",
                                 l->st->layer);
            k = 0;
        }
    }
    return KVT_OK;
}

static kvt_status sal_resketch(kvt__tier_state *st, const kvt__env *env, const kvt__tier_layer *l,
                               uint32_t head, uint64_t epoch) {
    (void)head;
    kvt__sal *s = &st->sal;
    kvt__sal_tail_forget(s); /* (sketched ahead with the old basis) */
    if (s->sk_stride == 0 || s->closed_rows == 0)
        return KVT_OK;
    kvt__sal_head *h = s->head;
    if (h && h->resketch_epoch != epoch) {
        h->resketch_epoch = epoch;
        h->resketched = 0;
    }
    kvt_status rc = KVT_OK;
    if (h && s->n_head > h->resketched) { /* the rows past what another holder sketched */
        const uint64_t lo = h->resketched;
        rc = resketch_rows(env, l, s, lo, s->n_head, h->csk + lo * s->sk_stride, h->rho + lo);
        if (rc == KVT_OK)
            h->resketched = s->n_head;
    }
    if (rc == KVT_OK && s->closed_rows > s->n_head)
        rc = resketch_rows(env, l, s, s->n_head, s->closed_rows, s->csk, s->rho);
    return rc;
}

/* Archive = index partition: an archived row keeps its slot, it is only not attended. */
static kvt_row_state sal_row_state(const kvt__tier_layer *l, uint32_t head, uint64_t pos,
                                   int32_t *slot) {
    *slot = kvt__slot(l->pt, l->pdiv, pos);
    return kvt__sal_is_attended(&l->state->sal, l->cfg, pos) ? KVT_ROW_ATTENDED : KVT_ROW_ARCHIVED;
}

static void sal_stats(const kvt__tier_layer *l, kvt_layer_stats *out) {
    const kvt__sal *sa = &l->state->sal;
    uint64_t S = closed_sinks(sa, l->cfg);
    out->sink_rows = S;
    out->tail_rows = sa->n_rows - sa->closed_rows;
    out->kept_rows = out->attended_rows - S - out->tail_rows;
    out->closed_rows = sa->closed_rows;
    out->archived_rows = sa->n_rows - out->attended_rows;
    out->closes = sa->closes;
    out->nonfinite_sigma = sa->nonfinite;
    out->sigma_bytes_read = sa->score_bytes_read;
    out->recall_rank = l->st->rbasis.rank;
    out->recall_basis_id = l->st->rbasis.id;
    out->sketched_rows = sa->sk_stride ? sa->closed_rows : 0;
}

static kvt_status sal_check_counts(const kvt__tier_layer *l, char *err, size_t len) {
    if (l->state->sal.n_rows != l->pt->n_rows)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "%llu rows held, %llu appended",
                         (unsigned long long)l->pt->n_rows, (unsigned long long)l->appended);
    return kvt__none_check_counts(l, err, len);
}

static kvt_status sal_check(const kvt__tier_layer *l, char *err, size_t len) {
    const kvt__sal *sa = &l->state->sal;
    if (sa->n_rows != l->pt->n_rows)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "salience state at %llu rows, table at %llu (a policy run failed and "
                         "was not retried)",
                         (unsigned long long)sa->n_rows, (unsigned long long)l->pt->n_rows);
    kvt_status rc = kvt__sal_check(sa, l->cfg, err, len);
    return rc == KVT_OK ? check_sketches(sa, l->st->rbasis.rank, err, len) : rc;
}

static uint64_t sal_snap_size(const kvt__tier_layer *l);
static uint64_t sal_snap_sketch_stride(const uint8_t *src, uint64_t n);
static kvt_status sal_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len);
static kvt_status sal_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                                const uint8_t *src, uint64_t n);
static kvt_status sal_scores(const kvt__tier_layer *l, float *out, char *err, size_t len);

const kvt__policy_ops kvt__policy_salience = {
    .rows_are_positions = true,
    .group_init = sal_group_init,
    .group_fini = sal_group_fini,
    .layer_init = sal_layer_init,
    .layer_reset = sal_layer_reset,
    .layer_fini = sal_layer_fini,
    .group_commit = sal_group_commit,
    .layer_step = sal_layer_step,
    .step_due = sal_step_due,
    .layer_fork = sal_layer_fork,
    .layer_attach = sal_layer_attach,
    .reserve = sal_reserve_shared,
    .layer_unshare = sal_layer_unshare,
    .side_bytes = sal_side_bytes,
    .supports_layer = sal_supports_layer,
    .supports_sketch = sal_supports_sketch,
    .census = sal_census,
    .close_scratch_floats = sal_close_scratch_floats,
    .promote_room = kvt__sal_promote_room,
    .attended = sal_attended,
    .recall_view = sal_recall_view,
    .resketch = sal_resketch,
    .row_state = sal_row_state,
    .positions = kvt__none_positions,
    .stats = sal_stats,
    .check_counts = sal_check_counts,
    .check = sal_check,
    .snap_size = sal_snap_size,
    .snap_save = sal_snap_save,
    .snap_load = sal_snap_load,
    .snap_sketch_stride = sal_snap_sketch_stride,
    .scores = sal_scores,
};

/* ------------------------------------------------------------------------------------------- */
/* Snapshots (policy.h snap_*; lib/snapshot.c)                                                  */
/* ------------------------------------------------------------------------------------------- */
/* Layout: u64 n_rows, closed_rows, n_kept, kept_in_sinks, closes, nonfinite, score_bytes_read,
 * sk_stride, recall basis rank, recall basis id; f32 score[closed_rows] (canonical: no NaN);
 * u32 kept[n_kept] (ascending positions); with sk_stride > 0, the recall sketches of the closed
 * rows: f16 csk[closed_rows][sk_stride], f32 rho[closed_rows]. */
enum { SAL_SNAP_COUNTS = 10 };

static uint64_t sketch_bytes(const kvt__sal *sa, uint64_t closed) {
    return sa->sk_stride ? (sizeof(uint16_t) * sa->sk_stride + sizeof(float)) * closed : 0;
}

/* The layout's eighth u64: the sketch stride, or with the 8-bit scan's planes 2^32 + the fp16
 * width (sk_q8; the rows then hold the 8-bit plane after it: docs/snapshot-format.md). */
static uint64_t sal_snap_stride_word(const kvt__sal *sa) {
    return sa->sk_q8 ? (1ull << 32) + sa->sk_q8 : sa->sk_stride;
}

/* The eighth u64 of the layout is the sketch stride (sal_snap_stride_word). */
static uint64_t sal_snap_sketch_stride(const uint8_t *src, uint64_t n) {
    uint64_t v = 0;
    if (n >= 8 * 8)
        memcpy(&v, src + 7 * 8, sizeof v);
    return v;
}

static uint64_t sal_snap_size(const kvt__tier_layer *l) {
    const kvt__sal *sa = &l->state->sal;
    return 8 * SAL_SNAP_COUNTS + sizeof(float) * sa->closed_rows + sizeof(uint32_t) * sa->n_kept +
           sketch_bytes(sa, sa->closed_rows);
}

static kvt_status sal_snap_save(const kvt__tier_layer *l, uint8_t *dst, char *err, size_t len) {
    const kvt__sal *sa = &l->state->sal;
    uint64_t v[SAL_SNAP_COUNTS] = {sa->n_rows,        sa->closed_rows,     sa->n_kept,
                                   sa->kept_in_sinks, sa->closes,          sa->nonfinite,
                                   sa->score_bytes_read, sal_snap_stride_word(sa), l->st->rbasis.rank,
                                   l->st->rbasis.id};
    kvt__snap_cur c = {.w = dst};
    kvt__snap_put(&c, v, sizeof v);
    /* The planes are in the backend's memory: read through it, straight into the snapshot. */
    kvt_status rc = KVT_OK;
    if (sa->closed_rows)
        rc = planes_read(sa, 0, c.w, sa->closed_rows);
    c.w += sizeof *sa->score * sa->closed_rows;
    if (rc == KVT_OK && sa->n_kept)
        rc = sa->be->ops->read(sa->be, c.w, sa->kept, sizeof *sa->kept * sa->n_kept, NULL);
    c.w += sizeof *sa->kept * sa->n_kept;
    const size_t n_csk = sizeof *sa->csk * sa->sk_stride * sa->closed_rows;
    if (rc == KVT_OK && n_csk)
        rc = planes_read(sa, 1, c.w, sa->closed_rows);
    c.w += n_csk;
    if (rc == KVT_OK && sa->sk_stride && sa->closed_rows)
        rc = planes_read(sa, 2, c.w, sa->closed_rows);
    return rc == KVT_OK ? KVT_OK : kvt__fail(err, len, rc, "salience: reading the side planes");
}

static kvt_status sal_snap_load(kvt__tier_state *s, const kvt__env *env, const kvt__tier_layer *l,
                                const uint8_t *src, uint64_t n) {
    const kvt_config *cfg = l->cfg;
    const uint32_t B = cfg->block_rows;
    kvt__snap_cur c = {.r = src, .left = n};
    uint64_t v[SAL_SNAP_COUNTS];
    if (!kvt__snap_get(&c, v, sizeof v))
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "salience state: %llu bytes, the counts need %zu",
                         (unsigned long long)n, sizeof v);
    kvt__sal t = {.n_rows = v[0], .closed_rows = v[1], .n_kept = v[2], .kept_in_sinks = v[3],
                  .closes = v[4], .nonfinite = v[5], .score_bytes_read = v[6]};
    kvt__sal *sa = &s->sal;
    if (v[7] != sal_snap_stride_word(sa) || v[8] != l->st->rbasis.rank ||
        v[9] != l->st->rbasis.id)
        return kvt__fail(env->err, env->err_len, KVT_ERR_MISMATCH,
                         "salience state of layer %u: recall sketches of %llu values with basis "
                         "rank %llu id %08llx; this context: %llu values, rank %u id %08x",
                         l->st->layer, (unsigned long long)v[7], (unsigned long long)v[8],
                         (unsigned long long)v[9], (unsigned long long)sal_snap_stride_word(sa),
                         l->st->rbasis.rank,
                         (unsigned)l->st->rbasis.id);
    const uint64_t room = kvt__sal_promote_room(t.closed_rows, cfg);
    if (t.closed_rows <= t.n_rows && t.closed_rows % B == 0 &&
        t.n_kept != kvt__sal_m(t.closed_rows, cfg) && t.n_kept <= budget_m(t.closed_rows, cfg) &&
        t.n_kept + (1u << 16) >= budget_m(t.closed_rows, cfg)) /* a promotion reserve's */
        return kvt__fail(env->err, env->err_len, KVT_ERR_MISMATCH,
                         "salience state of layer %u: %llu kept rows of %llu closed; this context "
                         "keeps %llu with %llu reserved for recall promotion (a snapshot of a "
                         "request with another config.recall_promote_capacity or recall mode)",
                         l->st->layer, (unsigned long long)t.n_kept,
                         (unsigned long long)t.closed_rows,
                         (unsigned long long)kvt__sal_m(t.closed_rows, cfg),
                         (unsigned long long)room);
    const char *bad = NULL;
    if (t.n_rows != l->pt->n_rows)
        bad = "rows differ from the page table's";
    else if (t.closed_rows > t.n_rows || t.closed_rows % B != 0 || t.closed_rows > UINT32_MAX)
        bad = "closed rows not whole blocks inside the rows";
    else if (t.n_kept != kvt__sal_m(t.closed_rows, cfg) || t.kept_in_sinks > t.n_kept)
        bad = "kept count is not m of the closed rows";
    else if (t.closes != t.closed_rows / B || t.nonfinite > t.closed_rows ||
             t.score_bytes_read != t.closed_rows * score_bytes_per_row(cfg, &l->st->spec))
        bad = "close counters disagree with the closed rows";
    if (bad)
        return kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT,
                         "salience state: %s (rows %llu, closed %llu, kept %llu, closes %llu)",
                         bad, (unsigned long long)t.n_rows, (unsigned long long)t.closed_rows,
                         (unsigned long long)t.n_kept, (unsigned long long)t.closes);
    const uint8_t *sp = kvt__snap_take_n(&c, t.closed_rows, sizeof(float));
    const uint8_t *kp = sp ? kvt__snap_take_n(&c, t.n_kept, sizeof(uint32_t)) : NULL;
    const uint64_t skb = sketch_bytes(sa, t.closed_rows);
    const uint8_t *skp = kp && skb ? kvt__snap_take_n(&c, skb, 1) : kp;
    if (!kp || !skp || c.left != 0)
        return kvt__fail(env->err, env->err_len, KVT_ERR_PARSE,
                         "salience state: %llu bytes for %llu scores and %llu kept rows",
                         (unsigned long long)n, (unsigned long long)t.closed_rows,
                         (unsigned long long)t.n_kept);
    /* Host copies (the bytes of src need not be aligned) checked as kvt_seq_check would, before
     * the planes are allocated. */
    const kvt__alloc *a = env->alloc;
    float *score = t.closed_rows ? kvt__malloc(a, sizeof *score * t.closed_rows) : NULL;
    uint32_t *kept = t.n_kept ? kvt__malloc(a, sizeof *kept * t.n_kept) : NULL;
    kvt_status rc = KVT_OK;
    if ((t.closed_rows && !score) || (t.n_kept && !kept))
        rc = kvt__fail(env->err, env->err_len, KVT_ERR_OUT_OF_MEMORY, "salience state: copies");
    if (rc == KVT_OK) {
        if (t.closed_rows)
            memcpy(score, sp, sizeof *score * t.closed_rows);
        if (t.n_kept)
            memcpy(kept, kp, sizeof *kept * t.n_kept);
        char msg[KVT__ERR_LEN];
        if (check_host(&t, cfg, score, kept, msg, sizeof msg) != KVT_OK)
            rc = kvt__fail(env->err, env->err_len, KVT_ERR_CORRUPT, "salience state: %s", msg);
    }
    if (rc == KVT_OK && sa->head) /* a restore fills a fresh request, which shares nothing */
        rc = kvt__fail(env->err, env->err_len, KVT_ERR_INVARIANT,
                       "salience state: restoring into a request that shares planes");
    if (rc == KVT_OK && (rc = sal_reserve(sa, t.closed_rows, t.n_kept, 0, NULL)) != KVT_OK)
        kvt__fail(env->err, env->err_len, rc, "salience state: side planes");
    if (rc == KVT_OK && t.closed_rows &&
        (rc = sa->be->ops->write(sa->be, sa->score, score, sizeof *score * t.closed_rows,
                                 NULL)) != KVT_OK)
        kvt__fail(env->err, env->err_len, rc, "salience state: writing the score plane");
    if (rc == KVT_OK && t.n_kept &&
        (rc = sa->be->ops->write(sa->be, sa->kept, kept, sizeof *kept * t.n_kept, NULL)) !=
            KVT_OK)
        kvt__fail(env->err, env->err_len, rc, "salience state: writing the kept set");
    /* The sketches: checked with the rest by the kvt_seq_check that ends every restore. */
    const size_t n_csk = sizeof *sa->csk * sa->sk_stride * t.closed_rows;
    if (rc == KVT_OK && skb &&
        ((rc = sa->be->ops->write(sa->be, sa->csk, skp, n_csk, NULL)) != KVT_OK ||
         (rc = sa->be->ops->write(sa->be, sa->rho, skp + n_csk, sizeof *sa->rho * t.closed_rows,
                                  NULL)) != KVT_OK))
        kvt__fail(env->err, env->err_len, rc, "salience state: writing the sketch planes");
    if (rc == KVT_OK) {
        sa->n_rows = t.n_rows;
        sa->closed_rows = t.closed_rows;
        kvt__sal_tail_forget(sa);
        sa->n_kept = t.n_kept;
        sa->kept_in_sinks = t.kept_in_sinks;
        sa->closes = t.closes;
        sa->nonfinite = t.nonfinite;
        sa->score_bytes_read = t.score_bytes_read;
    }
    kvt__free(a, score, sizeof *score * t.closed_rows);
    kvt__free(a, kept, sizeof *kept * t.n_kept);
    return rc;
}

static kvt_status sal_scores(const kvt__tier_layer *l, float *out, char *err, size_t len) {
    const kvt__sal *sa = &l->state->sal;
    kvt_status rc = KVT_OK;
    if (sa->closed_rows)
        rc = planes_read(sa, 0, out, sa->closed_rows);
    return rc == KVT_OK ? KVT_OK : kvt__fail(err, len, rc, "salience: reading the score plane");
}
