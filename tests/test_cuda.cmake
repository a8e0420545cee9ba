# test_cuda skips without a device; its self-check runs the same tests with the guarded backend
# in CUDA's place (every pointer handed to an op must be a backend buffer there too), so the
# tests themselves are checked on every machine.
add_test(NAME test_cuda_selfcheck COMMAND ${t} --jobs 1)
set_tests_properties(test_cuda_selfcheck PROPERTIES ENVIRONMENT "KVT_CUDA_TEST_SELFCHECK=1")
# Its capture cases make streams and captures with the CUDA runtime (the library's own, or the
# emulation's headers).
if(KVT_HAVE_CUDA)
  target_link_libraries(${t} PRIVATE ${KVT_CUDART})
endif()
