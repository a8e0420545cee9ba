"""A real decode loop through the batch API, on layers taken from the real model configs: the
salience layer of Kimi Linear (MLA-NoPE, 576 bf16 values), a random-eviction layer of Llama 3.1
(GQA-RoPE, 8 KV heads of 128, K and V planes) and a Kimi KDA layer (no per-token KV). Two
requests, a chunked prefill, then one token per request per step. Every step checks what the C
tests check: kvt_seq_check clean, the emitted attended sets (both layouts) equal what the policy
must choose — for salience, sinks ∪ top-m by σ (computed independently with kvtier.ref.Sigma on
the rows we wrote) ∪ tail; for eviction, K + r rows after a round at K + r + c, every prompt row
and the newest r kept, per-head keep sets, rows byte-exact after compaction — and the counter
identity attended x heads + archived + dropped = appended."""

import numpy as np
import pytest

import kvtier
from kvtier import LayerKind, RowState

B, KAPPA, RATIO, SINKS = 64, 4, 8, 4
K, R, C = 48, 8, 8
PAGE_ROWS = 16
SAL, EVI, NOKV = 0, 1, 2


def mla_rows(rng, n):
    """bf16 MLA rows: a random latent and a 64-dim branch made of a smooth drift plus noise of a
    per-row amplitude, so σ (the high-frequency residual) spreads over two decades."""
    latent = rng.standard_normal((n, 512)).astype(np.float32)
    t = rng.uniform(0, 2 * np.pi, size=(1, 64))
    drift = np.sin(np.arange(n)[:, None] * 0.02 + t).astype(np.float32) * 4
    amp = np.exp(rng.uniform(-3, 1, size=(n, 1))).astype(np.float32)
    branch = drift + amp * rng.standard_normal((n, 64)).astype(np.float32)
    return kvtier.bf16_from_float32(np.concatenate([latent, branch], axis=1)).view(np.uint8)


