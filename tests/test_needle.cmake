# test_needle: links the needle suite's engine (tools/needle/core). When the tools are not built
# (KVT_BUILD_TOOLS=OFF) the library is built here from the same sources.
if(NOT TARGET kvtier_needle_core)
  file(GLOB KVT_NEEDLE_CORE_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tools/needle/core/*.c)
  add_library(kvtier_needle_core STATIC ${KVT_NEEDLE_CORE_SOURCES})
  target_include_directories(kvtier_needle_core PUBLIC ${PROJECT_SOURCE_DIR}
    ${PROJECT_SOURCE_DIR}/tools/needle/core)
  target_link_libraries(kvtier_needle_core PUBLIC kvtier_static ${KVT_LIBM})
endif()
target_link_libraries(${t} PRIVATE kvtier_needle_core)
# The floors run 8k and 32k haystacks through the manager: give them room on a slow machine.
set_tests_properties(${t} PROPERTIES TIMEOUT 600)
