/* test_needle.c — placeholder (filled in below). */
#include <criterion/criterion.h>
#include "needle.h"
Test(needle, placeholder) { cr_assert(1); }
