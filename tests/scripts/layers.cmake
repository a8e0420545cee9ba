# The layer rule (DESIGN §3; tests/scripts/check_layers.py): includes point down only. The second
# test runs the checker on a fixture tree with three wrong-way includes and expects it to fail, so
# the first cannot pass by checking nothing.
find_package(Python3 COMPONENTS Interpreter REQUIRED)
add_test(NAME include_layers
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_layers.py ${PROJECT_SOURCE_DIR})
add_test(NAME include_layers_catch_violations
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_layers.py
          ${CMAKE_CURRENT_SOURCE_DIR}/data/layers_bad)
set_tests_properties(include_layers_catch_violations PROPERTIES
  PASS_REGULAR_EXPRESSION "lib/base/b.c:2: base includes kernels/k.h.*kernels/k.c:3: kernels includes tiers/t.h.*tools/t/main.c:3: tools/ includes kernels/k.h.*3 crossing the wrong way")
