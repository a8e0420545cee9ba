# The seam rule (lib/base/seam.h, tests/scripts/check_seams.py): only lib/base/alloc.c calls the
# system's allocation functions and only lib/base/io.c its file functions, checked on every object
# of the library. The second test runs the checker with the seam files unexempted and expects it
# to name their calls, so the first cannot pass by checking nothing.
find_package(Python3 COMPONENTS Interpreter REQUIRED)
add_test(NAME seams_no_raw_calls
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_seams.py
          $<TARGET_OBJECTS:kvtier_obj>
  COMMAND_EXPAND_LISTS)
add_test(NAME seams_catch_raw_calls
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_seams.py --no-seam
          $<TARGET_OBJECTS:kvtier_obj>
  COMMAND_EXPAND_LISTS)
set_tests_properties(seams_catch_raw_calls PROPERTIES
  PASS_REGULAR_EXPRESSION "lib/base/alloc.c.o: calls malloc .*lib/base/io.c.o: calls open ")
