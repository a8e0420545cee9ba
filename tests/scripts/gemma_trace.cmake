# needle_gemma_trace: a real trace (tests/data/gemma3-270m-fact-1k.kvtt, provenance beside it)
# replayed by kvtier-needle on each of its three GQA-RoPE layers (5, 11, 17 of Gemma-3-270M):
# everything attended (dense) and random eviction at 4x and 8x, on the CPU backend and, for
# layer 5, the guarded one (same CSV). The CSV must equal the expected one byte for byte: the
# replay is deterministic (Philox draws keyed by seed and request; double-precision attention
# in a fixed order, no FMA contraction under -std=c11), so any change in what kvtier keeps or in
# how the needle suite measures it shows up here. Under a second each.
if(TARGET kvtier-needle)
  set(KVT_GEMMA_TRACE_CHECK ${CMAKE_CURRENT_BINARY_DIR}/gemma_trace_check.cmake)
  file(WRITE ${KVT_GEMMA_TRACE_CHECK} [=[
set(all "")
foreach(run 5:cpu 11:cpu 17:cpu 5:guarded)
  string(REPLACE ":" ";" rb "${run}")
  list(GET rb 0 layer)
  list(GET rb 1 backend)
  set(csv ${OUT_DIR}/gemma_trace_${layer}_${backend}.csv)
  execute_process(COMMAND ${BIN} --trace ${TRACE} --layer ${layer} --mode dense,salience
                          --ratio 4,8 --backend ${backend} --no-progress --csv ${csv}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "layer ${layer} (${backend}): exit status ${rc}: ${err}${out}")
  endif()
  file(STRINGS ${csv} lines)
  list(POP_FRONT lines header)
  if(all STREQUAL "")
    set(all "${header}\n")
  endif()
  foreach(l ${lines})
    string(APPEND all "${l}\n")
  endforeach()
endforeach()
file(WRITE ${OUT_DIR}/gemma_trace.csv "${all}")
file(READ ${EXPECTED} want)
if(NOT all STREQUAL want)
  message(FATAL_ERROR
    "the replay CSV differs from ${EXPECTED}:\n--- got\n${all}--- expected\n${want}")
endif()
]=])
  add_test(NAME needle_gemma_trace
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle>
            -DTRACE=${PROJECT_SOURCE_DIR}/tests/data/gemma3-270m-fact-1k.kvtt
            -DEXPECTED=${PROJECT_SOURCE_DIR}/tests/data/gemma3-270m-fact-1k.expected.csv
            -DOUT_DIR=${CMAKE_CURRENT_BINARY_DIR} -P ${KVT_GEMMA_TRACE_CHECK})
endif()
