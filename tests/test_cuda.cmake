# test_cuda skips without a device; its self-check runs the same tests with the guarded backend
# in CUDA's place (every pointer handed to an op must be a backend buffer there too), so the
# tests themselves are checked on every machine.
add_test(NAME test_cuda_selfcheck COMMAND ${t} --jobs 1)
set_tests_properties(test_cuda_selfcheck PROPERTIES ENVIRONMENT "KVT_CUDA_TEST_SELFCHECK=1")
