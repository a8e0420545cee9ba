# The layer rule (DESIGN §3; tests/scripts/check_layers.py): includes and calls point down only.
# The calls are read from the library's object files with nm (their list is written at generate
# time). The second test runs the checker on a fixture tree with four wrong-way includes (one of
# them recall/kernels/, at the kernels rank, including recall/), one
# include of a header private to another folder, one wrong-way call and one lib/ call cycle (its
# library files compiled here) and expects each reported, so the first cannot pass by checking
# nothing.
find_package(Python3 COMPONENTS Interpreter REQUIRED)
file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/kvtier_objects.txt
     CONTENT "$<JOIN:$<TARGET_OBJECTS:kvtier_obj>,\n>\n")
add_test(NAME include_layers
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_layers.py
          ${PROJECT_SOURCE_DIR} --objects ${CMAKE_CURRENT_BINARY_DIR}/kvtier_objects.txt
          --nm ${CMAKE_NM})
set(KVT__LAYERS_BAD ${CMAKE_CURRENT_SOURCE_DIR}/data/layers_bad)
add_library(layers_bad_obj OBJECT ${KVT__LAYERS_BAD}/kernels/k.c ${KVT__LAYERS_BAD}/tiers/t.c
            ${KVT__LAYERS_BAD}/lib/c1.c ${KVT__LAYERS_BAD}/lib/c2.c)
target_include_directories(layers_bad_obj PRIVATE ${KVT__LAYERS_BAD} ${KVT__LAYERS_BAD}/lib)
file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/layers_bad_objects.txt
     CONTENT "$<JOIN:$<TARGET_OBJECTS:layers_bad_obj>,\n>\n")
add_test(NAME include_layers_catch_violations
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_layers.py
          ${KVT__LAYERS_BAD} --objects ${CMAKE_CURRENT_BINARY_DIR}/layers_bad_objects.txt
          --nm ${CMAKE_NM})
set_tests_properties(include_layers_catch_violations PROPERTIES
  PASS_REGULAR_EXPRESSION "lib/c1.c:3: includes tiers/t_internal.h, private to tiers/.*lib/base/b.c:2: base includes kernels/k.h.*kernels/k.c:4: kernels includes tiers/t.h.*recall/kernels/rk.c:5: recall/kernels includes recall/r.h \\(recall\\).*tools/t/main.c:3: tools/ includes kernels/k.h.*kernels/k.c: kernels calls kvt__fixture_tier, defined in tiers/t.c \\(tiers\\).*lib/ call cycle among lib/c1.c, lib/c2.c: lib/c1.c -> lib/c2.c \\(kvt__fixture_lib_two\\). lib/c2.c -> lib/c1.c \\(kvt__fixture_lib_one\\).*5 crossing the wrong way. 4 objects, [0-9]+ references, 1 calls crossing the wrong way, 1 lib/ call cycles")
# (One expression: a ";" would make CMake split it into a list, any one of which passing the test.)
