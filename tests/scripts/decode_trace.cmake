# needle_decode_trace_*: kvtier-needle reads any valid trace (issue 32). A trace written by
# tests/scripts/decode_trace.py from docs/trace-format.md alone (the container helpers of
# tests/golden/make_golden.py, not the library's writer) with a decode phase and no provenance
# text: --mode recall must run on it (the decode phase is what its QUERIES sections say), with a
# basis kvtier-inspect calibrate fitted on another seed's trace, as a user would; the same trace
# with the needle generator's provenance lines must give the same table (provenance decides
# nothing). Without a basis, recall cannot run on a trace: it says so, salience and dense are
# still measured, and the exit status is 3.
find_package(Python3 COMPONENTS Interpreter)
if(TARGET kvtier-needle AND TARGET kvtier-inspect AND Python3_Interpreter_FOUND)
  set(KVT_DECODE_TRACE_CHECK ${CMAKE_CURRENT_BINARY_DIR}/decode_trace_check.cmake)
  file(WRITE ${KVT_DECODE_TRACE_CHECK} [=[
function(run out_var rc_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${out_var} "${out}${err}" PARENT_SCOPE)
  set(${rc_var} ${rc} PARENT_SCOPE)
endfunction()
foreach(x "plain;7" "prov;7;--provenance" "other;8")
  list(GET x 0 name)
  list(GET x 1 seed)
  set(flag "")
  list(LENGTH x n)
  if(n GREATER 2)
    list(GET x 2 flag)
  endif()
  run(o rc ${PY} ${WRITER} ${DIR}/decode_${name}.kvtt --seed ${seed} ${flag})
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "decode_trace.py ${name}: ${rc}: ${o}")
  endif()
endforeach()
run(o rc ${INSPECT} trace ${DIR}/decode_plain.kvtt --verify)
if(NOT rc EQUAL 0 OR NOT o MATCHES "verify: OK" OR NOT o MATCHES "provenance: none")
  message(FATAL_ERROR "the written trace does not verify, or carries provenance: ${o}")
endif()
run(o rc ${INSPECT} calibrate ${DIR}/decode_other.kvtt -o ${DIR}/decode_other.basis --rank 16)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "calibrate: ${rc}: ${o}")
endif()
set(args --layer 2 --block 64 --kappa 4 --ratio 8 --mode salience,recall,dense --no-progress)
run(plain rc ${BIN} --trace ${DIR}/decode_plain.kvtt ${args} --recall-basis ${DIR}/decode_other.basis)
if(NOT rc EQUAL 0 OR NOT plain MATCHES "\nrecall +no +trace +2k +8 +3 " OR NOT plain MATCHES "recall conformal 2k 8x")
  message(FATAL_ERROR "recall on a trace without provenance: exit ${rc}:\n${plain}")
endif()
run(prov rc ${BIN} --trace ${DIR}/decode_prov.kvtt ${args} --recall-basis ${DIR}/decode_other.basis)
string(REGEX REPLACE "time: [^\n]*\n" "" plain "${plain}")
string(REGEX REPLACE "time: [^\n]*\n" "" prov "${prov}")
string(REPLACE "decode_prov" "decode_plain" prov "${prov}")
if(NOT rc EQUAL 0 OR NOT plain STREQUAL prov)
  message(FATAL_ERROR "provenance changed the measurement (exit ${rc}):\n${plain}\n---\n${prov}")
endif()
run(o rc ${BIN} --trace ${DIR}/decode_plain.kvtt ${args})
if(NOT rc EQUAL 3 OR NOT o MATCHES "recall was not measured" OR NOT o MATCHES "\nsalience +no +trace"
   OR NOT o MATCHES "\ndense +no +trace" OR o MATCHES "\nrecall +no")
  message(FATAL_ERROR "recall without a basis: want exit 3 with salience and dense measured, got ${rc}:\n${o}")
endif()
]=])
  add_test(NAME needle_decode_trace_without_provenance
    COMMAND ${CMAKE_COMMAND} -DBIN=$<TARGET_FILE:kvtier-needle>
            -DINSPECT=$<TARGET_FILE:kvtier-inspect> -DPY=${Python3_EXECUTABLE}
            -DWRITER=${CMAKE_CURRENT_SOURCE_DIR}/scripts/decode_trace.py
            -DDIR=${CMAKE_CURRENT_BINARY_DIR} -P ${KVT_DECODE_TRACE_CHECK})
  set_tests_properties(needle_decode_trace_without_provenance PROPERTIES TIMEOUT 300)
endif()
