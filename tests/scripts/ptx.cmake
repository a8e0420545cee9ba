# What ptxas makes of the CUDA backend's kernels (scripts/ptx-check.sh, sm_90, the build's
# floating-point flags): no kernel spills registers, and the scan, step, RoPE and pack kernels
# read their rows' elements (bf16, fp16, fp32, fp8) with aligned loads of 2 bytes or more: every
# byte load in their PTX is traced to its source line and must read a 1-byte datum (a flag, a bool
# field; the script's ONE_BYTE list). Issue 33 item 4. Needs nvcc, not a device.
if(KVT_HAVE_CUDA AND NOT KVT_CUDA_EMU AND CMAKE_CUDA_COMPILER)
  add_test(NAME ptxas_no_spills
    COMMAND ${PROJECT_SOURCE_DIR}/scripts/ptx-check.sh ${CMAKE_CUDA_COMPILER})
  set_tests_properties(ptxas_no_spills PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
