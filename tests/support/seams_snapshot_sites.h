/* kvt_seq_snapshot allocates nothing (tests/test_seams.c). */
