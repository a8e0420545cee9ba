/* The allocation sites of kvt_ctx_create common to every backend (tests/test_seams.c). */
"context.c:build_groups", "context.c:ctx_create", "model.c:kvt_model_create",
    "pool.c:kvt__pool_init", "salience.c:kvt__sal_shared_init",
