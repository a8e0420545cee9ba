# What a missing build dependency should tell the user: the Debian package that provides it and
# the one command that installs everything kvtier builds with. scripts/deps.sh is the list's one
# source (its `pkgs=(...)` line, read here), so this message and the script cannot disagree.
# A `pip install ./python` on a machine without them reaches the same message (scikit-build-core
# prints CMake's output when the configure step fails).
file(STRINGS ${PROJECT_SOURCE_DIR}/scripts/deps.sh KVT__DEPS_LINE REGEX "^pkgs=\\(")
string(REGEX REPLACE "^pkgs=\\((.*)\\).*" "\\1" KVT_DEBIAN_PACKAGES "${KVT__DEPS_LINE}")

# kvt_missing_dependency(WHAT DEBIAN_PACKAGE [HINT]): stop the configure step, naming both.
function(kvt_missing_dependency what deb)
  set(hint "")
  if(ARGC GREATER 2)
    set(hint " ${ARGV2}")
  endif()
  message(FATAL_ERROR
    "kvtier: ${what} was not found: install the Debian/Ubuntu package ${deb}.${hint}\n"
    "Every system package kvtier builds and tests with (scripts/deps.sh installs them):\n"
    "  sudo apt-get install ${KVT_DEBIAN_PACKAGES}\n")
endfunction()

# kvt_require_pkg(PREFIX MODULE DEBIAN_PACKAGE [HINT]): pkg_check_modules(PREFIX IMPORTED_TARGET
# MODULE), failing with kvt_missing_dependency instead of pkg-config's bare "not found". A macro,
# so that pkg_check_modules's variables land in the caller's scope as a direct call's would.
macro(kvt_require_pkg prefix module deb)
  pkg_check_modules(${prefix} QUIET IMPORTED_TARGET ${module})
  if(NOT ${prefix}_FOUND)
    kvt_missing_dependency("${module} (pkg-config module)" ${deb} ${ARGN})
  endif()
endmacro()
