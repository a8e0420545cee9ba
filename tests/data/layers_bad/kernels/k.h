/* fixture */
int kvt__fixture_kernel(void);
