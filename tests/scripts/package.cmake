# Packaging tests: the installed tree works from an outside CMake project, and the shared
# library loads from python3 through ctypes (with and without jemalloc preloaded).
set(KVT_KIMI_CONFIG ${KVT_MODELS_DIR}/kimi-linear-48b-a3b-instruct.json)
# Not under the sanitizers: an outside program would link the instrumented library without the
# ASan runtime first. The two other test configurations run it.
if(NOT KVT_SANITIZE)
add_test(NAME package_outside_project
  COMMAND ${CMAKE_COMMAND} -DBIN=${PROJECT_BINARY_DIR} -DSRC=${PROJECT_SOURCE_DIR}
          -DWORK=${PROJECT_BINARY_DIR}/outside -DCONFIG=${KVT_KIMI_CONFIG}
          -P ${CMAKE_CURRENT_SOURCE_DIR}/support/outside.cmake)
set_tests_properties(package_outside_project PROPERTIES PASS_REGULAR_EXPRESSION "bytes/token")
endif()
find_program(KVT_PYTHON3 python3)
if(KVT_PYTHON3 AND NOT KVT_SANITIZE)
  add_test(NAME package_ctypes_load
    COMMAND ${KVT_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/support/ctypes_check.py
            $<TARGET_FILE:kvtier> ${KVT_KIMI_CONFIG} libc)
  set_tests_properties(package_ctypes_load PROPERTIES PASS_REGULAR_EXPRESSION "ctypes: ok")
  if(KVT_JEMALLOC)
    find_file(KVT_JEMALLOC_SO libjemalloc.so.2 PATHS /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib)
    if(KVT_JEMALLOC_SO)
      add_test(NAME package_ctypes_jemalloc_preload
        COMMAND ${CMAKE_COMMAND} -E env LD_PRELOAD=${KVT_JEMALLOC_SO}
                ${KVT_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/support/ctypes_check.py
                $<TARGET_FILE:kvtier> ${KVT_KIMI_CONFIG} jemalloc)
      set_tests_properties(package_ctypes_jemalloc_preload PROPERTIES PASS_REGULAR_EXPRESSION "ctypes: ok")
    endif()
  endif()
endif()
