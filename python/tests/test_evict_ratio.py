"""config.evict_ratio_budget from Python: random eviction's K from each request's ratio (K =
max(r, P + ceil((T - P) / ratio))), where the default keeps evict_budget_rows for every request
(a request shorter than K + r + c is never evicted, whatever its ratio)."""

import kvtier


def _run(ratio_budget: bool, ratios, tokens: int):
    specs = [kvtier.LayerSpec.gqa(kvtier.LayerKind.GQA_ROPE, kvtier.DType.FP16, 2, 16)]
    cfg = kvtier.Config(ratio=8, recent_rows=8, cadence_rows=8,
                        evict_ratio_budget=ratio_budget)
    assert cfg.evict_ratio_budget is ratio_budget
    with kvtier.Model(specs, "gqa") as m, \
            kvtier.Context(m, cfg, page_rows=16, n_pages=512, allocator="libc") as ctx:
        seqs = [ctx.sequence(i + 1, prompt_rows=40, ratio=q) for i, q in enumerate(ratios)]
        b = ctx.batch(len(seqs))
        b.reserve(seqs, [40] * len(seqs))
        b.plan()
        b.commit()
        for _ in range(40, tokens):
            b.reserve(seqs, [1] * len(seqs))
            b.plan()
            b.commit()
        for s in seqs:
            s.check()
        return [s.layer_stats(0).attended_rows for s in seqs]


def test_ratio_budget_keeps_each_requests_ratio():
    assert kvtier.Config().evict_ratio_budget is False
    # 1000 tokens, the prompt's 40 kept: 40 + ceil(960 / q) + [8, 16) rows attended
    a4, a8 = _run(True, [4, 8], 1000)
    assert 280 + 8 <= a4 < 280 + 16
    assert 160 + 8 <= a8 < 160 + 16
    # off: K = 1024 for both, nothing evicted at 1000 tokens
    assert _run(False, [4, 8], 1000) == [1000, 1000]
