# What ptxas makes of the CUDA backend's kernels (scripts/ptx-check.sh, sm_90, the build's
# floating-point flags): no kernel spills registers. The script's full check (no byte loads in
# the scan, step and pack kernels) is issue 33's open item 4 and is not a test yet.
if(KVT_HAVE_CUDA AND NOT KVT_CUDA_EMU AND CMAKE_CUDA_COMPILER)
  add_test(NAME ptxas_no_spills
    COMMAND ${PROJECT_SOURCE_DIR}/scripts/ptx-check.sh --spills-only ${CMAKE_CUDA_COMPILER})
  set_tests_properties(ptxas_no_spills PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
