# The build contract without nvcc: KVT_CUDA=ON fails at configure with a clear message, AUTO
# configures a CPU-only build. nvcc is hidden by searching an empty CUDA root and a PATH of
# system directories only.
if(NOT KVT_SANITIZE)
  foreach(mode ON AUTO)
    add_test(NAME configure_without_nvcc_${mode}
      COMMAND ${CMAKE_COMMAND} -E env PATH=/usr/bin:/bin --unset=CUDACXX
              ${CMAKE_COMMAND} -S ${PROJECT_SOURCE_DIR} -B ${PROJECT_BINARY_DIR}/configure-no-nvcc-${mode}
              -DKVT_CUDA=${mode} -DKVT_CUDA_ROOT=/nonexistent -DKVT_BUILD_TESTS=OFF)
  endforeach()
  set_tests_properties(configure_without_nvcc_ON PROPERTIES
    WILL_FAIL FALSE PASS_REGULAR_EXPRESSION "KVT_CUDA=ON but no CUDA compiler \\(nvcc\\) was found")
  set_tests_properties(configure_without_nvcc_AUTO PROPERTIES
    PASS_REGULAR_EXPRESSION "nvcc not found; building the CPU backend only.*Generating done")
endif()
