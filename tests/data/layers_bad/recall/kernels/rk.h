/* fixture: a header of recall/kernels/ (recall's per-element math, at the kernels rank) */
int kvt__fixture_recall_kernel(void);
