/* fixture: a header of recall/ (its trigger's state), above the kernels rank */
int kvt__fixture_recall(void);
