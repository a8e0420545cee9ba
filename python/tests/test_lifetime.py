"""Handles are freed once, in a safe order: a batch or sequence never outlives its C context,
kvt_ctx_destroy's own destruction of live batches and sequences is not repeated from Python, and
views pin the memory they show. Each scenario runs in a fresh interpreter with glibc's heap
checks on (MALLOC_CHECK_=3, libc allocator), so a double free or use after free aborts it."""

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import gc, numpy as np, kvtier
specs = [kvtier.LayerSpec.mla(), kvtier.LayerSpec.gqa("gqa_rope", "fp16", 2, 16)]
model = kvtier.Model(specs)
cfg = kvtier.Config(block_rows=64, kappa=4, ratio=8, evict_budget_rows=32, recent_rows=8,
                    cadence_rows=8)
def mk():
    return kvtier.Context(model, cfg, page_rows=16, n_pages=32, allocator="libc")
def step(ctx, b, seqs, n, run=True, commit=True):
    b.reserve(seqs, n)
    for s in seqs:
        s.write(0, 0, 0, np.ones((n, 1152), np.uint8))
        for p in range(2):
            s.write(1, p, 0, np.ones((n, 64), np.uint8))
    b.plan()
    if run:
        b.run(0); b.run(1)
    if commit:
        b.commit()
"""

SCENARIOS = {
    # the context closed with a step in flight after a run: kvt_ctx_destroy frees the batch and
    # the requests; their Python objects become closed and are not freed again
    "ctx_close_mid_step": """
        ctx = mk(); s = ctx.sequence(1); b = ctx.batch(1)
        step(ctx, b, [s], 5, commit=False)
        ctx.close()
        assert b.closed and s.closed and ctx.closed
        try:
            b.commit()
        except ValueError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("use after close")
        del b, s; gc.collect()
    """,
    # with-blocks in the natural nesting order
    "with_blocks": """
        with mk() as ctx, ctx.batch(2) as b, ctx.sequence(1) as s1, ctx.sequence(2) as s2:
            for _ in range(70):
                step(ctx, b, [s1, s2], 1)
            s1.check(); s2.check()
        assert b.closed and s1.closed and ctx.closed
    """,
    # the context object dropped first: the batch and sequence keep it alive and still work
    "gc_keeps_parent": """
        ctx = mk(); s = ctx.sequence(1); b = ctx.batch(1)
        del ctx; gc.collect()
        step(b.context, b, [s], 3)
        assert s.length == 3
        del s; gc.collect()
        del b; gc.collect()
    """,
    # a reference cycle holding the context, its batch and sequences: the collector frees them
    # in whatever order; the handles still free the C objects children first
    "cycle": """
        for _ in range(20):
            ctx = mk(); s = ctx.sequence(1); b = ctx.batch(1)
            step(ctx, b, [s], 2, commit=False)
            ctx.keep = [s, b]; s.ctx_again = ctx; b.me = b
            del ctx, s, b
            gc.collect()
    """,
    # a plane view outlives close(): the C context goes when the view goes
    "view_outlives_close": """
        ctx = mk(); v = ctx.plane(1, 0); s = ctx.sequence(1); b = ctx.batch(1)
        step(ctx, b, [s], 4)
        ctx.close()
        assert s.closed and b.closed
        assert v.sum() > 0       # still readable memory
        v[:] = np.float16(3)     # and writable: nothing freed under it
        m = None
        del v; gc.collect()
    """,
    # a borrowed model (kvt_ctx_model) is closed with its context, never freed by itself
    "borrowed_model": """
        ctx = mk(); m = ctx.model
        assert len(m) == 2 and m.layers[0].head_dim == 576
        ctx.close()
        assert m.closed
        try:
            len(m)
        except ValueError:
            pass
        else:
            raise AssertionError("a borrowed model outlived its context")
        m.close(); del m; gc.collect()
    """,
    # batch destroyed explicitly after a run without commit, then the requests and the context
    "batch_close_after_run": """
        ctx = mk(); s = ctx.sequence(1); b = ctx.batch(1)
        step(ctx, b, [s], 4, commit=False)
        b.close(); s.close(); ctx.close()
    """,
    # external storage: the bound array must stay alive as long as the C context
    "bound_memory_pinned": """
        ctx = kvtier.Context(model, cfg, page_rows=16, n_pages=4, external_storage=True)
        ctx.layer_bind(0, 0, np.zeros(4 * 16 * 1152, np.uint8))
        ctx.layer_bind(1, 0, np.zeros(4 * 16 * 64, np.uint8))
        ctx.layer_bind(1, 1, np.zeros(4 * 16 * 64, np.uint8))
        gc.collect()
        s = ctx.sequence(1); b = ctx.batch(1)
        step(ctx, b, [s], 10)
        assert np.array_equal(s.read_row(0, 0, 0, 9), np.ones(1152, np.uint8))
        ctx.close()
    """,
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_lifetime(name):
    code = PRELUDE + textwrap.dedent(SCENARIOS[name]) + "\nprint('ok')\n"
    env = dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr
