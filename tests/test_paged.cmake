# test_paged's CUDA case makes a stream with the CUDA runtime (the library's own, static).
if(KVT_HAVE_CUDA)
  target_link_libraries(${t} PRIVATE ${KVT_CUDART})
endif()