def expected_salience(rows_u8, n, sigma):
    """Attended positions after n committed rows: sinks ∪ top-m by σ over closed rows (ties to
    the lower position) ∪ the unclosed tail."""
    closed = n // B * B
    if closed == 0:
        return set(range(n))
    scores = np.concatenate([sigma.block(rows_u8[b:b + B], 1024, kvtier.DType.BF16)
                             for b in range(0, closed, B)])
    scores = np.where(np.isfinite(scores), scores, np.inf)
    m = max(1, (closed + RATIO // 2) // RATIO)
    order = np.lexsort((np.arange(closed), -scores))  # σ descending, then position ascending
    return set(range(min(SINKS, closed))) | set(order[:m].tolist()) | set(range(closed, n))


@pytest.fixture
def decode_setup(kimi, llama):
    specs = [kimi[3], llama[0], kimi[0]]
    assert specs[0].kind == LayerKind.MLA_NOPE and specs[1].kind == LayerKind.GQA_ROPE
    assert specs[2].kind == LayerKind.NO_KV
    with kvtier.Model(specs, "kimi+llama") as model, \
            kvtier.Context(model, kvtier.Config(block_rows=B, kappa=KAPPA, ratio=RATIO,
                                                sink_rows=SINKS, evict_budget_rows=K,
                                                recent_rows=R, cadence_rows=C, seed=1234),
                           page_rows=PAGE_ROWS, n_pages=96, allocator="libc") as ctx:
        yield ctx


def test_decode_loop_salience_and_random_eviction(decode_setup):
    ctx = decode_setup
    rng = np.random.default_rng(7)
    sigma = kvtier.ref.Sigma(B, KAPPA, 64)
    evi = ctx.layer_spec(EVI)
    prompts = [40, 24]
    seqs = [ctx.sequence(request_id=100 + i, prompt_rows=p) for i, p in enumerate(prompts)]
    batch = ctx.batch(max_seqs=2)
    # Everything written, by request and position: the salience rows and both evict planes.
    sal_rows = [np.empty((0, 1152), np.uint8) for _ in seqs]
    evi_rows = [[np.empty((0, evi.slot_bytes), np.uint8) for _ in range(2)] for _ in seqs]
    sal_slot = [dict() for _ in seqs]  # salience slots never move: slot -> position
    evi_n = [0, 0]                     # rows the evict layer must hold after each step
    rounds = [0, 0]
    plane_sal = ctx.plane(SAL, 0)      # zero-copy bf16 view (uint16 bits): the cache-write path
    steps = [prompts] + [[1, 1]] * 290
    saw_close = saw_round_in_run = False
    for step, n_new in enumerate(steps):
        batch.reserve(seqs, n_new)
        assert [s.pending for s in seqs] == n_new
        # vLLM's slot_mapping per group, equal to the per-request reserved slots.
        maps = {layer: batch.slot_mapping(layer) for layer in (SAL, EVI)}
        t = 0
        for i, s in enumerate(seqs):
            for j in range(n_new[i]):
                for layer in (SAL, EVI):
                    assert maps[layer][t] == s.reserved_slot(layer, j)
                sal_slot[i][int(maps[SAL][t])] = s.length + j
                t += 1
        # The step's rows: salience through the plane view at slot_mapping, evict K through
        # kvt_layer_write slot by slot, evict V through kvt_seq_write per request.
        t = 0
        for i, s in enumerate(seqs):
            new = mla_rows(rng, n_new[i])
            plane_sal[maps[SAL][t:t + n_new[i]], 0] = new.view(np.uint16)
            sal_rows[i] = np.concatenate([sal_rows[i], new])
            for plane in range(2):
                rows = rng.integers(0, 256, size=(n_new[i], evi.n_kv_heads, evi.row_bytes),
                                    dtype=np.uint8)
                if plane == 0:
                    for j in range(n_new[i]):
                        ctx.layer_write(EVI, 0, int(maps[EVI][t + j]), rows[j:j + 1])
                else:
                    s.write(EVI, 1, 0, rows.view(np.uint16))  # bf16 bits as elements
                evi_rows[i][plane] = np.concatenate(
                    [evi_rows[i][plane], rows.reshape(n_new[i], -1)])
            t += n_new[i]
        batch.plan()
        topk, total = batch.capacity(SAL)
        assert topk == max(s.length + n for s, n in zip(seqs, n_new))
        assert total == sum(s.length + n for s, n in zip(seqs, n_new))
        emitted = {}
        for layer in (SAL, EVI):
            tok = batch.run(layer, "tokens", want_dense=True)
            csr = batch.run(layer, "csr")  # a second run of a layer only emits
            for i in range(2):
                assert np.array_equal(tok.slots(i), csr.slots(i))
                assert np.all(np.diff(tok.slots(i)) != 0)
                assert np.all(tok.indices[i, tok.lengths[i]:] == -1)
            assert not tok.dense.any()  # recall is off
            emitted[layer] = tok
        with pytest.raises(kvtier.PolicyMismatchError):
            batch.run(NOKV)
        batch.commit()
        for i, s in enumerate(seqs):
            n = s.length
            assert n == sal_rows[i].shape[0]
            s.check()
            # Salience: the emitted set is exactly sinks ∪ top-m σ ∪ tail.
            got = {sal_slot[i][int(x)] for x in emitted[SAL].slots(i)}
            assert got == expected_salience(sal_rows[i], n, sigma), f"step {step} req {i}"
            st = s.layer_stats(SAL)
            assert st.attended_rows == len(got)
            assert st.closed_rows == n // B * B and st.closes == n // B
            assert st.attended_rows + st.archived_rows + st.dropped_rows == st.appended_rows == n
            saw_close |= st.closed_rows > 0 and n % B == 0
            # Eviction: a round at K + r + c rows brings the cache back to K + r.
            evi_n[i] += n_new[i]
            if evi_n[i] >= K + R + C:
                evi_n[i] = K + R
                rounds[i] += 1
            se = s.layer_stats(EVI)
            assert se.rounds == rounds[i] and se.attended_rows == evi_n[i]
            assert emitted[EVI].lengths[i] == evi_n[i]
            assert (se.attended_rows * evi.n_kv_heads + se.archived_rows + se.dropped_rows ==
                    se.appended_rows == n * evi.n_kv_heads)
            pages, n_rows = s.block_table(EVI)
            assert n_rows == evi_n[i]
            idx = np.arange(n_rows)
            table_slots = pages[idx // PAGE_ROWS] * PAGE_ROWS + idx % PAGE_ROWS
            assert np.array_equal(emitted[EVI].slots(i), table_slots)
            just_rounded = n_new[i] == 1 and evi_n[i] == K + R and rounds[i] > 0
            if just_rounded:
                saw_round_in_run = True
                keep_sets = []
                for h in range(evi.n_kv_heads):
                    pos = s.positions(EVI, h)
                    assert len(pos) == K + R and np.all(np.diff(pos) > 0)
                    assert set(range(prompts[i])) <= set(pos.tolist())  # prompt protected
                    assert set(range(n - R, n)) <= set(pos.tolist())    # recent window
                    keep_sets.append(tuple(pos.tolist()))
                    smap = s.last_slot_map(EVI, h)
                    assert len(smap) == K + R + C
                    assert sorted(smap[smap >= 0].tolist()) == list(range(K + R))
                    for p_idx in (0, len(pos) // 2, len(pos) - 1):  # bytes survive compaction
                        p = int(pos[p_idx])
                        for plane in range(2):
                            row = s.read_row(EVI, plane, h, p)
                            ref = evi_rows[i][plane][p].reshape(evi.n_kv_heads, -1)[h]
                            assert np.array_equal(row, ref)
                    dropped = sorted(set(range(n)) - set(pos.tolist()))
                    if dropped:
                        assert s.row_state(EVI, h, dropped[0])[0] == RowState.DROPPED
                        with pytest.raises(kvtier.DroppedError):
                            s.read_row(EVI, 0, h, dropped[0])
                # Per-KV-head draws: the heads do not all keep the same rows (the union trap).
                assert len(set(keep_sets)) > 1
        if step % 32 == 0 or step == len(steps) - 1:
            for i, s in enumerate(seqs):  # every position's state and the archive's bytes
                want = expected_salience(sal_rows[i], s.length, sigma)
                for p in range(s.length):
                    state, slot = s.row_state(SAL, 0, p)
                    assert state == (RowState.ATTENDED if p in want else RowState.ARCHIVED)
                    if p % 13 == 0:
                        assert np.array_equal(s.read_row(SAL, 0, 0, p), sal_rows[i][p])
    assert saw_close and saw_round_in_run
    assert all(r > 20 for r in rounds)
    assert seqs[0].layer_stats(SAL).archived_rows > 0
    sigma.close()
    batch.close()
