# test_recall runs kvtier-inspect calibrate on the synthetic traces it writes: when the tools are
# built (tools/ is added before tests/); without them (KVT_BUILD_TOOLS=OFF, e.g. the valgrind and
# TSan configurations) that test skips with a message.
if(TARGET kvtier-inspect)
  add_dependencies(${t} kvtier-inspect)
  target_compile_definitions(${t} PRIVATE KVT_HAVE_INSPECT=1)
endif()
target_compile_definitions(${t} PRIVATE $<$<BOOL:${KVT_HAVE_LAPACKE}>:KVT_HAVE_LAPACKE=1>)
