# ctest driver: install the build tree into a scratch prefix, then configure, build and run
# tests/outside against it with find_package(kvtier). Variables: BIN, SRC, WORK, CONFIG.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BIN} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC}/tests/outside -B ${WORK}/build
                        -DCMAKE_PREFIX_PATH=${WORK}/prefix RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configure of the outside project failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "build of the outside project failed: ${rc}")
endif()
execute_process(COMMAND ${WORK}/build/outside ${CONFIG} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
message("${out}${err}")
if(rc)
  message(FATAL_ERROR "outside program failed: ${rc}")
endif()
# The pkg-config file is installed too.
if(NOT EXISTS ${WORK}/prefix/lib/pkgconfig/kvtier.pc AND NOT EXISTS ${WORK}/prefix/lib/x86_64-linux-gnu/pkgconfig/kvtier.pc)
  message(FATAL_ERROR "kvtier.pc not installed")
endif()
