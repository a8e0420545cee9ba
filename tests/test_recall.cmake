# test_recall runs kvtier-inspect calibrate on the synthetic traces it writes.
add_dependencies(${t} kvtier-inspect)
target_compile_definitions(${t} PRIVATE $<$<BOOL:${KVT_HAVE_LAPACKE}>:KVT_HAVE_LAPACKE=1>)
