# The repository stands alone (a clone in any folder runs both commands): no file of it reads the
# sibling folder beside the checkout. The second test gives the checker a fixture that does and
# expects it named, so the first cannot pass by checking nothing.
add_test(NAME standalone_no_sibling_reads
  COMMAND ${CMAKE_COMMAND} -DROOT=${PROJECT_SOURCE_DIR}
          -P ${CMAKE_CURRENT_SOURCE_DIR}/scripts/run/no_shared.cmake)
set(KVT_STANDALONE_FIXTURE ${CMAKE_CURRENT_BINARY_DIR}/standalone_fixture)
set(KVT_SIBLING "..")
string(APPEND KVT_SIBLING "/shared") # (not spelled out: this file would read as a reader)
file(WRITE ${KVT_STANDALONE_FIXTURE}/reads.sh "cat ${KVT_SIBLING}/models/x.json\n")
add_test(NAME standalone_catches_sibling_reads
  COMMAND ${CMAKE_COMMAND} -DROOT=${KVT_STANDALONE_FIXTURE}
          -P ${CMAKE_CURRENT_SOURCE_DIR}/scripts/run/no_shared.cmake)
set_tests_properties(standalone_catches_sibling_reads PROPERTIES
  PASS_REGULAR_EXPRESSION "these files read \\.\\./shared: reads\\.sh")
