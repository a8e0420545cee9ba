# test_philox: build the cuRAND oracles in where the CUDA toolkit is installed.
#
# The oracles need only the toolkit's headers and libcurand (cuRAND's device API compiled for the
# host, and its host generator), not the CUDA language and not a GPU, so they are built whenever
# the toolkit is found, also with -DKVT_CUDA=OFF. Without it the cuRAND tests skip with a message;
# under KVT_REQUIRE_CURAND=1 (set by CI where libcurand exists) they fail instead.
if(NOT TARGET CUDA::curand)
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
endif()

if(TARGET CUDA::curand)
  # curand_kernel.h is C++; the oracle is compiled by the host C++ compiler.
  enable_language(CXX)
  set(KVT_CURAND_ORACLE ${CMAKE_CURRENT_SOURCE_DIR}/support/curand_oracle.cu)
  set_source_files_properties(${KVT_CURAND_ORACLE} PROPERTIES LANGUAGE CXX)
  target_sources(${t} PRIVATE ${KVT_CURAND_ORACLE})
  target_link_libraries(${t} PRIVATE CUDA::curand)
  target_compile_definitions(${t} PRIVATE KVT_HAVE_CURAND=1)
  message(STATUS "test_philox: cuRAND oracle built in (CUDA toolkit ${CUDAToolkit_VERSION})")

  # The same file through nvcc, host and device, compile only: kernels/philox.h must stay
  # readable by nvcc. Independent of the CUDA language, so it also runs with KVT_CUDA=OFF.
  if(CUDAToolkit_NVCC_EXECUTABLE AND EXISTS ${CUDAToolkit_NVCC_EXECUTABLE})
    if(CMAKE_CUDA_ARCHITECTURES MATCHES "^([0-9]+)")
      set(KVT_PHILOX_NVCC_ARCH ${CMAKE_MATCH_1})
    else()
      set(KVT_PHILOX_NVCC_ARCH 90)
    endif()
    set(KVT_PHILOX_NVCC_OBJ ${CMAKE_CURRENT_BINARY_DIR}/philox_nvcc_check.o)
    add_custom_command(OUTPUT ${KVT_PHILOX_NVCC_OBJ}
      COMMAND ${CUDAToolkit_NVCC_EXECUTABLE} -std=c++17 -arch=sm_${KVT_PHILOX_NVCC_ARCH}
              --Werror all-warnings -Xcompiler -Wall,-Wextra
              -I${PROJECT_SOURCE_DIR} -I${CMAKE_CURRENT_SOURCE_DIR}
              -x cu -c ${KVT_CURAND_ORACLE} -o ${KVT_PHILOX_NVCC_OBJ}
      DEPENDS ${KVT_CURAND_ORACLE} ${PROJECT_SOURCE_DIR}/kernels/philox.h
              ${PROJECT_SOURCE_DIR}/kernels/kvt_hd.h
              ${CMAKE_CURRENT_SOURCE_DIR}/support/curand_oracle.h
      COMMENT "nvcc compile check: kernels/philox.h in host and device code"
      VERBATIM)
    add_custom_target(test_philox_nvcc_check DEPENDS ${KVT_PHILOX_NVCC_OBJ})
    add_dependencies(${t} test_philox_nvcc_check)
  endif()
else()
  message(STATUS "test_philox: no CUDA toolkit (headers + libcurand): cuRAND comparisons will "
                 "skip, or fail when KVT_REQUIRE_CURAND=1")
  if("$ENV{KVT_REQUIRE_CURAND}" STREQUAL "1")
    message(WARNING "KVT_REQUIRE_CURAND=1 but the CUDA toolkit was not found: test_philox will fail")
  endif()
endif()
