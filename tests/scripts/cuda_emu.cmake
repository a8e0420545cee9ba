# The CUDA emulation's test entries (-DKVT_CUDA_EMU=ON, docs/cuda-emulation.md; test.sh's
# build-test-cuda-emu): every CUDA case of the suite with KVT_REQUIRE_GPU=1 (a skip is a failure),
# labelled cuda_emu, so `ctest -L cuda_emu` runs them and nothing else:
#   test_cuda (every op against its CPU twin), test_paged's CUDA case (KVT_EMIT_PAGED planned and
#   eager, an older caller's emission array), test_graph's CUDA replays (forward thread order,
#   and again under reverse and shuffled orders: label cuda_emu_orders, so that a race inside a
#   block changes a result), test_golden (every golden case on the CUDA backend too), test_fp8's
#   and test_rope_recall's CUDA cases, test_recall_step's CUDA decodes (16-bit against the oracle,
#   8-bit against the guarded backend's planes and sets), and the needle cell of
#   scripts/gpu-check.sh, whose CSV must be the CPU backend's byte for byte (and, registered by
#   tests/scripts/needle.cmake, cuda_emu_needle_adapt: the same with --recall-adapt's refits).
# Under KVT_SANITIZE a subset of test_cuda is also labelled cuda_emu_asan; under KVT_TSAN
# (Criterion cannot start there) test_cuda is built with the plain runner of tests/support/plain
# instead (test_cuda_tsan) and runs the same subset (label cuda_emu).
if(NOT KVT_CUDA_EMU)
  return()
endif()
# the model configs: tests/CMakeLists.txt's KVT_MODELS_DIR (tests/data/models unless overridden)
set(KVT_EMU_ENV KVT_REQUIRE_GPU=1 "KVT_MODELS_DIR=${KVT_MODELS_DIR}")

