"""Context.estimate (kvt_ctx_estimate): a context's memory before it is created, per policy
group, checked against the context then built on real model configs: the pool's bytes are its
planes' (Context.layer_data), n_pages_needed pages admit max_seqs requests of max_rows_per_seq
rows with none to spare, and the side planes are what Context.memory() counts."""

import pytest

import kvtier

from conftest import small_config


@pytest.mark.parametrize("file,page_rows,max_seqs,max_rows,sketch_rank", [
    ("llama-3.1-8b.json", 16, 2, 100, 0),
    ("kimi-linear-48b-a3b-instruct.json", 64, 3, 300, 64),
    ("gemma-3-1b-it.json", 32, 2, 90, 0),
])
def test_estimate_is_what_the_context_allocates(models, file, page_rows, max_seqs, max_rows,
                                                sketch_rank):
    params = dict(page_rows=page_rows, n_pages=5, allocator="libc", max_seqs=max_seqs,
                  max_rows_per_seq=max_rows, recall_sketch_rank=sketch_rank or None)
    with kvtier.Model.from_file(models / file) as m:
        e = kvtier.Context.estimate(m, small_config(), **params)
        per_seq = -(-max_rows // page_rows)
        assert e["n_pages_needed"] == max_seqs * per_seq
        assert e["pool_bytes"] == sum(g["pool_bytes"] for g in e["groups"])
        assert all(g["pool_bytes"] == 5 * g["page_bytes"] for g in e["groups"])
        params["n_pages"] = e["n_pages_needed"]
        with kvtier.Context(m, small_config(), **params) as ctx:
            planes = [0] * len(e["groups"])
            first = {}
            for layer in range(ctx.n_layers):
                g = ctx.layer_group(layer)
                if g < 0:
                    continue
                assert e["groups"][g]["policy"] == ctx.layer_policy(layer)
                first.setdefault(g, layer)
                for plane in range(ctx.layer_spec(layer).n_planes):
                    planes[g] += ctx.layer_data(layer, plane)[1]
            assert planes == [g["page_bytes"] * e["n_pages_needed"] for g in e["groups"]]
            assert sum(planes) == e["pool_bytes_needed"]
            seqs = [ctx.sequence(i + 1) for i in range(max_seqs)]
            assert ctx.memory()["side_bytes"] == e["side_bytes"]
            if sketch_rank:
                assert e["side_bytes"] > 0
            b = ctx.batch(max_seqs)
            b.reserve(seqs, [max_rows] * max_seqs)
            assert [ctx.free_pages(first[g]) for g in sorted(first)] == [0] * len(first)


def test_estimate_refuses_without_the_limits(llama):
    with pytest.raises(kvtier.InvalidArgumentError, match="max_rows_per_seq"):
        kvtier.Context.estimate(llama, page_rows=16)
    with pytest.raises(kvtier.InvalidArgumentError, match="page_rows"):
        kvtier.Context.estimate(llama, page_rows=0, max_seqs=1, max_rows_per_seq=10)
    e = kvtier.Context.estimate(llama, max_seqs=4, max_rows_per_seq=8192)
    (g,) = e["groups"]
    assert g["policy"] == kvtier.Policy.EVICT and g["n_layers"] == 32
    assert g["row_bytes"] == 32 * 2 * 8 * 128 * 2  # layers x K,V x KV heads x head_dim x bf16
    # the default n_pages (1024) of 64 rows: 8 GiB a context, the 8.6 GB
    assert e["pool_bytes"] == 1024 * 64 * g["row_bytes"] == 8 << 30
    assert e["n_pages_needed"] == 4 * 8192 // 64 and e["pool_bytes_needed"] == 4 << 30
