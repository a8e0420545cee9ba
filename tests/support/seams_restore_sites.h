/* The allocation sites of kvt_seq_restore (tests/test_seams.c). */
"backend_cpu.c:cpu_buf_alloc", "evict_state.c:read_strided", "pool.c:kvt__ptable_reserve",
    "salience.c:kvt__sal_check", "salience.c:sal_snap_load", "seq_inspect.c:check_pages",
    "sequence.c:seq_build", "snapshot.c:parse",