# The sanitizer legs' cases of test_cuda: the block-cooperative kernels (barriers, BlockScan,
# warp shuffles and votes, shared memory) at small sizes: select (radix top-m), pack with and
# without recall and paged (KVT_EMIT_PAGED), the eviction rounds, σ, sketches (warps), the
# recall scan (compaction), the attention (shuffles in double), and the backend's discipline
# tests. The recall steps' cases are
# left to the plain leg: under a sanitizer their CPU twins (the oracle, -O1, no FMA clones) take
# minutes.
set(KVT_EMU_SAN_CASES "select_segments_equal_the_cpu|score_rows_equal_the_cpu|pack_equals_the_cpu|pack_paged_equals_the_cpu|pack_recall_equals_the_cpu|eviction_rounds_equal_the_cpu|eviction_archive_merge_equals_the_cpu|sketch_rows_equal_the_cpu|recall_scan_equals_the_cpu|attend_equals_the_cpu|refused_score_rows_and_select_enqueue_nothing|workspace_growth_and_find_pos_leave_a_capture_alone|planned_step_past_its_reservation_is_refused")
if(KVT_TSAN)
  foreach(t test_cuda)
    add_executable(${t}_tsan ${CMAKE_CURRENT_SOURCE_DIR}/${t}.c
      ${CMAKE_CURRENT_SOURCE_DIR}/support/testutil.c ${CMAKE_CURRENT_SOURCE_DIR}/support/plain/plain_main.c)
    target_include_directories(${t}_tsan BEFORE PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/support/plain)
    target_include_directories(${t}_tsan PRIVATE ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
    target_link_libraries(${t}_tsan PRIVATE kvtier_static ${KVT_CUDART} PkgConfig::JANSSON
      ZLIB::ZLIB Threads::Threads ${KVT_LIBM})
    target_compile_definitions(${t}_tsan PRIVATE KVT_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
      KVT_BINARY_DIR="${PROJECT_BINARY_DIR}" KVT_HAVE_CUDA=1)
  endforeach()
  add_test(NAME cuda_emu_tsan_cuda COMMAND test_cuda_tsan "--filter=cuda/@(${KVT_EMU_SAN_CASES})")
  set_tests_properties(cuda_emu_tsan_cuda PROPERTIES LABELS cuda_emu ENVIRONMENT "${KVT_EMU_ENV}"
    TIMEOUT 900)
  return()
endif()

function(kvt_cuda_emu_test name label)
  add_test(NAME ${name} COMMAND ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS "${label}" ENVIRONMENT "${KVT_EMU_ENV};${KVT_EMU_EXTRA}"
    TIMEOUT 900)
endfunction()
set(KVT_EMU_EXTRA "")
if(KVT_SANITIZE) # ASan + UBSan: test_cuda's sanitizer cases (label cuda_emu_asan)
  kvt_cuda_emu_test(cuda_emu_asan_cuda cuda_emu_asan $<TARGET_FILE:test_cuda> --jobs 1
    "--filter=cuda/@(${KVT_EMU_SAN_CASES})")
endif()
kvt_cuda_emu_test(cuda_emu_cuda cuda_emu $<TARGET_FILE:test_cuda> --jobs 1)
kvt_cuda_emu_test(cuda_emu_graph cuda_emu $<TARGET_FILE:test_graph> --jobs 1 "--filter=graph/*_cuda")
kvt_cuda_emu_test(cuda_emu_paged cuda_emu $<TARGET_FILE:test_paged> --jobs 1 "--filter=paged/*_cuda")
kvt_cuda_emu_test(cuda_emu_golden cuda_emu $<TARGET_FILE:test_golden> --jobs 1)
kvt_cuda_emu_test(cuda_emu_fp8 cuda_emu $<TARGET_FILE:test_fp8> --jobs 1 "--filter=fp8/*_cuda")
kvt_cuda_emu_test(cuda_emu_rope cuda_emu $<TARGET_FILE:test_rope_recall> --jobs 1 "--filter=*/*_cuda")
kvt_cuda_emu_test(cuda_emu_recall_step cuda_emu $<TARGET_FILE:test_recall_step> --jobs 1
  "--filter=recall_step/@(conformal_decode_matches_the_oracle|scan_bits_8_emits_a_superset_and_snapshots)")
set(KVT_EMU_EXTRA KVT_EMU_ORDER=reverse)
kvt_cuda_emu_test(cuda_emu_graph_reverse cuda_emu_orders $<TARGET_FILE:test_graph> --jobs 1 "--filter=graph/*_cuda")
set(KVT_EMU_EXTRA KVT_EMU_ORDER=shuffle:20261205)
kvt_cuda_emu_test(cuda_emu_graph_shuffle cuda_emu_orders $<TARGET_FILE:test_graph> --jobs 1 "--filter=graph/*_cuda")
set(KVT_EMU_EXTRA "")
if(TARGET kvtier-needle)
  set(KVT_EMU_NEEDLE ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu_needle.cmake)
  file(WRITE ${KVT_EMU_NEEDLE} [=[
set(cell --synthetic --context 8192 --ratio 8,32 --mode salience,random,dense --needles 2 --seed 3 --no-progress)
foreach(b cpu cuda)
  execute_process(COMMAND ${BIN} ${cell} --backend ${b} --csv ${DIR}/cuda_emu_needle_${b}.csv
    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvtier-needle --backend ${b}: exit status ${rc}: ${err}")
  endif()
endforeach()
file(READ ${DIR}/cuda_emu_needle_cpu.csv a)
file(READ ${DIR}/cuda_emu_needle_cuda.csv b)
if(NOT a STREQUAL b OR a STREQUAL "")
  message(FATAL_ERROR "the needle cell's CSV on the CUDA backend differs from the CPU's (${DIR}/cuda_emu_needle_*.csv)")
endif()
]=])
  kvt_cuda_emu_test(cuda_emu_needle cuda_emu ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle>
    -DDIR=${CMAKE_CURRENT_BINARY_DIR} -P ${KVT_EMU_NEEDLE})
endif()
