#!/usr/bin/env bash
# valgrind.sh COMMAND [ARGS...] — run one test under valgrind's memcheck (test.sh, configuration
# build-test-valgrind; tests/CMakeLists.txt prefixes the tests labelled "fast" with it when
# KVT_VALGRIND=ON).
#
# Criterion runs every test body in a child process it spawns and reports the child's result
# over a pipe before the child exits, so valgrind's --error-exitcode in a child never reaches
# ctest. Hence --trace-children=yes (the bodies run under memcheck too), one log per process
# (%p), and the verdict taken from the logs: any process with an error, or a definite leak
# (--errors-for-leak-kinds=definite), fails the test and its log is printed.
# KVT_UNDER_VALGRIND=1 tells the tests where valgrind cannot follow (the guarded backend's
# protection keys) to skip with a message.
set -u
logs=$(mktemp -d "${TMPDIR:-/tmp}/kvt-valgrind.XXXXXX")
trap 'rm -rf "$logs"' EXIT
export KVT_UNDER_VALGRIND=1
valgrind --tool=memcheck --trace-children=yes --leak-check=full --errors-for-leak-kinds=definite \
  --show-leak-kinds=definite --error-exitcode=99 --num-callers=30 --log-file="$logs/%p.log" "$@"
rc=$?
bad=$(grep -l "ERROR SUMMARY: [1-9]" "$logs"/*.log 2>/dev/null)
if [ -n "$bad" ]; then
  echo "valgrind.sh: memcheck errors in $(echo "$bad" | wc -l) process(es) of: $*" >&2
  cat $bad >&2
  exit 1
fi
[ "$rc" -eq 0 ] || echo "valgrind.sh: exit status $rc: $*" >&2
exit "$rc"
