/* The other half of c1.c's cycle. */
int kvt__fixture_lib_one(int n);

int kvt__fixture_lib_two(int n) {
    return kvt__fixture_lib_one(n);
}
