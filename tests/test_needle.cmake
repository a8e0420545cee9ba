# test_needle: links the needle suite's engine (tools/needle/core). When the tools are not built
# (KVT_BUILD_TOOLS=OFF) the library is built here from the same sources, with the eigenvector
# fit of tools/common/eigen.c but without LAPACKE (the adaptive-basis floor then skips, saying so).
if(NOT TARGET kvtier_needle_core)
  file(GLOB KVT_NEEDLE_CORE_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tools/needle/core/*.c)
  add_library(kvtier_needle_core STATIC ${KVT_NEEDLE_CORE_SOURCES}
    ${PROJECT_SOURCE_DIR}/tools/common/eigen.c)
  target_include_directories(kvtier_needle_core PUBLIC ${PROJECT_SOURCE_DIR}
    ${PROJECT_SOURCE_DIR}/tools/needle/core)
  target_link_libraries(kvtier_needle_core PUBLIC kvtier_static ${KVT_LIBM})
endif()
target_link_libraries(${t} PRIVATE kvtier_needle_core)
# The floors run 8k and 32k haystacks through the manager: give them room on a slow machine
# (five entries: tests/CMakeLists.txt, KVT_TEST_PARTS_test_needle).
set_tests_properties(${${t}_entries} PROPERTIES TIMEOUT 600)
# The σ-basis and drifting-branch flags (issue 10 item 9). These use the expectation script
# tests/scripts/needle.cmake writes (its path is fixed; the scripts are read after this file, and
# the script exists by the time any test runs).
if(TARGET kvtier-needle)
  set(KVT_NEEDLE_EXPECT_EDGES ${CMAKE_CURRENT_BINARY_DIR}/needle_expect.cmake)
  function(kvt_needle_edges_cli name rc args)
    add_test(NAME needle_cli_${name}
      COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle> "-DARGS=${args}" -DRC=${rc}
              ${ARGN} -P ${KVT_NEEDLE_EXPECT_EDGES})
  endfunction()
  kvt_needle_edges_cli(bad_branch 2 "--branch|wiggly" "-DERR=bad --branch 'wiggly' \\(smooth\\|drift\\)")
  kvt_needle_edges_cli(branch_needs_value 2 "--branch")
  kvt_needle_edges_cli(bad_sigma_basis 2 "--sigma-basis|haar"
    "-DERR=bad --sigma-basis 'haar' \\(fourier\\|dct\\)")
  kvt_needle_edges_cli(bad_calib_basis 2 "--calib-basis|dst"
    "-DERR=bad --calib-basis 'dst' \\(fourier\\|dct\\)")
  kvt_needle_edges_cli(trace_refuses_calib_basis 2
    "--trace|${PROJECT_SOURCE_DIR}/tests/golden/mla_bf16.kvtt|--calib-basis|dct"
    "-DERR=--calib-basis shapes the synthetic haystack and does not apply to --trace")
  kvt_needle_edges_cli(trace_refuses_branch 2
    "--trace|${PROJECT_SOURCE_DIR}/tests/golden/mla_bf16.kvtt|--branch|drift"
    "-DERR=--branch shapes the synthetic haystack and does not apply to --trace")
  # --sigma-basis is a manager flag: it applies to a trace too.
  kvt_needle_edges_cli(trace_takes_sigma_basis 0
    "--trace|${PROJECT_SOURCE_DIR}/tests/golden/mla_bf16.kvtt|--layer|3|--block|64|--kappa|4|--sigma-basis|dct|--no-progress"
    "-DOUT=\npass 0/0\n$")
  # --edges prints one line per (mode, context, ratio) of the salience policy after the table;
  # without it nothing of the kind is printed.
  kvt_needle_edges_cli(edges_table 0
    "--context|4k|--block|1024|--kappa|8|--ratio|8,32|--branch|drift|--sigma-basis|dct|--edges|--no-progress"
    "-DOUT=\nblock edges: [^\n]*\nmode +rope +context +ratio +replays +kept +near +share +chance\nsalience +no +4k +8 +1 +[0-9]+ +[0-9]+ +[0-9.]+% +[0-9.]+%\nsalience +no +4k +32 +1 +[0-9]+ +[0-9]+ +[0-9.]+% +[0-9.]+%\n")
  kvt_needle_edges_cli(no_edges_without_flag 0
    "--context|4k|--block|1024|--kappa|8|--ratio|32|--branch|drift|--no-progress"
    "-DNOT_OUT=block edges")
endif()
